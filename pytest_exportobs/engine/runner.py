"""Check the groups within the session's time limit (``--export-timeout``): each in a forked child
(``--export-isolate``), ``--export-jobs`` children at once, or one after the other in process
(:mod:`.placement` decides which).

Ctrl-C (``KeyboardInterrupt``) stops the checks at once (forked children are killed): the models
being checked and those not begun are ``interrupted``.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from ..core.vocabulary import Kind, Stage, Verdict
from ..observe.store import ModelGroup
from .base.result import ModelResult
from .base.settings import CheckSettings
from .check import check_model, settled
from .explore.variations import prepare_variations
from .export.cache import ExportCache
from .export.pipeline import prepare
from .limits import ModelTimeout, time_limit
from .placement import CheckCosts, place
from .spilled import SpilledWeights, return_free_memory

_STEP_WORDS = {Stage.TORCH_EXPORT: "export"}  # the export step runs torch.export and the translation


@dataclass
class _Progress:
    """Follows the stage a check has reached, and writes one line per step when asked to."""

    prefix: str
    write: Callable[[str], None] | None
    stage: Stage = Stage.INFER
    begin: float = field(default_factory=time.perf_counter)
    seconds: float = 0.0  # the check's, once done

    def __call__(self, stage: Stage, graph: str = "") -> None:
        self.stage = stage
        step = _STEP_WORDS.get(stage, stage.value) + (f" [{graph}]" if graph else "")
        self.line(f"{step} ({time.perf_counter() - self.begin:.1f}s)")

    def done(self, result: ModelResult) -> ModelResult:
        """Write the verdict and the time the check took; return ``result``."""
        self.seconds = time.perf_counter() - self.begin
        self.line(f"{result.verdict} in {self.seconds:.1f}s")
        return result

    def line(self, text: str) -> None:
        if self.write:
            self.write(f"{self.prefix}: {text}")


def check_all(
    groups: Iterable[ModelGroup], settings: CheckSettings, isolate: bool,
    progress: Callable[[str], None] | None = None, jobs: int = 1, threads: int | None = None,
) -> Iterator[ModelResult]:
    """Yield one result per group, in the order the checks end; ``progress`` receives one line
    per model and stage.  With ``isolate`` or ``jobs`` > 1 checks run in forked children,
    ``jobs`` of them at once, the most expensive first, and meanwhile the checks the export
    cache is expected to serve in process (see :mod:`.placement`).  A check in process runs with
    ``threads`` torch threads per job no child takes (``None``: as many as now for all the
    jobs), a forked one with one (see
    :func:`_child`); forked checks run with the models' weights on disk (:mod:`.spilled`), each
    child mapping its own.  What each check is expected to take next time is recorded."""
    groups = list(groups)
    total, first = len(groups), 1
    unsettled = []  # a group with nothing to export needs no check, nor a process of its own
    for group in groups:
        if (result := settled(group)) is None:
            unsettled.append(group)
            continue
        yield _Progress(f"exportobs [{first}/{total}] {group.name}", progress).done(result)
        first += 1
    groups = unsettled
    if not groups:
        return
    costs = CheckCosts(groups, settings)
    placed = place(groups, costs, isolate, jobs)
    ordered = placed.forked + placed.in_process
    trackers = {id(g): _Progress(f"exportobs [{i}/{total}] {g.name}", progress) for i, g in enumerate(ordered, first)}
    cores = _Cores(torch.get_num_threads() if threads is None else threads * jobs, jobs)
    if placed.forked:
        phase = _forked_phase(placed.forked, placed.in_process, settings, trackers, jobs, cores)
    else:
        phase = _in_process_phase(placed.in_process, settings, trackers, cores.threads(0))
    yield from _recorded(phase, ordered, trackers, costs)


@dataclass(frozen=True)
class _Cores:
    """The torch threads of the checks in this process: ``threads`` when no child runs, the
    share of the ``jobs`` no child takes otherwise."""

    threads_alone: int
    jobs: int

    def threads(self, children: int) -> int:
        return max(1, self.threads_alone * (self.jobs - children) // self.jobs)


def _recorded(
    results: Iterator[ModelResult], groups: list[ModelGroup], trackers: dict[int, _Progress], costs: CheckCosts,
) -> Iterator[ModelResult]:
    """``results``, what each check took recorded (an interrupted one's means nothing)."""
    by_name = {g.name: g for g in groups}
    for result in results:
        group = by_name.get(result.name)
        if group is not None and result.verdict != Verdict.INTERRUPTED:
            costs.record(group, result, trackers[id(group)].seconds)
        yield result


def _forked_phase(
    groups: list[ModelGroup], in_process: list[ModelGroup], settings: CheckSettings, trackers: dict[int, _Progress],
    jobs: int, cores: _Cores,
) -> Iterator[ModelResult]:
    """The forked checks, their weights spilled to disk meanwhile, and the checks ``in_process``
    in this process while they run."""
    spilled = None
    try:
        spilled = SpilledWeights.spill(groups, settings.export_dir)  # first: the imports grow a smaller heap
        return_free_memory()
        # once for every child (in turn, the first export imports; a rerun the cache serves needs
        # no registry, and its variations come from the cache)
        translating = not settings.use_cache or not ExportCache(settings.cache_dir).holds_traces()
        prepare(settings.target, translating)
        if translating:
            prepare_variations(settings.hypothesis_dir)
    except KeyboardInterrupt:
        if spilled is not None:
            spilled.remove()
        yield from map(interrupted, groups + in_process)
        return
    here = _Here([(g, trackers[id(g)]) for g in in_process], cores)
    with _heap_frozen(), _threads_kept():
        try:
            yield from _forked(groups, settings, [trackers[id(g)] for g in groups], min(jobs, len(groups)), spilled,
                               here)
        finally:
            if spilled is not None:
                spilled.remove()


def _in_process_phase(
    groups: list[ModelGroup], settings: CheckSettings, trackers: dict[int, _Progress], threads: int,
) -> Iterator[ModelResult]:
    """The checks in this process, one after the other, on ``threads`` torch threads."""
    with _threads_kept(), _heap_frozen():
        torch.set_num_threads(threads)
        yield from _in_turn(groups, settings, [trackers[id(g)] for g in groups])


@contextlib.contextmanager
def _threads_kept() -> Iterator[None]:
    """Around checks in this process: torch's thread count as it was before them."""
    previous = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@contextlib.contextmanager
def _heap_frozen() -> Iterator[None]:
    """The objects that exist before the checks, out of the garbage collector's reach while they
    run: the collections of a check (a tiny Llama's export starts about one full collection of the
    heap per model) walk only what the checks made, and a forked check neither walks nor copies
    its parent's objects (Python's advice for fork without exec).  Garbage among the frozen
    objects waits for the first collection after the block."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _in_turn(groups: list[ModelGroup], settings: CheckSettings, trackers: list[_Progress]) -> Iterator[ModelResult]:
    for position, (group, tracker) in enumerate(zip(groups, trackers)):
        try:
            result = _checked_here(group, settings, tracker)
        except KeyboardInterrupt:
            yield interrupted(group, tracker.stage)
            yield from map(interrupted, groups[position + 1:])
            return
        yield result


def _checked_here(group: ModelGroup, settings: CheckSettings, tracker: _Progress) -> ModelResult:
    """``group`` checked in this process within the time limit (Ctrl-C goes through)."""
    tracker.begin = time.perf_counter()
    try:
        with time_limit(settings.timeout):
            result = check_model(group, settings, tracker)
    except ModelTimeout:
        result = _timed_out(group, settings, tracker.stage)
    return tracker.done(result)


@dataclass
class _Here:
    """The checks to run in this process while forked ones run, on the cores no child takes."""

    checks: list[tuple[ModelGroup, _Progress]]
    cores: _Cores

    def next_check(self, children: int) -> tuple[ModelGroup, _Progress]:
        """The next check, torch's threads set to the cores ``children`` leave."""
        torch.set_num_threads(self.cores.threads(children))
        return self.checks.pop(0)


def interrupted(group: ModelGroup, stage: Stage | str = "") -> ModelResult:
    """The result of a model whose check Ctrl-C stopped at ``stage``, or never let begin."""
    when = f"during {stage}" if stage else "before its check began"
    return _result(group, verdict=Verdict.INTERRUPTED, stage=stage, kind=Kind.INTERRUPTED,
                   reason=f"interrupted (Ctrl-C) {when}")


def _result(group: ModelGroup, verdict: Verdict = Verdict.FAILED, **fields: Any) -> ModelResult:
    """A result the check itself could not give (time up, child dead or not started, Ctrl-C)."""
    return ModelResult(name=group.name, verdict=verdict, sources=list(group.sources),
                       model_class=group.model_class, n_observations=group.recorder.num_obs(), **fields)


def _timed_out(group: ModelGroup, settings: CheckSettings, stage: Stage) -> ModelResult:
    return _result(group, stage=stage, kind=Kind.TIMEOUT,
                   reason=f"timed out after {settings.timeout:g} s during {stage}")


# seconds between two wake-ups of the parent waiting for its children: a Ctrl-C whose signal
# another thread took is only seen when the main thread runs Python again
_WAKE = 0.5


@dataclass(eq=False)  # one per child: compared and found by identity
class _Child:
    """A check running in a forked child: its steps and result come through ``receiver``."""

    group: ModelGroup
    tracker: _Progress
    process: multiprocessing.process.BaseProcess
    receiver: Connection
    deadline: float | None
    data: dict[str, Any] | None = None

    def read(self) -> bool:
        """Take one message from the child; ``False`` once it has nothing more to say."""
        try:
            kind, value = self.receiver.recv()
        except EOFError:
            return False
        if kind == "result":
            self.data = value
        else:
            self.tracker(Stage(value[0]), value[1])
        return True

    def drain(self) -> bool:
        """Take every message the child has sent by now; ``False`` once it has nothing more to say."""
        while self.receiver.poll():
            if not self.read():
                return False
        return True

    def end(self) -> ModelResult:
        """Wait for the child to exit; its result, or the failure its death is."""
        self.process.join()
        self.receiver.close()
        if self.data is not None and self.process.exitcode == 0:
            return ModelResult.from_json(self.data)
        return _result(self.group, stage=Stage.ISOLATE, kind=Kind.ERROR,
                       reason=f"the isolated check process died ({_exit_reason(self.process.exitcode)})")

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.receiver.close()


def _forked(
    groups: list[ModelGroup], settings: CheckSettings, trackers: list[_Progress], jobs: int,
    spilled: SpilledWeights | None, here: _Here | None = None,
) -> Iterator[ModelResult]:
    """Check each group in a forked child, ``jobs`` at once: a native crash fails its model, not
    the session.  A child is killed when its time is up or the session is interrupted.  The
    weights ``spilled`` to disk are restored in each child.  The checks ``here`` run in this
    process meanwhile, one job's place taken from the children until they are done (a rerun's
    checks the export cache serves beside the forked checks of its largest models)."""
    waiting = list(zip(groups, trackers))
    local = here.checks if here is not None else []
    running: list[_Child] = []
    current: tuple[ModelGroup, _Progress] | None = None
    try:
        while waiting or running or local:
            while waiting and len(running) < max(1, jobs - bool(local)):
                started = _start(*waiting[0], settings, spilled)
                waiting.pop(0)  # only now: a Ctrl-C while starting leaves it waiting, reported interrupted
                if isinstance(started, _Child):
                    running.append(started)
                else:
                    yield started
            if local and here is not None:
                current = group, tracker = here.next_check(len(running))
                result = _checked_here(group, settings, tracker)
                current = None
                yield result
            for child, late in _ended(running, block=not local) if running else []:
                running.remove(child)
                yield child.tracker.done(_kill_timed_out(child, settings) if late else child.end())
    except KeyboardInterrupt:
        for child in running:
            child.kill()
        yield from (interrupted(c.group, c.tracker.stage) for c in running)
        if current is not None:
            yield interrupted(current[0], current[1].stage)
        yield from (interrupted(g) for g, _ in [*waiting, *local])


def _start(
    group: ModelGroup, tracker: _Progress, settings: CheckSettings, spilled: SpilledWeights | None,
) -> _Child | ModelResult:
    """Fork the child checking ``group``; the failure when it cannot be started."""
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=(group, settings, sender, spilled), daemon=True)
    tracker.begin = time.perf_counter()
    try:
        process.start()
    except OSError as e:
        receiver.close()
        return tracker.done(_result(group, stage=Stage.ISOLATE, kind=Kind.ENVIRONMENT,
                                    reason=f"could not start the isolated check process: {e}"))
    finally:
        sender.close()
    deadline = None if settings.timeout is None else time.monotonic() + settings.timeout
    return _Child(group, tracker, process, receiver, deadline)


