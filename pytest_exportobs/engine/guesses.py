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
    sizes = complete_sizes(shapes, {**traced, **(variation.failing_sizes or {})})
    steps = {name: 2 if shapes.step_of(name) == 1 else MAX_STEP for name in moved}
    if any(traced[name] % step or step <= shapes.step_of(name) or sizes[name] % step == 0
           for name, step in steps.items()):
        return None
    line = failure_line(onnx_path, variation.detail)
    shown = ", ".join(f"{name}={sizes[name]}" for name in moved)
    notes.append(f"{', '.join(f'{name} in multiples of {step}' for name, step in steps.items())}: the graph fails at "
                 f"{shown} ({f'in {line}' if line else variation.detail}), where eager runs; the tests never varied "
                 "them")
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
    line = failure_line(onnx_path, variation.detail)
    stepped_by = {shapes.blocks_of(v.name): v.name for v in shapes.variables if v.axes}  # a step's free variable
    named = [stepped_by.get(name, name) for name in guessed]
    sizes = complete_sizes(shapes, {**export_sizes(shapes), **(variation.failing_sizes or {})})
    shown = ", ".join(f"{name}={sizes[name]}" for name in named)
    notes.append(f"{', '.join(named)} kept static: the tests never varied them and the graph fails at {shown} "
                 f"({f'in {line}' if line else variation.detail}), where eager runs")
    for name in guessed:
        shapes = shapes.without(name)
    return shapes


def moved_guesses(shapes: ShapeModel, variation: VariationOutcome) -> list[str]:
    """The guessed dims whose sizes in a failing variation are not the traced ones."""
    failing, traced = variation.failing_sizes or {}, export_sizes(shapes)
    return [v.name for v in shapes.variables if v.source == DimSource.GUESS
            and failing.get(v.name, traced.get(v.name)) != traced.get(v.name)]
