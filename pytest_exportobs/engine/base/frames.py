"""Where in the model's code something happened, as ``file:line: code``: the user's code (outside
torch, installed packages, logging and this package), or an installed package's where the model
is one (a transformers model's own line)."""

from __future__ import annotations

import inspect
import linecache
import logging
import os
import traceback
from pathlib import Path

import torch

from ...compat.torch_text import quoted_frames, raising_call

_PACKAGE_DIR = str(Path(__file__).parents[1])
_NOT_USER_DIRS = (*(str(Path(inspect.getfile(m)).parent) for m in (torch, logging)), _PACKAGE_DIR, "<")


def is_user_file(filename: str) -> bool:
    """Whether ``filename`` is the user's code (not torch, an installed package, logging or ours)."""
    return not filename.startswith(_NOT_USER_DIRS) and "site-packages" not in filename and "/torch/" not in filename


def user_location() -> str:
    """The innermost frame of the model's code on the current stack: the user's or an installed
    package's (a transformers model's own line), never torch's, logging's or ours; ``""`` when
    the walk reaches this package first (torch guarded on its own, outside the model).  Frames
    are walked by hand: formatting the whole stack per guard torch records would be slow."""
    frame = inspect.currentframe()
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back  # the caller's own frames (a logging handler of this package)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(_PACKAGE_DIR):
            return ""
        if _is_model_file(filename):
            return _location(filename, frame.f_lineno, linecache.getline(filename, frame.f_lineno))
        frame = frame.f_back
    return ""


def user_frame(error: BaseException) -> str:
    """The model's or the user's line behind ``error``: the call torch.export says raised (the
    model's code, in an installed package too), else the innermost user frame of ``error``'s
    traceback and its cause's, else the last user ``File "...", line N`` its message quotes, else
    the innermost frame of an installed package other than torch (a transformers model's own
    line); ``""`` if none."""
    raising = raising_call(str(error))
    if raising is not None and not raising[0].startswith(_NOT_USER_DIRS):
        return _location(*raising)
    frames: list[traceback.FrameSummary] = list(traceback.extract_tb(error.__traceback__))
    for cause in (error.__cause__, error.__context__):
        if cause is not None:
            frames = frames + traceback.extract_tb(cause.__traceback__)
    user = [f for f in frames if is_user_file(f.filename)]
    if user:
        return _frame_location(user[-1])
    quoted = [(path, line) for path, line in quoted_frames(str(error)) if is_user_file(path)]
    if quoted:
        return _location(*quoted[-1], "")
    installed = [f for f in frames if _is_model_file(f.filename)]  # a transformers model's own line
    return _frame_location(installed[-1]) if installed else ""


def quoted_model_line(text: str) -> str:
    """The innermost frame of the model's code a traceback text quotes (``File "...", line N``,
    innermost last: an FX node's stack trace), the line's code read from the file; ``""`` if none."""
    quoted = [(path, line) for path, line in quoted_frames(text) if _is_model_file(path)]
    if not quoted:
        return ""
    path, line = quoted[-1]
    return _location(path, line, linecache.getline(path, line))


def _is_model_file(filename: str) -> bool:
    """Whether ``filename`` may hold a model's code: neither torch, logging nor this package."""
    return not filename.startswith(_NOT_USER_DIRS) and "/torch/" not in filename


def _frame_location(frame: traceback.FrameSummary) -> str:
    return _location(frame.filename, frame.lineno or 0, frame.line or "")


def _location(filename: str, lineno: int, line: str) -> str:
    """``file:line: code``, the file relative to the working directory, or to the site-packages
    directory of an installed package (``transformers/models/...``)."""
    installed = filename.partition(f"site-packages{os.sep}")[2]
    try:
        shown = installed or os.path.relpath(filename)
    except ValueError:  # another drive (Windows)
        shown = filename
    return f"{shown}:{lineno}" + (f": {line.strip()}" if line.strip() else "")
