"""The other sides of an image a graph fails on as it fails on the one a variation moved.

A graph that cannot serve a width the tests never used (a pooling to fixed bins, a reshape into
patches of the traced grid) most often cannot serve such a height either.  Found one at a time,
each side costs the check a trace, a translation and an exploration of its own: the width kept
static, the graph exported again, explored again, and only then the height found failing.
:func:`failing_alike` tries each other guessed side at once, on the same graph, moved alone by
the failing example's offset: a side failing there the same way (an error as the failure was, or
wrong values as they were) is refined with the failing one (see :mod:`..guesses`).
"""

from __future__ import annotations

from collections.abc import Callable

from ...core.vocabulary import DimSource
from ...shapes.axis_roles import SPATIAL
from ...shapes.model import ShapeModel
from ..verify.compare import Discrepancy

Sizes = dict[str, int]


def failing_alike(
    verdict: Callable[[Sizes], Discrepancy | None], shapes: ShapeModel, ranges: dict[str, tuple[int, int]],
    traced: Sizes, failing: Sizes,
) -> Sizes:
    """The sizes, by free variable, of the guessed sides (images' and signals' sides the tests
    never varied) that fail the graph alike when moved alone, each by the offset of the one guessed
    side the ``failing`` example moved (in the same steps, within its ``ranges``); ``{}`` when that
    example moved anything else or more than one side.  ``verdict`` runs an example of free sizes
    (``None``: eager rejects it)."""
    steps = {shapes.blocks_of(v.name): shapes.step_of(v.name) for v in shapes.variables if v.axes}
    sides = {v.name for v in shapes.variables
             if v.source == DimSource.GUESS and v.role in SPATIAL and v.name in ranges}
    moved = [name for name, size in failing.items() if size != traced.get(name)]
    if len(moved) != 1 or moved[0] not in sides:
        return {}
    (side,) = moved
    offset, failure = failing[side] - traced[side], verdict(failing)
    alike = {}
    for other in sorted(sides - {side}):
        size = traced[other] + offset
        low, high = ranges[other]
        if steps.get(other, 1) != steps.get(side, 1) or not low <= size <= high:
            continue
        found = verdict({**failing, side: traced[side], other: size})
        if found is not None and failure is not None and not found.ok and found.kind == failure.kind:
            alike[other] = size
    return alike
