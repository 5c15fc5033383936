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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree

from ...core.configuration import declared_patch
from ...core.trees import detached_clone
from ...core.vocabulary import DimSource
from ...shapes.axis_roles import SPATIAL
from ...shapes.dims import Axis
from ...shapes.model import ShapeModel
from ...shapes.synthesis import build_leaves, complete_sizes, export_sizes, free_variables, rows_repeated
from ..base.eager import ModelRaised
from .cache import ExportCache, ProbeEntry

Eager = Callable[[list[Any]], Any]
STEPS = 5  # doublings of the patch a probe tries on an image's side or a signal's length


def probed_unvaried_dims(
    module: torch.nn.Module, method: str, shapes: ShapeModel, eager: Eager, notes: list[str],
    cache: ExportCache | None,
) -> ShapeModel:
    """:func:`probe_unvaried_dims`, or what it found on an earlier run for the same module,
    method and shape model (the export ``cache``'s probe entry, replayed): no eager run then."""
    key = cache.probe_key(module, method, shapes) if cache is not None else ""
    entry = cache.load_probe(key) if cache is not None else None
    if entry is None:
        entry = ProbeEntry()
        probe_unvaried_dims(Probed(shapes, entry.changes), eager, entry.notes, declared_patch(module))
        if cache is not None:
            with contextlib.suppress(OSError):  # an unwritable cache costs the next run its speed, noted by the export
                cache.store_probe(key, entry)
    notes.extend(entry.notes)
    return entry.applied(shapes)


@dataclass
class Probed:
    """A shape model as a probe refines it, and the refinements made, in order (``[method,
    *arguments]``: what a :class:`~.cache.ProbeEntry` replays)."""

    shapes: ShapeModel
    changes: list[list[Any]] = field(default_factory=list)

    def refine(self, method: str, *arguments: Any) -> None:
        self.shapes = getattr(self.shapes, method)(*arguments)
        self.changes.append([method, *arguments])


def probe_unvaried_dims(probed: Probed, eager: Eager, notes: list[str], patch: int = 1) -> ShapeModel:
    """The shape model with the dynamic variables no call varied made of sizes eager accepts: one
    size larger, or, for an image's side and a signal's length, a multiple of ``patch`` (the
    model's declared patch size) larger, doubled up to :data:`STEPS` times (the model's
    downsampling), the variable then stepped by it; with the axes of other inputs the model ties
    to it varied alongside (the fewest it needs), then tied.  A variable eager rejects at every
    such size is static again.  All at once first: one eager run when the model accepts them all."""
    shapes = probed.shapes
    free = free_variables(shapes)
    candidates = [v.name for v in shapes.variables if v.source in (DimSource.ROLE, DimSource.GUESS) and v.name in free]
    base = _free_sizes(shapes)
    first = {name: _steps(shapes, name, base[name], patch)[0] for name in candidates}
    if candidates and _rejection(shapes, eager, {name: base[name] + first[name] for name in candidates}) is None:
        for name in candidates:
            _step(probed, name, first[name], notes)
        return probed.shapes
    for name in candidates:
        if name not in free_variables(probed.shapes):
            continue  # tied to a variable probed before
        if _accept(probed, eager, name, base[name], _steps(probed.shapes, name, base[name], patch), notes):
            continue
        if not _runs_rows_repeated(probed.shapes, eager, name, base[name] + 1):
            error = _rejection(probed.shapes, eager, {name: base[name] + first[name]})
            probed.refine("without", name)
            notes.append(f"{name} kept static: eager rejects {name}={base[name] + first[name]} ({error})")
    return probed.shapes


def _steps(shapes: ShapeModel, name: str, size: int, patch: int) -> list[int]:
    """What a probe adds to variable ``name`` of ``size``: 1, or for an image's side or a signal's
    length ``patch`` doubled up to :data:`STEPS` times, within ``size``."""
    var = next(v for v in shapes.variables if v.name == name)
    if var.role not in SPATIAL:
        return [1]
    return [patch << k for k in range(STEPS) if patch << k <= max(size, patch)]


def _accept(probed: Probed, eager: Eager, name: str, size: int, steps: list[int], notes: list[str]) -> bool:
    """Whether eager accepts variable ``name`` at the first size past ``size`` by one of ``steps``,
    alone or with the fewest axes the model ties to it varied alongside (:func:`tied_axes`); if
    so, the variable is refined so (tied, stepped)."""
    shapes = probed.shapes
    partners = tied_axes(shapes, name)
    for step in steps:
        changed = {name: size + step}
        if _rejection(shapes, eager, changed) is None:
            _step(probed, name, step, notes)
            return True
        tried = [partners, *([p] for p in partners)] if len(partners) > 1 else [partners] if partners else []
        needed = next((ties for ties in tried if _rejection(shapes.tied(name, ties), eager, changed) is None), None)
        if needed is None:
            continue
        for partner in list(needed) if len(needed) > 1 else []:  # the fewest the model needs
            fewer = [p for p in needed if p != partner]
            if _rejection(shapes.tied(name, fewer), eager, changed) is None:
                needed = fewer
        axes = ", ".join(f"{shapes.aligned.leaf_names[leaf]}.{dim}" + (f" ({scale}x)" if scale > 1 else "")
                         for (leaf, dim), scale in needed)
        notes.append(f"{axes} tied to {name}: eager runs {name}={size + step} with them varied alongside, not alone")
        probed.refine("tied", name, needed)
        _step(probed, name, step, notes)
        return True
    return False


def _step(probed: Probed, name: str, step: int, notes: list[str]) -> None:
    """Variable ``name`` in multiples of ``step`` when that is more than 1 and every recorded size
    is one, with a note."""
    var = next(v for v in probed.shapes.variables if v.name == name)
    if step > 1 and not any(size % step for size in var.known):
        probed.refine("stepped", name, step)
        notes.append(f"{name} in multiples of {step}: sizes the model accepts (its patch or downsampling)")


def tied_axes(shapes: ShapeModel, name: str) -> list[tuple[Axis, int]]:
    """``(axis, scale)`` of every axis of another input whose size is ``scale`` times variable
    ``name``'s in every call (scale a whole number): a static axis, or the first axis of another
    free variable the tests never varied.  The model may tie them (``img_ids``' tokens to
    ``hidden_states``'); a probe finds which it does."""
    var = next(v for v in shapes.variables if v.name == name)
    free = set(free_variables(shapes)) - {name}
    unvaried = {v.name for v in shapes.variables if v.name in free and v.source in (DimSource.ROLE, DimSource.GUESS)}
    own = {leaf for leaf, _ in var.axes}
    found = []
    for leaf, sizes in enumerate(zip(*shapes.aligned.shapes())):
        if leaf in own or not shapes.aligned.is_tensor_leaf(leaf):
            continue
        rank = next((len(s) for s in sizes if s is not None), 0)
        for dim in range(rank):
            other = shapes.variable_of((leaf, dim))
            if other is not None and (other.name not in unvaried or other.axes[0] != (leaf, dim)):
                continue
            scale = _scale(var.values, [s[dim] if s is not None else None for s in sizes])
            if scale:
                found.append(((leaf, dim), scale))
    return found


def _scale(sizes: list[int | None], others: list[int | None]) -> int:
    """The whole number ``others`` are times ``sizes`` wherever both are known (0: none)."""
    pairs = [(a, b) for a, b in zip(sizes, others) if a and b is not None]
    if not pairs or pairs[0][1] % pairs[0][0]:
        return 0
    scale = pairs[0][1] // pairs[0][0]
    return scale if all(b == scale * a for a, b in pairs) else 0


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
