"""Capture what torch and onnxruntime print while a model is checked.

Output reaches the terminal three ways: native code writes to file descriptors 1 and 2, Python
code prints to ``sys.stdout``/``sys.stderr`` (which pytest replaces with its own capture objects),
and logging handlers keep the stream they were created with.  All three go to one temporary file.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import tempfile
from collections.abc import Iterator

MAX_CHARS = 20_000


@contextlib.contextmanager
def captured_output() -> Iterator[list[str]]:
    """Redirect all output into a temporary file; on exit the yielded list holds its text (the
    last ``MAX_CHARS`` characters)."""
    text: list[str] = []
    with tempfile.TemporaryFile(mode="w+b") as sink, contextlib.ExitStack() as stack:
        writer = io.TextIOWrapper(os.fdopen(os.dup(sink.fileno()), "wb"), write_through=True)
        stack.callback(writer.close)
        stack.enter_context(_logging_streams(writer))
        stack.enter_context(_descriptors(sink.fileno()))
        stack.enter_context(contextlib.redirect_stdout(writer))
        stack.enter_context(contextlib.redirect_stderr(writer))
        try:
            yield text
        finally:
            stack.close()
            sink.seek(0)
            text.append(sink.read().decode(errors="replace")[-MAX_CHARS:])


@contextlib.contextmanager
def _descriptors(target: int) -> Iterator[None]:
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = [os.dup(1), os.dup(2)]
    os.dup2(target, 1)
    os.dup2(target, 2)
    try:
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)


@contextlib.contextmanager
def _logging_streams(writer: io.TextIOWrapper) -> Iterator[None]:
    """Point the logging handlers that write to a stream (not a file) at ``writer`` for a while:
    their stream may be a console or a capture object pytest installed when they were made."""
    handlers = [
        h for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
        for h in getattr(logger, "handlers", [])
        if type(h) is logging.StreamHandler
    ]
    previous = [_set_stream(h, writer) for h in handlers]
    try:
        yield
    finally:
        for handler, stream in zip(handlers, previous):
            _set_stream(handler, stream)


def _set_stream(handler: logging.StreamHandler, stream: io.TextIOBase) -> io.TextIOBase:
    """``handler.setStream(stream)``, also for a handler whose stream is closed (made while
    another capture was active: ``setStream`` would flush it and raise); returns the old one."""
    if getattr(handler.stream, "closed", False):
        old, handler.stream = handler.stream, stream
        return old
    return handler.setStream(stream) or handler.stream
