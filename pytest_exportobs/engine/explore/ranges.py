"""The ranges an exploration draws each free size from, around the sizes the tests used and
bounded in what the largest example costs: its largest input, its growth over the traced example
(a model taking images or signals), its outputs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import sympy

from ...shapes.axis_roles import SPATIAL
from ...shapes.model import ShapeModel
from ...shapes.synthesis import complete_sizes, export_sizes, free_variables, leaf_shapes
from ..export.integers import integer_value

MAX_ELEMENTS = 1 << 19  # elements of the largest generated input (a batch of 3 images of 3x224x224)
# how much larger than the traced example the largest generated one of a model taking images or
# signals may be, as the product of each free size's ratio to its traced size: attention over an
# image's patches grows with the square of its sides and with the batch (a diffusion transformer
# at 4x the batch, 2x the text and 1.5x each side took 3 GB)
MAX_GROWTH = 8
# elements of the outputs of the largest generated example, all outputs together (64 MB in
# float32): attention maps grow with the square of the patches or tokens, where inputs grow
# with them (BEiT's tests at 2x the batch, 1.5x each side: 98M elements in 4 layers' attention
# maps, eager's and the runtime's, 2.5 GB in a check's process)
MAX_OUTPUT_ELEMENTS = 1 << 24
MAX_SIZE = 512  # largest size drawn for any variable
SMALL_CEILING = 8  # variables observed small may still grow to this size


def size_ranges(
    shapes: ShapeModel, max_elements: int = MAX_ELEMENTS, recorded_only: bool = False,
    ceilings: Mapping[str, int] | None = None, output_elements: sympy.Basic | None = None,
) -> dict[str, tuple[int, int]]:
    """``(low, high)`` of every free variable: from 2 (or the observed minimum when smaller) up
    to twice the observed maximum (at least 8; an image's side or a signal's length to half again
    its maximum; at most 512), highs lowered until the largest input at the highs has at most
    ``max_elements`` elements, for a model taking images or signals the highs together are at
    most :data:`MAX_GROWTH` times the traced sizes, and the outputs at the highs hold at most
    :data:`MAX_OUTPUT_ELEMENTS` (``output_elements``: how many they hold, by the variables; see
    :func:`~..export.domain.output_elements`), but not below one size past the one the graph was
    traced at (a size the tests never used stays within reach); a sliding window's term reaches
    past the window's limit when that is within 512.  With ``recorded_only`` the sizes of empty
    stand-ins (a cache absent at prefill) do not count as observed.  No high exceeds a
    variable's ``ceilings`` (the largest size the target planned for)."""
    bounds = shapes.bounds(recorded_only)
    spatial = {v.name for v in shapes.variables if v.role in SPATIAL}
    ranges = {name: _range(*bounds[name], name in spatial) for name in free_variables(shapes)}
    for window in shapes.windows:
        if window.term in ranges:
            low, high = ranges[window.term]
            ranges[window.term] = (low, max(high, min(window.limit + 2, MAX_SIZE)))
    for name, ceiling in (ceilings or {}).items():
        if name in ranges:
            low, high = ranges[name]
            ranges[name] = (min(low, ceiling), min(high, ceiling))
    traced = export_sizes(shapes)
    floors = {name: min(high, max(low, traced.get(name, low) + 1)) for name, (low, high) in ranges.items()}
    def growth(name: str) -> float:
        return ranges[name][1] / max(1, traced.get(name, 1))

    while _largest_input(shapes, {n: high for n, (_, high) in ranges.items()}) > max_elements:
        if not _shrunk(ranges, floors, key=lambda n: ranges[n][1]):
            break
    while spatial and math.prod(growth(n) for n in ranges) > MAX_GROWTH:
        if not _shrunk(ranges, floors, key=growth):
            break
    while output_elements is not None and _outputs_at_highs(shapes, ranges, output_elements) > MAX_OUTPUT_ELEMENTS:
        if not _shrunk(ranges, floors, key=growth):
            break
    return ranges


def _outputs_at_highs(shapes: ShapeModel, ranges: Mapping[str, tuple[int, int]], output_elements: sympy.Basic) -> int:
    """How many elements the outputs hold with every free size at its high (0: not computable)."""
    sizes = complete_sizes(shapes, {name: high for name, (_, high) in ranges.items()})
    return integer_value(output_elements, sizes) or 0


def _shrunk(ranges: dict[str, tuple[int, int]], floors: dict[str, int], key: Callable[[str], float]) -> bool:
    """Lower the high of the range that ``key`` finds largest by a quarter (not below its floor);
    ``False`` when every high is at its floor."""
    shrinkable = [n for n, (_, high) in ranges.items() if high > floors[n]]
    if not shrinkable:
        return False
    name = max(shrinkable, key=key)
    low, high = ranges[name]
    ranges[name] = (low, max(floors[name], min(high - 1, high * 3 // 4)))
    return True


def _range(observed_min: int, observed_max: int, spatial: bool = False) -> tuple[int, int]:
    """From 2 to twice the observed maximum (at least :data:`SMALL_CEILING`); an image's side or a
    signal's length to half again its maximum (the area of an image, and what attention over its
    patches costs, grows with the square of its sides)."""
    high = max(observed_max + 1, observed_max * 3 // 2) if spatial else max(2 * observed_max, SMALL_CEILING)
    return min(2, observed_min), min(high, MAX_SIZE)


def _largest_input(shapes: ShapeModel, free: dict[str, int]) -> int:
    leaf_sizes = [math.prod(s) for s in leaf_shapes(shapes, complete_sizes(shapes, free)) if s is not None]
    return max(leaf_sizes, default=0)
