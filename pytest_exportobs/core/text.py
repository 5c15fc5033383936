"""One-line messages and identifiers."""

from __future__ import annotations

from typing import Any


def first_line(text: str, limit: int = 300) -> str:
    """The first non-blank line of a message, cut to ``limit`` characters."""
    return next((line.strip() for line in text.splitlines() if line.strip()), "")[:limit]


def error_line(error: BaseException) -> str:
    """``Type: first line of the message``: how a failure reads in a one-line reason."""
    return f"{type(error).__name__}: {first_line(str(error))}"


def identifier(name: str) -> str:
    """``name`` as a Python identifier: other characters become ``_``, a leading digit gets ``d_``."""
    cleaned = "".join(c if c.isalnum() else "_" for c in name).strip("_")
    return cleaned if cleaned and not cleaned[0].isdigit() else f"d_{cleaned}"


def format_dims(dims: dict[str, dict[Any, str]]) -> str:
    """``input_ids{0:batch,1:seq}`` for every input with a dynamic dimension, else ``static``."""
    parts = [f"{name}{{{','.join(f'{d}:{v}' for d, v in axes.items())}}}" for name, axes in dims.items() if axes]
    return " ".join(parts) or "static"
