"""Eager runs of the model at sizes no call had.

Before exporting a dim the tests never varied, check that eager accepts another size.  A role
makes the batch, sequence and cache lengths dynamic even when every test used one size.  Some
models cannot take another size (a reshape to the batch they were written for): eager rejects it,
and such a dim is kept static, with a note, rather than blamed on the export.  A batch is also
tried as a recorded call's rows repeated: synthesized values, not the size, may be what eager
rejects (ids without the image tokens its pixel values need).

When torch bounds a dim, :class:`SizeProbe` tells whether the model reaches a size past the bound:
on inputs synthesized there, or by its own next step.  A step may part the dim's axes: the layers
of a sliding window hold the bound (the window) while the full layers go past it, a state no
synthesized input has; :class:`Reach` names the axes held.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree

from ...core.trees import detached_clone
from ...core.vocabulary import DimSource
from ...shapes.dims import Axis
from ...shapes.model import ShapeModel
from ...shapes.synthesis import build_leaves, complete_sizes, export_sizes, free_variables, rows_repeated
from ..base.eager import ModelRaised
from .cache import ExportCache, ProbeEntry

Eager = Callable[[list[Any]], Any]


def probed_unvaried_dims(
    module: torch.nn.Module, method: str, shapes: ShapeModel, eager: Eager, notes: list[str],
    cache: ExportCache | None,
) -> ShapeModel:
    """:func:`probe_unvaried_dims`, or what it found on an earlier run for the same module,
    method and shape model (the export ``cache``'s probe entry): no eager run then."""
    key = cache.probe_key(module, method, shapes) if cache is not None else ""
    entry = cache.load_probe(key) if cache is not None else None
    if entry is None:
        found: list[str] = []
        probed = probe_unvaried_dims(shapes, eager, found)
        kept = {v.name for v in probed.variables}
        entry = ProbeEntry([v.name for v in shapes.variables if v.name not in kept], found)
        if cache is not None:
            with contextlib.suppress(OSError):  # an unwritable cache costs the next run its speed, noted by the export
                cache.store_probe(key, entry)
    notes.extend(entry.notes)
    return functools.reduce(ShapeModel.without, entry.static, shapes)


def probe_unvaried_dims(shapes: ShapeModel, eager: Eager, notes: list[str]) -> ShapeModel:
    """The shape model without the dynamic variables no call varied that eager rejects one size
    larger (all at once first: one eager run when the model accepts them all)."""
    free = free_variables(shapes)
    candidates = [v.name for v in shapes.variables if v.source in (DimSource.ROLE, DimSource.GUESS) and v.name in free]
    if not candidates:
        return shapes
    base = _free_sizes(shapes)
    if _rejection(shapes, eager, {name: base[name] + 1 for name in candidates}) is None:
        return shapes
    probed = shapes
    for name in candidates:
        error = _rejection(probed, eager, {name: base[name] + 1})
        if error is not None and not _runs_rows_repeated(probed, eager, name, base[name] + 1):
            probed = probed.without(name)
            notes.append(f"{name} kept static: eager rejects {name}={base[name] + 1} ({error})")
    return probed


@dataclass(frozen=True)
class Reach:
    """How eager reaches a size past a bound, said for a reason; ``held``: the axes of the
    variable the model's own next step keeps at the bound while its other axes go past it."""

    how: str
    held: tuple[Axis, ...] = ()


@dataclass
class SizeProbe:
    """Eager (``eager`` runs the model on flat leaves of ``shapes``' calls) at sizes of one variable."""

    shapes: ShapeModel
    eager: Eager

    def accepts(self, name: str, size: int) -> bool:
        """Whether eager runs on inputs synthesized with variable ``name`` at ``size``."""
        return _rejection(self.shapes, self.eager, {name: size}) is None

    def reaches(self, name: str, size: int) -> Reach | None:
        """How eager reaches variable ``name`` at ``size`` or past it; ``None`` when it does not
        (a position table, a static cache's length: the model's own limit)."""
        if self.accepts(name, size):
            return Reach(f"eager runs {name}={size}")
        return self._next_step(name, size - 1)

    def _next_step(self, name: str, before: int) -> Reach | None:
        """From inputs at ``name`` = ``before``, the model's next call on the cache it returned:
        what the step reaches, and the axes it holds at ``before`` while others go past."""
        var = next(v for v in self.shapes.variables if v.name == name)
        slots = {self.shapes.aligned.leaf_slot(leaf) for leaf, _ in var.axes}
        carried = [slot for slot in slots if slot.spec is not None and not slot.spec.is_leaf()
                   and slot.spec.type not in (list, tuple, dict)]
        if not carried:
            return None
        try:
            outputs = self.eager(detached_clone(leaves_at(self.shapes, {name: before})))
            found = {slot: _leaves_of(outputs, slot.tree_spec) for slot in carried}
            returned = {slot: leaves for slot, leaves in found.items() if leaves is not None}
            if len(returned) < len(found):
                return None
            after = max(leaves[leaf - slot.start].shape[dim] for slot, leaves in returned.items()
                        for leaf, dim in var.axes if slot.start <= leaf < slot.stop)
            if after <= before:  # every layer a sliding window: the cache stays within the bound
                return None
            step = leaves_at(self.shapes, {name: after})
            for slot, leaves in returned.items():
                step[slot.start : slot.stop] = leaves
            self.eager(step)
        except ModelRaised:  # the step past the bound fails: the model's own limit
            return None
        sizes = {axis: step[axis[0]].shape[axis[1]] for axis in var.axes}
        apart = sorted({f"{self.shapes.aligned.leaf_names[leaf]} holds {size}"
                        for (leaf, _), size in sizes.items() if size != after})
        held = tuple(sorted(axis for axis, size in sizes.items() if size == before))
        windowed = all(size in (before, after) for size in sizes.values())
        return Reach(f"the model's own next step from {name}={before} reaches {name}={after}" + (
            f", where {', '.join(apart)}" if apart else ""), held if windowed else ())


def _leaves_of(outputs: Any, spec: _pytree.TreeSpec) -> list[Any] | None:
    """The flat leaves of the first object in ``outputs`` flattening to ``spec`` (the cache a
    model returns for its next call), or ``None``."""
    pending = [outputs]
    while pending:
        value = pending.pop(0)
        if isinstance(value, spec.type):
            leaves, found = _pytree.tree_flatten(value)
            if found == spec:
                return leaves
        elif isinstance(value, dict):
            pending.extend(value.values())
        elif isinstance(value, (list, tuple)):
            pending.extend(value)
    return None


def _free_sizes(shapes: ShapeModel) -> dict[str, int]:
    free = free_variables(shapes)
    return {name: size for name, size in export_sizes(shapes).items() if name in free}


def leaves_at(shapes: ShapeModel, changed: dict[str, int]) -> list[Any]:
    """Inputs synthesized at the export sizes but ``changed`` (derived sizes following)."""
    sizes = complete_sizes(shapes, {**_free_sizes(shapes), **changed})
    return build_leaves(shapes, sizes, torch.Generator().manual_seed(0))


def _runs_rows_repeated(shapes: ShapeModel, eager: Eager, name: str, rows: int) -> bool:
    """Whether eager runs the richest recorded call with batch variable ``name``'s rows repeated
    to ``rows`` (synthesized inputs may be what eager rejected, not the size)."""
    leaves = rows_repeated(shapes, shapes.aligned.complete_call(), {name: rows})
    return leaves is not None and _eager_rejection(eager, leaves) is None


def _rejection(shapes: ShapeModel, eager: Eager, changed: dict[str, int]) -> str | None:
    """Why eager fails on inputs at the export sizes but ``changed`` (``None``: it runs)."""
    return _eager_rejection(eager, leaves_at(shapes, changed))


def _eager_rejection(eager: Eager, leaves: list[Any]) -> str | None:
    """Why eager fails on ``leaves`` (``None``: it runs)."""
    try:
        eager(detached_clone(leaves))
    except ModelRaised as e:  # the model's own check of its input sizes
        return str(e)
    return None
