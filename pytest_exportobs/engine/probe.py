"""Before exporting a dim the tests never varied, check that eager accepts another size.

A role makes the batch, sequence and cache lengths dynamic even when every test used one size.
Some models cannot take another size (a reshape to the batch they were written for): eager
rejects it, and such a dim is kept static, with a note, rather than blamed on the export.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..core.text import error_line
from ..core.trees import detached_clone
from ..shapes.model import ShapeModel
from ..shapes.synthesis import build_leaves, complete_sizes, export_sizes, free_variables

Eager = Callable[[list[Any]], Any]


def probe_unvaried_dims(shapes: ShapeModel, eager: Eager, notes: list[str]) -> None:
    """Drop the dynamic variables no call varied that eager rejects one size larger (all at
    once first: one eager run when the model accepts them all)."""
    free = free_variables(shapes)
    candidates = [v.name for v in shapes.variables if v.source in ("role", "guess") and v.name in free]
    if not candidates:
        return
    base = _free_sizes(shapes)
    if _rejection(shapes, eager, {name: base[name] + 1 for name in candidates}) is None:
        return
    for name in candidates:
        error = _rejection(shapes, eager, {name: base[name] + 1})
        if error is not None:
            shapes.drop(name)
            notes.append(f"{name} kept static: eager rejects {name}={base[name] + 1} ({error})")


def acceptor(shapes: ShapeModel, eager: Eager) -> Callable[[str, int], bool]:
    """``accepts(name, size)``: whether eager runs with variable ``name`` at ``size``."""
    return lambda name, size: _rejection(shapes, eager, {name: size}) is None


def _free_sizes(shapes: ShapeModel) -> dict[str, int]:
    free = free_variables(shapes)
    return {name: size for name, size in export_sizes(shapes).items() if name in free}


def leaves_at(shapes: ShapeModel, changed: dict[str, int]) -> list[Any]:
    """Inputs synthesized at the export sizes but ``changed`` (derived sizes following)."""
    sizes = complete_sizes(shapes, {**_free_sizes(shapes), **changed})
    return build_leaves(shapes, sizes, torch.Generator().manual_seed(0))


def _rejection(shapes: ShapeModel, eager: Eager, changed: dict[str, int]) -> str | None:
    """Why eager fails on inputs at the export sizes but ``changed`` (``None``: it runs)."""
    try:
        eager(detached_clone(leaves_at(shapes, changed)))
    except Exception as e:  # the model's own check of its input sizes
        return error_line(e)
    return None
