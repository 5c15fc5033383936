"""Dims the tests never varied that a graph's variations find it cannot serve at every size.

A guessed dim (an image's side, a generic input's axis, no role demanding it) may be one the model
takes in steps only (a pipeline's latents have even sides; a cropped position table's arithmetic
translated for even sizes): explored again in larger steps (:func:`stepped`).  Otherwise
the graph serves the traced size only (a branch on a size traced once): static again
(:func:`kept_static`).  Either way a note names the failing line, and the graph's verdict does not
rest on a size no call had.
"""

from __future__ import annotations

from collections.abc import Callable

from ..core.vocabulary import DimSource
from ..shapes.axis_roles import SPATIAL
from ..shapes.model import ShapeModel
from ..shapes.synthesis import complete_sizes, export_sizes
from .base.origins import failure_line
from .explore.variations import VariationOutcome

MAX_STEP = 16  # the largest multiple an image's side or a signal's length is explored in
# refines a shape model after a failing variation, with a note; None when it does not apply
Refine = Callable[[ShapeModel, VariationOutcome, str, list[str]], ShapeModel | None]


def stepped(shapes: ShapeModel, variation: VariationOutcome, onnx_path: str, notes: list[str]) -> ShapeModel | None:
    """The shape model with the sides a failing variation moved (those of images and signals the
    tests never varied, and only those) in larger steps: 2 at first (a pipeline's latents have
    even sides), then :data:`MAX_STEP` (a patch of a downsampled grid), when the graph raises
    there (an error, never wrong numbers: a deployment at such a size is told, not misled) and
    the failing sizes are no such multiple and the traced ones are; ``None`` otherwise."""
    spatial = {shapes.blocks_of(v.name): v.name for v in shapes.variables
               if v.axes and v.source == DimSource.GUESS and v.role in SPATIAL}
    free = moved_guesses(shapes, variation)
    if variation.max_abs is not None or not free or any(name not in spatial for name in free):
        return None
    moved = [spatial[name] for name in free]
    traced = export_sizes(shapes)
    sizes = _failing_sizes(shapes, variation)
    steps = {name: 2 if shapes.step_of(name) == 1 else MAX_STEP for name in moved}
    if any(traced[name] % step or step <= shapes.step_of(name) or sizes[name] % step == 0
           for name, step in steps.items()):
        return None
    notes.append(f"{', '.join(f'{name} in multiples of {step}' for name, step in steps.items())}: the graph fails at "
                 f"{_failures(shapes, variation, onnx_path)}, where eager runs; the tests never varied them")
    for name, step in steps.items():
        shapes = shapes.stepped(name, step)
    return shapes


def kept_static(shapes: ShapeModel, variation: VariationOutcome, onnx_path: str, notes: list[str]) -> ShapeModel | None:
    """The shape model without the guessed dims a failing variation moved (the graph serves the
    traced size only: a branch on the size traced once), with a note naming the failing node's
    line; ``None`` when it moved none."""
    guessed = moved_guesses(shapes, variation)
    if not guessed:
        return None
    named = [_stepped_by(shapes).get(name, name) for name in guessed]
    notes.append(f"{', '.join(named)} kept static: the tests never varied them and the graph fails at "
                 f"{_failures(shapes, variation, onnx_path)}, where eager runs")
    for name in guessed:
        shapes = shapes.without(name)
    return shapes


def moved_guesses(shapes: ShapeModel, variation: VariationOutcome) -> list[str]:
    """The guessed dims whose sizes in a failing variation are not the traced ones, and those
    failing alike (see :mod:`.explore.alike`)."""
    failing, traced = {**(variation.failing_sizes or {}), **variation.alike}, export_sizes(shapes)
    return [v.name for v in shapes.variables if v.source == DimSource.GUESS
            and failing.get(v.name, traced.get(v.name)) != traced.get(v.name)]


def _failures(shapes: ShapeModel, variation: VariationOutcome, onnx_path: str) -> str:
    """``width=32 (in file.py:12: code)``, the sizes a failing variation moved and the line it
    fails in (else its detail), then ``, and alike at height=32 alone`` for the sides failing alike."""
    sizes, traced, stepped_by = _failing_sizes(shapes, variation), export_sizes(shapes), _stepped_by(shapes)
    guessed = {v.name for v in shapes.variables if v.source == DimSource.GUESS}

    def shown(free: dict[str, int]) -> str:
        named = [stepped_by.get(name, name) for name in free if name in guessed and free[name] != traced.get(name)]
        return ", ".join(f"{name}={sizes[name]}" for name in named)

    line = failure_line(onnx_path, variation.detail)
    alike = f", and alike at {shown(variation.alike)} alone" if variation.alike else ""
    return f"{shown(variation.failing_sizes or {})} ({f'in {line}' if line else variation.detail}){alike}"


def _failing_sizes(shapes: ShapeModel, variation: VariationOutcome) -> dict[str, int]:
    """Every variable's size, the failing variation's and the alike sides' moved (each their own)."""
    return complete_sizes(shapes, {**export_sizes(shapes), **(variation.failing_sizes or {}), **variation.alike})


def _stepped_by(shapes: ShapeModel) -> dict[str, str]:
    """The stepped variables, by the free variable each is a multiple of."""
    return {shapes.blocks_of(v.name): v.name for v in shapes.variables if v.axes}
