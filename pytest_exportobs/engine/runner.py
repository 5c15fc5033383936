"""Check the groups within the session's time limit (``--export-timeout``): each in a forked child
(``--export-isolate``), ``--export-jobs`` children at once (without ``--export-isolate``, each
takes the next waiting models of its family in turn), or one after the other in process
(:mod:`.placement` decides which).

Ctrl-C (``KeyboardInterrupt``) stops the checks at once (forked children are killed): the models
being checked and those not begun are ``interrupted``.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
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
from .check import check_model
from .children import Child, Progress, SharedQueue, ended, family, interrupted, timed_out, unfinished
from .explore.variations import prepare_variations
from .export.pipeline import prepare
from .export.warmup import warm_up
from .limits import ModelTimeout, time_limit
from .placement import CheckCosts, place
from .settled import settled
from .spilled import SpilledWeights, return_free_memory


def check_all(
    groups: Iterable[ModelGroup], settings: CheckSettings, isolate: bool,
    progress: Callable[[str], None] | None = None, jobs: int = 1, threads: int | None = None,
    unrecorded_only: bool = False,
) -> Iterator[ModelResult]:
    """Yield one result per group, in the order the checks end; ``progress`` receives one line
    per model and stage.  With ``isolate`` or ``jobs`` > 1 checks run in forked children,
    ``jobs`` of them at once, the most expensive first, and meanwhile the checks the export
    cache is expected to serve in process (see :mod:`.placement`).  A check in process runs with
    ``threads`` torch threads per job no child takes (``None``: as many as now for all the
    jobs), a forked one with one (see
    :func:`_child`); forked checks run with the models' weights on disk (:mod:`.spilled`), each
    child mapping its own.  What each check is expected to take next time is recorded.
    ``unrecorded_only``: the checks the export cache recorded (as they are now: same module,
    calls and settings) are left out, without a result (what :mod:`.early` fills the cache
    with is there already)."""
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
    if unrecorded_only:
        groups = [group for group in groups if costs.recorded(group) is None]
        if not groups:
            return
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
    in this process while they run (shared with a forked helper, when enough are left);
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
    here = _Here(SharedQueue.of([(g, trackers[id(g)]) for g in in_process]), cores)
    by_name = {g.name: g for g in groups}
    with _heap_frozen(), _threads_kept():
        try:
            for result in _forked(SharedQueue.of([(g, trackers[id(g)]) for g in groups]), settings, jobs, spilled,
                                  here, isolate):
                if spilled is not None and result.name in by_name:  # while the children go on, not after
                    spilled.give_back(by_name[result.name])
                yield result
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
            result = _checked_here(group, tracker, settings)
        except KeyboardInterrupt:
            yield interrupted(group, tracker.stage)
            yield from map(interrupted, groups[position + 1:])
            return
        yield result


def _checked_here(group: ModelGroup, tracker: Progress, settings: CheckSettings) -> ModelResult:
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
    """The checks to run in this process while forked ones run, on the cores no child takes (a
    forked helper may take some of them too)."""

    queue: SharedQueue
    cores: _Cores

    def take(self, children: int) -> tuple[ModelGroup, Progress] | None:
        """The next check, torch's threads set to the cores ``children`` leave; ``None`` when a
        helper took the last."""
        torch.set_num_threads(self.cores.threads(children))
        position = self.queue.take(0)
        return None if position is None else self.queue.checks[position]


# the forked checks at least for a warm-up in the parent (under a second, before any child starts)
# to save the children clearly more than it costs (about 0.5 s each, two children at once)
_WARMED = 8

# the checks in process left at least, for a forked helper to share them with this process when
# no check waits to be forked: a fork costs about what two such checks do (timm's rerun)
_HELPED = 8


def _forked(
    forked: SharedQueue, settings: CheckSettings, jobs: int, spilled: SpilledWeights | None, here: _Here,
    isolate: bool,
) -> Iterator[ModelResult]:
    """Check the groups ``forked`` in forked children, ``jobs`` at once: a child takes the next
    waiting check and, after each, the next again while it is a model of its family (one
    process's first trace of a family costs about twice the next: Swin's 6 s, then 2.5-3.5 s of
    any Swin class), or only its first when ``isolate``.  A native crash fails its model, not the
    session.  A child is killed when its check's time is up or the session is interrupted.  The
    weights ``spilled`` to disk are restored in each child, each group's for its check.  The
    checks ``here`` run in this process meanwhile, one job's place taken from the children until
    they are done (a rerun's checks the export cache serves beside the forked checks of its
    largest models); once no check waits to be forked, a forked helper takes its share of those
    left."""
    local = here.queue
    numbers = itertools.count(1)
    running: list[Child] = []
    current: tuple[ModelGroup, Progress] | None = None  # the check in this process
    try:
        while forked.waiting or running or local.waiting:
            while forked.waiting and len(running) < max(1, jobs - bool(local.waiting)):
                yield from _started(forked, next(numbers), (lambda _: None) if isolate else family, settings,
                                    spilled, running)
            if not forked.waiting and len(local.waiting) >= _HELPED and len(running) < jobs - 1:
                yield from _started(local, next(numbers), lambda _: _ANY, settings, spilled, running)
            if local.waiting and (current := here.take(len(running))) is not None:
                result = _checked_here(*current, settings)
                current = None
                yield result
            # wait only when no check is left to run here and no child to start: the job's place
            # the last check here took goes back to the children at once (not once a child ends,
            # which may check its family's models for a long while)
            idle = not local.waiting and not (forked.waiting and len(running) < jobs)
            finished = ended(running, block=idle) if running else []
            for child in running:
                yield from child.taken()
            for child, late in finished:
                running.remove(child)
                yield from child.kill_timed_out(settings) if late else child.end()
    except KeyboardInterrupt:
        for child in running:
            yield from child.taken()
            yield from child.kill_interrupted()
        if current is not None:
            yield interrupted(current[0], current[1].stage)
        yield from (interrupted(g) for g, _ in [*forked.waiting, *local.waiting])


def _started(
    queue: SharedQueue, number: int, follows: Callable[[ModelGroup], str | None], settings: CheckSettings,
    spilled: SpilledWeights | None, running: list[Child],
) -> Iterator[ModelResult]:
    """Child ``number`` forked for the next check of ``queue`` and added to ``running``, to take
    after it the next checks of the family ``follows`` gives that check's group (see
    :func:`_start`); the failure of that check when no process can be forked (nothing when none
    waits), its interruption when Ctrl-C comes while the child starts."""
    if (position := queue.take(number)) is None:  # a child took the last
        return
    group, tracker = queue.checks[position]
    try:
        started = _start(queue, position, number, follows(group), settings, spilled)
    except KeyboardInterrupt:
        yield interrupted(group)
        raise
    if isinstance(started, Child):
        running.append(started)
    else:
        yield tracker.done(unfinished(group, stage=Stage.ISOLATE, kind=Kind.ENVIRONMENT,
                                      reason=f"could not start the isolated check process: {started}"))


_ANY = "*"  # a child that takes after its first check the next of any family


def _start(
    queue: SharedQueue, first: int, number: int, follows: str | None, settings: CheckSettings,
    spilled: SpilledWeights | None,
) -> Child | str:
    """Fork child ``number`` to check ``queue``'s check at position ``first`` (taken for it), then
    each next waiting check of the family ``follows`` (:data:`_ANY`: of any; ``None``: none); why
    it cannot be started, when it cannot."""
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=(queue, first, number, follows, settings, sender, spilled),
                              daemon=True)
    try:
        process.start()
    except OSError as e:
        receiver.close()
        return str(e)
    finally:
        sender.close()
    return Child(queue, number, process, receiver, settings.timeout)


def _child(
    queue: SharedQueue, first: int, number: int, follows: str | None, settings: CheckSettings,
    sender: Connection, spilled: SpilledWeights | None,
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to answer: it kills this process
    # one thread: GNU OpenMP (torch's) is not fork-safe, a parallel region of more threads waits
    # forever for the parent's thread team (the tests' models made it), which fork did not copy
    torch.set_num_threads(1)
    position: int | None = first
    while position is not None:
        group = queue.checks[position][0]
        sender.send(("begin", position))
        if spilled is not None:
            spilled.restore(group)
        result = check_model(group, settings, lambda stage, graph: sender.send(("step", (stage.value, graph))))
        sender.send(("result", result.to_json()))
        position = None if follows is None else queue.take(number, None if follows == _ANY else follows)
        if position is not None:  # the next check's memory without this one's weights and garbage
            if spilled is not None:
                spilled.release(group)
            gc.collect()
            return_free_memory()
    sender.close()
    os._exit(0)  # skip pytest's atexit handlers inherited by the fork