def _ended(running: list[_Child], block: bool = True) -> list[tuple[_Child, bool]]:
    """Read the children's messages until some have ended or run out of time (``True``);
    without ``block``, those that have by now (maybe none)."""
    while True:
        deadlines = [c.deadline for c in running if c.deadline is not None]
        timeout = min([_WAKE, *(max(0.0, d - time.monotonic()) for d in deadlines)]) if block else 0.0
        readable = wait([c.receiver for c in running], timeout)
        done = [c for c in running if c.receiver in readable and not c.drain()]
        now = time.monotonic()
        late = [c for c in running if c not in done and c.deadline is not None and now >= c.deadline]
        if done or late or not block:
            return [(c, False) for c in done] + [(c, True) for c in late]


def _kill_timed_out(child: _Child, settings: CheckSettings) -> ModelResult:
    child.kill()
    return _timed_out(child.group, settings, child.tracker.stage)


def _child(
    group: ModelGroup, settings: CheckSettings, sender: Connection, spilled: SpilledWeights | None,
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to answer: it kills this process
    # one thread: GNU OpenMP (torch's) is not fork-safe, a parallel region of more threads waits
    # forever for the parent's thread team (the tests' models made it), which fork did not copy
    torch.set_num_threads(1)
    if spilled is not None:
        spilled.restore(group)
    result = check_model(group, settings, lambda stage, graph: sender.send(("step", (stage.value, graph))))
    sender.send(("result", result.to_json()))
    sender.close()
    os._exit(0)  # skip pytest's atexit handlers inherited by the fork


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"exit code {code}"
