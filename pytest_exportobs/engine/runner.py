"""Check the groups within the session's time limit (``--export-timeout``): one after the other
in process, or each in a forked child (``--export-isolate``), ``--export-jobs`` children at once.

Ctrl-C (``KeyboardInterrupt``) stops the checks at once (forked children are killed): the models
being checked and those not begun are ``interrupted``.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from types import FrameType
from typing import Any

import torch

from ..core.vocabulary import Kind, Stage, Verdict
from ..observe.binding import CONSTANT_TYPES
from ..observe.store import ModelGroup
from .base.result import ModelResult
from .base.settings import CheckSettings
from .check import check_model, settled
from .export.cache import ExportCache
from .export.pipeline import prepare
from .spilled import SpilledWeights, return_free_memory

_STEP_WORDS = {Stage.TORCH_EXPORT: "export"}  # the export step runs torch.export and the translation


class ModelTimeout(BaseException):
    """Raised in the checking thread when the model's time is up: a BaseException, so that no
    ``except Exception`` in torch or in the engine turns it into an ordinary failure."""


@dataclass
class _Progress:
    """Follows the stage a check has reached, and writes one line per step when asked to."""

    prefix: str
    write: Callable[[str], None] | None
    stage: Stage = Stage.INFER
    begin: float = field(default_factory=time.perf_counter)

    def __call__(self, stage: Stage, graph: str = "") -> None:
        self.stage = stage
        step = _STEP_WORDS.get(stage, stage.value) + (f" [{graph}]" if graph else "")
        self.line(f"{step} ({time.perf_counter() - self.begin:.1f}s)")

    def done(self, result: ModelResult) -> ModelResult:
        """Write the verdict and the time the check took; return ``result``."""
        self.line(f"{result.verdict} in {time.perf_counter() - self.begin:.1f}s")
        return result

    def line(self, text: str) -> None:
        if self.write:
            self.write(f"{self.prefix}: {text}")


def check_all(
    groups: Iterable[ModelGroup], settings: CheckSettings, isolate: bool,
    progress: Callable[[str], None] | None = None, jobs: int = 1, threads: int | None = None,
) -> Iterator[ModelResult]:
    """Yield one result per group, in the order the checks end; ``progress`` receives one line
    per model and stage.  With ``isolate`` or ``jobs`` > 1 each check runs in a forked child,
    ``jobs`` of them at once, the most expensive first (fewer groups: as many jobs as groups,
    each with the threads of the jobs left unused).  A check in process runs with ``threads``
    torch threads (``None``: as many as now), a forked one with one (see :func:`_child`); forked
    checks run with the models' weights on disk (:mod:`.spilled`), each child mapping its own."""
    groups = list(groups)
    total, first = len(groups), 1
    if isolate or jobs > 1:  # a group with nothing to export needs no process of its own
        unsettled = []
        for group in groups:
            if (result := settled(group)) is None:
                unsettled.append(group)
                continue
            yield _Progress(f"exportobs [{first}/{total}] {group.name}", progress).done(result)
            first += 1
        groups = unsettled
    if not groups:
        return
    if jobs > 1:  # the longest checks first: the last to end is then a short one, not a straggler
        groups.sort(key=expected_cost, reverse=True)
    used = max(1, min(jobs, len(groups)))
    threads, jobs = torch.get_num_threads() if threads is None else threads * jobs // used, used
    trackers = [_Progress(f"exportobs [{i}/{total}] {g.name}", progress) for i, g in enumerate(groups, first)]
    forked = isolate or jobs > 1
    spilled = None
    try:
        if forked:
            spilled = SpilledWeights.spill(groups, settings.export_dir)  # first: the imports grow a smaller heap
            return_free_memory()
            # once for every child (in turn, the first export imports, and a rerun the cache serves needs no registry)
            prepare(settings.target, ExportCache(settings.cache_dir) if settings.use_cache else None)
    except KeyboardInterrupt:
        if spilled is not None:
            spilled.remove()
        yield from map(interrupted, groups)
        return
    with _heap_frozen():
        if forked:
            try:
                yield from _forked(groups, settings, trackers, jobs, spilled)
            finally:
                if spilled is not None:
                    spilled.remove()
            return
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            yield from _in_turn(groups, settings, trackers)
        finally:
            torch.set_num_threads(previous)


