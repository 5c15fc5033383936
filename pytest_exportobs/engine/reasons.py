"""One-line reasons a user can act on, from the exceptions of the export stages."""

from __future__ import annotations

import os
import re
import traceback
from pathlib import Path

from ..core.text import first_line

PACKAGE_DIR = str(Path(__file__).parents[1])


def one_line_reason(stage: str, error: BaseException) -> str:
    """A single line a user can act on: the message's first line, the unsupported ops of an ONNX
    translation failure, and the user source line where torch.export failed."""
    message = first_line(str(error)) or type(error).__name__
    if stage in ("decompose", "onnx-translate"):
        ops = unsupported_ops(str(error))
        if ops:
            return f"no ONNX translation for {', '.join(ops)}"
    location = user_frame(error)
    return f"{type(error).__name__}: {message}" + (f" (at {location})" if location else "")


def unsupported_ops(message: str) -> list[str]:
    """Operator names mentioned by a translation error next to 'No ONNX function' / 'unsupported'."""
    ops: list[str] = []
    for line in message.splitlines():
        if re.search(r"no onnx function|unsupported|not supported|dispatch", line, re.IGNORECASE):
            ops.extend(m for m in re.findall(r"\b[a-z_]+(?:::|\.)[a-zA-Z_]\w*(?:\.\w+)?", line) if "aten" in m or "::" in m)
    return sorted(set(ops))


def user_frame(error: BaseException) -> str:
    """``file:line: code`` of the innermost frame of user code (outside torch, site-packages, us)."""
    frames = traceback.extract_tb(error.__traceback__)
    for cause in (error.__cause__, error.__context__):
        if cause is not None:
            frames = frames + traceback.extract_tb(cause.__traceback__)
    user = [
        f for f in frames
        if "site-packages" not in f.filename and not f.filename.startswith(PACKAGE_DIR)
        and "/torch/" not in f.filename and not f.filename.startswith("<")
    ]
    if not user:
        found = re.findall(r'File "([^"]+)", line (\d+)', str(error))
        user_paths = [(p, n) for p, n in found if "site-packages" not in p and "/torch/" not in p]
        return f"{_short(user_paths[-1][0])}:{user_paths[-1][1]}" if user_paths else ""
    frame = user[-1]
    return f"{_short(frame.filename)}:{frame.lineno}" + (f": {frame.line.strip()}" if frame.line else "")


def _short(path: str) -> str:
    try:
        return os.path.relpath(path)
    except ValueError:
        return path
