"""A check's time limit (``--export-timeout``) in the process that runs it.

On the main thread a ``SIGALRM`` timer; elsewhere an asynchronous exception.  Neither interrupts
an import: a module left half-imported would break every later check.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType


class ModelTimeout(BaseException):
    """Raised in the checking thread when the model's time is up: a BaseException, so that no
    ``except Exception`` in torch or in the engine turns it into an ordinary failure."""


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
