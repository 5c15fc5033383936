"""Check the groups one after the other, in process or each in a forked child (``--export-isolate``),
each within the session's time limit (``--export-timeout``).

Ctrl-C (``KeyboardInterrupt``) stops the checks at once (a forked child is killed): the model
being checked and those after it are ``interrupted``.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from types import FrameType
from typing import Any

from ..observe.store import ModelGroup
from .check import check_model
from .result import ENVIRONMENT, FAILED, INTERRUPTED, ModelResult
from .settings import CheckSettings

TIMEOUT = "timeout"  # the kind of a failed result whose check ran out of time
_STAGE_OF_STEP = {"export": "torch.export"}  # check_model's progress steps that are no stage name


class ModelTimeout(BaseException):
    """Raised in the checking thread when the model's time is up: a BaseException, so that no
    ``except Exception`` in torch or in the engine turns it into an ordinary failure."""


@dataclass
class _Progress:
    """Follows the stage a check has reached, and writes one line per step when asked to."""

    prefix: str
    write: Callable[[str], None] | None
    stage: str = "infer"
    begin: float = field(default_factory=time.perf_counter)

    def __call__(self, step: str) -> None:
        name = step.partition(" [")[0]  # "verify [with labels]": a graph's step
        self.stage = _STAGE_OF_STEP.get(name, name)
        self.line(f"{step} ({time.perf_counter() - self.begin:.1f}s)")

    def line(self, text: str) -> None:
        if self.write:
            self.write(f"{self.prefix}: {text}")


def check_all(
    groups: Iterable[ModelGroup], settings: CheckSettings, isolate: bool,
    progress: Callable[[str], None] | None = None,
) -> Iterator[ModelResult]:
    """Yield one result per group; ``progress`` receives one line per model and stage."""
    groups = list(groups)
    for position, group in enumerate(groups, 1):
        tracker = _Progress(f"exportobs [{position}/{len(groups)}] {group.name}", progress)
        try:
            result = _check(group, settings, isolate, tracker)
            tracker.line(f"{result.verdict} in {time.perf_counter() - tracker.begin:.1f}s")
        except KeyboardInterrupt:
            yield interrupted(group, tracker.stage)
            yield from map(interrupted, groups[position:])
            return
        yield result


def interrupted(group: ModelGroup, stage: str = "") -> ModelResult:
    """The result of a model whose check Ctrl-C stopped at ``stage``, or never let begin."""
    when = f"during {stage}" if stage else "before its check began"
    return _result(group, verdict=INTERRUPTED, stage=stage, kind=INTERRUPTED, reason=f"interrupted (Ctrl-C) {when}")


def _result(group: ModelGroup, verdict: str = FAILED, **fields: Any) -> ModelResult:
    """A result the check itself could not give (time up, child dead or not started, Ctrl-C)."""
    return ModelResult(name=group.name, verdict=verdict, sources=list(group.sources),
                       model_class=group.model_class, n_observations=group.recorder.num_obs(), **fields)


def _check(group: ModelGroup, settings: CheckSettings, isolate: bool, progress: _Progress) -> ModelResult:
    try:
        return _isolated(group, settings, progress) if isolate else _in_process(group, settings, progress)
    except ModelTimeout:
        return _result(group, stage=progress.stage, kind=TIMEOUT,
                       reason=f"timed out after {settings.timeout:g} s during {progress.stage}")


def _in_process(group: ModelGroup, settings: CheckSettings, progress: _Progress) -> ModelResult:
    with time_limit(settings.timeout):
        return check_model(group, settings, progress)


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

    def watch() -> None:
        wait = seconds
        while not done.wait(wait):
            with lock:
                if done.is_set():
                    return
                if not _importing(sys._current_frames().get(target)):
                    set_async_exc(ctypes.c_ulong(target), ctypes.py_object(ModelTimeout))
                    return
            wait = _RETRY

    threading.Thread(target=watch, name="exportobs-timeout", daemon=True).start()
    try:
        yield
    finally:
        with lock:
            done.set()
        set_async_exc(ctypes.c_ulong(target), None)  # one not seen yet must not hit the caller


def _isolated(group: ModelGroup, settings: CheckSettings, progress: _Progress) -> ModelResult:
    """Run the check in a forked child: a native crash fails this model, not the session.  The
    child is killed when the time is up or the session is interrupted."""
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(group, settings, sender), daemon=True)
    try:
        child.start()
    except OSError as e:
        receiver.close()
        return _result(group, stage="isolate", kind=ENVIRONMENT,
                       reason=f"could not start the isolated check process: {e}")
    finally:
        sender.close()
    try:
        data = _receive(receiver, progress, settings.timeout)
    except BaseException:
        child.kill()
        raise
    finally:
        child.join()
        receiver.close()
    if data is not None and child.exitcode == 0:
        return ModelResult.from_json(data)
    return _result(group, stage="isolate", kind="error",
                   reason=f"the isolated check process died ({_exit_reason(child.exitcode)})")


def _receive(receiver: Connection, progress: _Progress, timeout: float | None) -> dict[str, Any] | None:
    """The child's result (``None`` when it died first), its steps passed on to ``progress``."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        if not receiver.poll(None if deadline is None else max(0.0, deadline - time.monotonic())):
            raise ModelTimeout
        try:
            kind, value = receiver.recv()
        except EOFError:
            return None
        if kind == "result":
            return value
        progress(value)


def _child(group: ModelGroup, settings: CheckSettings, sender: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to answer: it kills this process
    result = check_model(group, settings, lambda step: sender.send(("step", step)))
    sender.send(("result", result.to_json()))
    sender.close()
    os._exit(0)  # skip pytest's atexit handlers inherited by the fork


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"exit code {code}"