def expected_cost(group: ModelGroup) -> int:
    """What a check is expected to cost, in no unit: the graphs it exports (one per combination
    of keyword arguments and their plain values among the calls) times the size of each (the
    model's modules, whose calls become the graph's ops)."""
    combinations = {tuple(sorted((name, _plain(value)) for name, value in o.kwargs.items()))
                    for o in group.recorder.observations}
    return max(1, len(combinations)) * sum(1 for _ in group.module.modules())


def _plain(value: Any) -> Any:
    """A constant's value; a tensor's or a structure's type (its values do not choose the graph)."""
    return value if value is None or isinstance(value, CONSTANT_TYPES) else type(value).__name__


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
        tracker.begin = time.perf_counter()
        try:
            with time_limit(settings.timeout):
                result = check_model(group, settings, tracker)
        except ModelTimeout:
            result = _timed_out(group, settings, tracker.stage)
        except KeyboardInterrupt:
            yield interrupted(group, tracker.stage)
            yield from map(interrupted, groups[position + 1:])
            return
        yield tracker.done(result)


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


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise :class:`ModelTimeout` in this thread once ``seconds`` have passed in the block.

    On the main thread a ``SIGALRM`` timer (it also cuts a sleep or a blocking system call short;
    the previous handler and timer are restored); elsewhere, or without ``setitimer``, an
    asynchronous exception, which Python code sees at its next instruction.  Neither stops
    native code that never returns to Python (``--export-isolate`` kills such a check), and
    neither interrupts an import: a module left half-imported would break every later check, so
    the exception waits until the import is done.
    """
    if seconds is None:
        yield
    elif threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        with _alarm(seconds):
            yield
    else:
        with _async_exception_after(seconds):
            yield


_RETRY = 0.05  # seconds between two looks once the time is up but an import runs


def _importing(frame: FrameType | None) -> bool:
    """Whether ``frame`` or one of its callers runs an import."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def _alarm(seconds: float) -> Iterator[None]:
    def expire(signum: int, frame: FrameType | None) -> None:
        if _importing(frame):
            signal.setitimer(signal.ITIMER_REAL, _RETRY)
            return
        raise ModelTimeout

    begin = time.monotonic()
    previous = signal.signal(signal.SIGALRM, expire)
    outer, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer:  # someone else's timer was running: it goes on, less the time spent here
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - begin), 1e-3))


@contextlib.contextmanager
def _async_exception_after(seconds: float) -> Iterator[None]:
    target, lock, done = threading.get_ident(), threading.Lock(), threading.Event()
    set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc

    def interrupt_when_due() -> None:
        wait = seconds
        while not done.wait(wait):
            with lock:
                if done.is_set():
                    return
                if not _importing(sys._current_frames().get(target)):
                    set_async_exc(ctypes.c_ulong(target), ctypes.py_object(ModelTimeout))
                    return
            wait = _RETRY

    threading.Thread(target=interrupt_when_due, name="exportobs-timeout", daemon=True).start()
    try:
        yield
    finally:
        with lock:
            done.set()
        set_async_exc(ctypes.c_ulong(target), None)  # one not seen yet must not hit the caller


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
    spilled: SpilledWeights | None,
) -> Iterator[ModelResult]:
    """Check each group in a forked child, ``jobs`` at once: a native crash fails its model, not
    the session.  A child is killed when its time is up or the session is interrupted.  The
    weights ``spilled`` to disk are restored in each child."""
    waiting = list(zip(groups, trackers))
    running: list[_Child] = []
    try:
        while waiting or running:
            while waiting and len(running) < jobs:
                started = _start(*waiting[0], settings, spilled)
                waiting.pop(0)  # only now: a Ctrl-C while starting leaves it waiting, reported interrupted
                if isinstance(started, _Child):
                    running.append(started)
                else:
                    yield started
            for child, late in _ended(running):
                running.remove(child)
                yield child.tracker.done(_kill_timed_out(child, settings) if late else child.end())
    except KeyboardInterrupt:
        for child in running:
            child.kill()
        yield from (interrupted(c.group, c.tracker.stage) for c in running)
        yield from (interrupted(g) for g, _ in waiting)


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


def _ended(running: list[_Child]) -> list[tuple[_Child, bool]]:
    """Read the children's messages until some have ended or run out of time (``True``)."""
    while True:
        deadlines = [c.deadline for c in running if c.deadline is not None]
        timeout = min([_WAKE, *(max(0.0, d - time.monotonic()) for d in deadlines)])
        readable = wait([c.receiver for c in running], timeout)
        done = [c for c in running if c.receiver in readable and not c.read()]
        now = time.monotonic()
        late = [c for c in running if c not in done and c.deadline is not None and now >= c.deadline]
        if done or late:
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
