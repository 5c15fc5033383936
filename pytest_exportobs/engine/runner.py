"""Check the groups within the session's time limit (``--export-timeout``): each in a forked child
(``--export-isolate``), ``--export-jobs`` children at once (each a few models of one family in
turn, without ``--export-isolate``), or one after the other in process (:mod:`.placement`
decides which).

Ctrl-C (``KeyboardInterrupt``) stops the checks at once (forked children are killed): the models
being checked and those not begun are ``interrupted``.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import math
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from ..core.vocabulary import Kind, Stage, Target, Verdict
from ..observe.store import ModelGroup
from .base.result import ModelResult
from .base.settings import CheckSettings
from .check import check_model, settled
from .children import Child, Progress, ended, interrupted, timed_out, unfinished
from .explore.variations import prepare_variations
from .export.pipeline import prepare
from .export.warmup import warm_up
from .limits import ModelTimeout, time_limit
from .placement import CheckCosts, place
from .spilled import SpilledWeights, return_free_memory


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
        yield Progress(f"exportobs [{first}/{total}] {group.name}", progress).done(result)
        first += 1
    groups = unsettled
    if not groups:
        return
    costs = CheckCosts(groups, settings)
    placed = place(groups, costs, isolate, jobs)
    ordered = placed.forked + placed.in_process
    trackers = {id(g): Progress(f"exportobs [{i}/{total}] {g.name}", progress) for i, g in enumerate(ordered, first)}
    cores = _Cores(torch.get_num_threads() if threads is None else threads * jobs, jobs)
    if placed.forked or jobs > 1 and len(placed.in_process) >= _HELPED:
        # a check with no record of a former one exports (a first run's, or a model changed since)
        translating = not settings.use_cache or any(costs.recorded(g) is None for g in placed.forked)
        phase = _forked_phase(placed.forked, placed.in_process, settings, trackers, jobs, cores, translating, isolate)
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
    results: Iterator[ModelResult], groups: list[ModelGroup], trackers: dict[int, Progress], costs: CheckCosts,
) -> Iterator[ModelResult]:
    """``results``, what each check took recorded (an interrupted one's means nothing)."""
    by_name = {g.name: g for g in groups}
    for result in results:
        group = by_name.get(result.name)
        if group is not None and result.verdict != Verdict.INTERRUPTED:
            costs.record(group, result, trackers[id(group)].seconds)
        yield result


def _forked_phase(
    groups: list[ModelGroup], in_process: list[ModelGroup], settings: CheckSettings, trackers: dict[int, Progress],
    jobs: int, cores: _Cores, translating: bool, isolate: bool,
) -> Iterator[ModelResult]:
    """The forked checks, their weights spilled to disk meanwhile, and the checks ``in_process``
    in this process while they run (half of them in a forked helper, when enough are left);
    ``translating``: some of them are expected to translate graphs (not served by the cache);
    ``isolate``: each forked check in a child of its own."""
    spilled = None
    try:
        spilled = SpilledWeights.spill(groups, settings.export_dir)  # first: the imports grow a smaller heap
        return_free_memory()
        # once for every child (in turn, the first export imports; a rerun the cache serves needs
        # no registry, and its variations come from the cache)
        prepare(settings.targets, translating)
        if translating:
            prepare_variations(settings.hypothesis_dir)
            if Target.ONNX in settings.targets and len(groups) >= _WARMED:
                warm_up()
    except KeyboardInterrupt:
        if spilled is not None:
            spilled.remove()
        yield from map(interrupted, groups + in_process)
        return
    here = _Here([(g, trackers[id(g)]) for g in in_process], cores)
    with _heap_frozen(), _threads_kept():
        try:
            yield from _forked(groups, settings, [trackers[id(g)] for g in groups], jobs, spilled, here,
                               1 if isolate else _CHUNK)
        finally:
            if spilled is not None:
                spilled.remove()


def _in_process_phase(
    groups: list[ModelGroup], settings: CheckSettings, trackers: dict[int, Progress], threads: int,
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


def _in_turn(groups: list[ModelGroup], settings: CheckSettings, trackers: list[Progress]) -> Iterator[ModelResult]:
    for position, (group, tracker) in enumerate(zip(groups, trackers)):
        try:
            result = _checked_here(group, settings, tracker)
        except KeyboardInterrupt:
            yield interrupted(group, tracker.stage)
            yield from map(interrupted, groups[position + 1:])
            return
        yield result


def _checked_here(group: ModelGroup, settings: CheckSettings, tracker: Progress) -> ModelResult:
    """``group`` checked in this process within the time limit (Ctrl-C goes through)."""
    tracker.begin = time.perf_counter()
    try:
        with time_limit(settings.timeout):
            result = check_model(group, settings, tracker)
    except ModelTimeout:
        result = timed_out(group, settings, tracker.stage)
    return tracker.done(result)


@dataclass
class _Here:
    """The checks to run in this process while forked ones run, on the cores no child takes."""

    checks: list[tuple[ModelGroup, Progress]]
    cores: _Cores

    def next_check(self, children: int) -> tuple[ModelGroup, Progress]:
        """The next check, torch's threads set to the cores ``children`` leave."""
        torch.set_num_threads(self.cores.threads(children))
        return self.checks.pop(0)


# the forked checks at least for a warm-up in the parent (under a second, before any child starts)
# to save the children clearly more than it costs (about 0.5 s each, two children at once)
_WARMED = 8

# the checks in process left at least, for half of them to go to a forked helper when no check
# waits to be forked: a fork costs about what two such checks do (timm's rerun)
_HELPED = 8

# the forked checks one child takes in turn at most: after its first, a model of the family
# traces warm (Swin: 6 s the first trace in a process, 2.5-3.5 s the next, of any Swin class)
_CHUNK = 4


def _forked(
    groups: list[ModelGroup], settings: CheckSettings, trackers: list[Progress], jobs: int,
    spilled: SpilledWeights | None, here: _Here, chunk: int,
) -> Iterator[ModelResult]:
    """Check the groups in forked children, ``jobs`` at once, each child up to ``chunk`` of them in
    turn (see :func:`_chunk`): a native crash fails its model, not the session, and the child's
    checks not begun are forked again.  A child is killed when its time is up or the session is
    interrupted.  The weights ``spilled`` to disk are restored in each child, each group's for
    its check.  The checks ``here`` run in this process meanwhile, one job's place taken from the
    children until they are done (a rerun's checks the export cache serves beside the forked
    checks of its largest models); once no check waits to be forked, a forked helper takes half
    of those left."""
    waiting = list(zip(groups, trackers))
    local = here.checks
    running: list[Child] = []
    helpers: list[Child] = []
    current: tuple[ModelGroup, Progress] | None = None
    try:
        while waiting or running or local:
            while waiting and len(running) < max(1, jobs - bool(local)):
                taken = _chunk(waiting, jobs, chunk)
                started = _start(taken, settings, spilled)
                del waiting[:len(taken)]  # only now: a Ctrl-C while starting leaves them waiting
                if isinstance(started, Child):
                    running.append(started)
                    continue
                for group, tracker in taken:
                    yield tracker.done(unfinished(group, stage=Stage.ISOLATE, kind=Kind.ENVIRONMENT,
                                                  reason=f"could not start the isolated check process: {started}"))
            if not waiting and len(local) >= _HELPED and len(running) < jobs - 1:
                if isinstance(helper := _start(local[len(local) // 2:], settings, spilled), Child):
                    del local[len(local) // 2:]
                    running.append(helper)
                    helpers.append(helper)
            if local:
                current = group, tracker = here.next_check(len(running))
                result = _checked_here(group, settings, tracker)
                current = None
                yield result
            finished = ended(running, block=not local) if running else []
            for child in running:
                yield from child.taken()
            for child, late in finished:
                running.remove(child)
                yield from child.kill_timed_out(settings) if late else child.end()
                if child in helpers:
                    local.extend(child.checks)  # a helper's checks not begun: checked here
                else:
                    waiting[:0] = child.checks  # those of a child that died or ran out of time: forked again
    except KeyboardInterrupt:
        for child in running:
            child.kill()
            yield from child.taken()
            yield from (interrupted(g, t.stage if i == 0 else "") for i, (g, t) in enumerate(child.checks))
        if current is not None:
            yield interrupted(current[0], current[1].stage)
        yield from (interrupted(g) for g, _ in [*waiting, *local])


def _chunk(
    waiting: list[tuple[ModelGroup, Progress]], jobs: int, most: int,
) -> list[tuple[ModelGroup, Progress]]:
    """The checks the next child takes in turn: the first waiting and those right after it of
    models of its family (their classes defined in one module: the same code, its first trace in
    a process about twice the next ones, as torch and the model's code warm up: Swin's), in the
    order the checks wait (the most expensive first: none is taken ahead of its turn), at most
    ``most`` and at most the child's share of what waits, so that the last checks spread over
    the children."""
    family = type(waiting[0][0].module).__module__
    size = min(most, math.ceil(len(waiting) / jobs))
    return list(itertools.takewhile(lambda check: type(check[0].module).__module__ == family, waiting[:size]))


def _start(
    checks: list[tuple[ModelGroup, Progress]], settings: CheckSettings, spilled: SpilledWeights | None,
) -> Child | str:
    """Fork the child that checks ``checks`` in turn; why it cannot be started, when it cannot."""
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=([g for g, _ in checks], settings, sender, spilled), daemon=True)
    try:
        process.start()
    except OSError as e:
        receiver.close()
        return str(e)
    finally:
        sender.close()
    return Child(list(checks), process, receiver, settings.timeout)


def _child(
    groups: list[ModelGroup], settings: CheckSettings, sender: Connection, spilled: SpilledWeights | None,
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to answer: it kills this process
    # one thread: GNU OpenMP (torch's) is not fork-safe, a parallel region of more threads waits
    # forever for the parent's thread team (the tests' models made it), which fork did not copy
    torch.set_num_threads(1)
    for group in groups:
        if spilled is not None:
            spilled.restore(group)
        result = check_model(group, settings, lambda stage, graph: sender.send(("step", (stage.value, graph))))
        sender.send(("result", result.to_json()))
        if group is not groups[-1]:  # the next check's memory without this one's weights and garbage
            if spilled is not None:
                spilled.release(group)
            gc.collect()
            return_free_memory()
    sender.close()
    os._exit(0)  # skip pytest's atexit handlers inherited by the fork
