"""Where in the user's code something happened: the innermost frame outside torch, installed
packages, logging and this package, as ``file:line: code``."""

from __future__ import annotations

import inspect
import linecache
import logging
import os
import traceback
from pathlib import Path

import torch

from ..compat.torch_text import quoted_frames, raising_call

_NOT_USER_DIRS = (
    *(str(Path(inspect.getfile(m)).parent) for m in (torch, logging)), str(Path(__file__).parents[1]), "<"
)


def is_user_file(filename: str) -> bool:
    """Whether ``filename`` is the user's code (not torch, an installed package, logging or ours)."""
    return not filename.startswith(_NOT_USER_DIRS) and "site-packages" not in filename and "/torch/" not in filename


def user_location() -> str:
    """The innermost user frame of the current stack (frames walked by hand: formatting the
    whole stack per guard torch records would be slow); ``""`` if none."""
    frame = inspect.currentframe()
    while frame is not None:
        filename = frame.f_code.co_filename
        if is_user_file(filename):
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
