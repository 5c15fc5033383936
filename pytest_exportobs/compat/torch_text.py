"""Parsers of the text torch writes: its error messages and the records of its symbolic-shapes
logger.  Each is tested on messages captured from every supported torch
(``tests/unit/torch_messages/``) and on messages the installed torch writes."""

from __future__ import annotations

import logging
import math
import re
from typing import NamedTuple, SupportsInt, TypeGuard

SHAPES_LOGGER = "torch.fx.experimental.symbolic_shapes"  # logs symbols, guards and replacements at INFO


def symbol_created(record: logging.LogRecord) -> tuple[str, str] | None:
    """``(symbol, size)`` of a ``create_symbol`` record: ``("s0", "L['x'].size()[0]")``."""
    args = _arguments(record)
    if str(record.msg).startswith("create_symbol") and len(args) >= 3:
        return str(args[0]), str(args[2])
    return None


def guard_added(record: logging.LogRecord) -> str | None:
    """The expression of a ``[guard added]`` record: ``"Eq(s0, 3)"``."""
    args = _arguments(record)
    return str(args[1]) if "[guard added]" in str(record.msg) and len(args) >= 2 else None


def symbol_replaced(record: logging.LogRecord) -> tuple[str, int] | None:
    """``(symbol, value)`` of a ``set_replacement`` record replacing a symbol by an integer."""
    args = _arguments(record)
    if str(record.msg).startswith("set_replacement") and len(args) >= 2 and _is_integer(args[1]):
        return str(args[0]), int(args[1])
    return None


def _arguments(record: logging.LogRecord) -> tuple[object, ...]:
    return record.args if isinstance(record.args, tuple) else ()  # torch logs its values positionally


def _is_integer(value: object) -> TypeGuard[SupportsInt]:
    return bool(getattr(value, "is_Integer", False)) or isinstance(value, int)


def rejects_dims(message: str) -> bool:
    """Whether torch.export's user error rejects the dynamic shapes it was given: "Constraints
    violated", or, when solving its guards pins a dim (a stride-2 stem before position embeddings
    of a fixed grid, with deferred runtime asserts), "Specializations unexpectedly required"."""
    return "Constraints violated" in message or "Specializations unexpectedly required" in message


def suggested_fixes(message: str) -> list[tuple[str, str]]:
    """The ``(name, expression)`` pairs torch suggests after 'Suggested fixes:'."""
    text = message.partition("Suggested fixes:")[2]
    pairs = [line.strip().partition("=") for line in text.splitlines() if "=" in line]
    return [(name.strip(), value.strip()) for name, _, value in pairs if name.strip().isidentifier()]


class Violation(NamedTuple):
    """A dim torch rejects: the size it names (``L['images'].size()[2]``), the guards it breaks."""

    source: str
    guards: list[str]


def violations(message: str) -> dict[str, Violation]:
    """The dims a "Constraints violated" rejection lists, each with the guards it breaks ("Not all
    values of height = L['x'].size()[2] in the specified range satisfy the generated guard ...")."""
    found: dict[str, Violation] = {}
    for name, source, guard in re.findall(
            r"Not all values of (\w+) = (.+?) in the specified range satisfy the generated guard (.+?)\.?$",
            message, flags=re.MULTILINE):
        found.setdefault(name, Violation(source, [])).guards.append(guard)
    return found


def affine_of_root(expression: str) -> tuple[int, str, int] | None:
    """``(factor, root, offset)`` of a derived dim torch suggests on a new root:
    ``"12*_height - 4"`` -> ``(12, "_height", -4)``; ``None`` for anything else."""
    found = re.fullmatch(r"(?:(\d+)\*)?(_\w+)(?: ([+-]) (\d+))?", expression)
    if found is None:
        return None
    offset = int(found[4] or 0)
    return int(found[1] or 1), found[2], -offset if found[3] == "-" else offset


def dim_range(fix: str) -> tuple[int, float] | None:
    """``(min, max)`` of a suggested ``Dim('batch', min=2, max=63)`` (no min: 0; ``max=oo`` or no
    max: infinite); ``None`` for any other fix."""
    if not fix.startswith("Dim("):
        return None
    low, high = re.search(r"min=(\d+)", fix), re.search(r"max=(\d+)", fix)
    return int(low[1]) if low else 0, int(high[1]) if high else math.inf


def pinned_sizes(fixes: list[tuple[str, str]]) -> dict[str, int]:
    """The suggested fixes that make a dim a constant: ``{"batch": 3}``."""
    return {name: int(value) for name, value in fixes if re.fullmatch(r"-?\d+", value)}


def raising_call(message: str) -> tuple[str, int, str] | None:
    """``(file, line, code)`` of the call torch.export's error quotes as the one that raised
    ("The following call raised this error:" and a traceback line), the model's own line for a
    data-dependent guard; ``None`` when the message quotes none."""
    found = re.search(r'The following call raised this error:\n\s*File "([^"]+)", line (\d+)[^\n]*\n([^\n]*)', message)
    return (found[1], int(found[2]), found[3].strip()) if found else None


def quoted_frames(message: str) -> list[tuple[str, int]]:
    """The ``(file, line)`` of every traceback line (``File "...", line N``) a message quotes."""
    return [(path, int(line)) for path, line in re.findall(r'File "([^"]+)", line (\d+)', message)]


def translated_op(message: str) -> str | None:
    """The op whose ONNX translation failed (``aten.nll_loss_nd.default``), from torch.onnx's
    'Error when translating node ... target=torch.ops.<op>'."""
    found = re.search(r"Error when translating node .*?target=torch\.ops\.([\w.]+)", message)
    return found[1] if found else None


def unsupported_ops(message: str) -> list[str]:
    """Operator names mentioned by a translation error next to 'No ONNX function' / 'unsupported'."""
    ops: list[str] = []
    for line in message.splitlines():
        if re.search(r"no onnx function|unsupported|not supported|dispatch", line, re.IGNORECASE):
            names = re.findall(r"\b[a-z_]+(?:::|\.)[a-zA-Z_]\w*(?:\.\w+)?", line)
            ops.extend(m for m in names if "aten" in m or "::" in m)
    return sorted(set(ops))
