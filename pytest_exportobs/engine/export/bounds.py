"""A bound torch puts on a dynamic dim, judged on the graph, on both sides.

torch.export bounds a dim where the model branches on its size (``if x.shape[1] > 4:``): the
program asserts the range, the ONNX file (which has no ranges) computes the traced branch at any
size.  Past an upper bound and below a lower one, eager is run: a size it rejects is the model's
own limit; one it runs that the graph, without torch's assert, serves as eager does is a note
(a layout-only branch); one the graph gets wrong is a :class:`~.specializations.Specialized`
failure naming torch's line.  An upper bound at the maximum the model's configuration declares
(``max_position_embeddings``) is its domain; one where the model's own next step holds some of
the dim's axes (a sliding window's layers) splits those axes off.
"""

from __future__ import annotations

import torch

from ...compat.torch_private import unchecked_module
from ...core.configuration import declared_maximum
from ...core.trees import detached_clone, flat_outputs
from ...core.vocabulary import RefinementKind
from ...shapes.model import ShapeModel
from ..verify.compare import Tolerance, compare
from .bound import BoundConstants
from .domain import Refinement, lower_bounds, program_shapes, upper_bounds
from .probe import SizeProbe, leaves_at
from .specializations import SpecializationLog, Specialized


def check_bounds(
    module: torch.nn.Module, shapes: ShapeModel, program: torch.export.ExportedProgram, inputs: list[int],
    constants: bool, probe: SizeProbe | None, specializations: SpecializationLog, notes: list[str],
) -> Refinement | None:
    """:func:`_check_upper` and :func:`_check_lower` on every demanded dim the program bounds
    (``inputs``: the leaves its inputs are); the first split one calls for."""
    read = program_shapes(program)
    for name, symbol, upper in upper_bounds(shapes, inputs, read, program.range_constraints):
        location = specializations.bound_location(symbol)
        if declared := declared_maximum(module.module if isinstance(module, BoundConstants) else module, upper):
            where = f" (at {location})" if location else ""
            notes.append(f"torch.export bounds {name} to at most {upper}, the model's declared {declared}{where}")
            continue
        split = _check_upper(shapes, name, upper, probe, location, program, constants, notes)
        if split is not None:
            return split
    for name, symbol, lower in lower_bounds(shapes, inputs, read, program.range_constraints):
        _check_lower(shapes, name, lower, probe, specializations.bound_location(symbol), program, constants, notes)
    return None


def _check_upper(
    shapes: ShapeModel, name: str, upper: int, probe: SizeProbe | None, location: str,
    program: torch.export.ExportedProgram, constants: bool, notes: list[str],
) -> Refinement | None:
    """A demanded dim torch bounds above where the model goes on (eager runs the next size, or the
    model's own next step reaches past it) is :class:`Specialized` when the graph, without
    torch's runtime assert, does not give eager's outputs there: it cannot serve what the model
    does.  A graph that does (a layout-only branch on the size, ``if x.shape[0] >= 64:
    x = x.contiguous()``) keeps the dim, with a note.  A bound eager cannot pass is the model's
    limit (``seq <= 128`` of its position table, the length of a static cache).  When the step
    past the bound holds some of the dim's axes at it (a sliding window's layers, the full ones
    going on), those axes need a length of their own: the split is returned, and the dim is
    exported again."""
    if any(w.derived == name and w.limit == upper for w in shapes.windows):
        return None  # the sliding window split off: the model's own states hold it there
    reached = probe.reaches(name, upper + 1) if probe is not None else None
    if reached is None:
        return None
    if reached.held:
        return Refinement(RefinementKind.SPLIT, name, upper, reached.held)
    assert probe is not None  # it reached past the bound
    if probe.accepts(name, upper + 1) and _serves(program, probe, name, upper + 1, constants):
        _served(notes, name, f"at most {upper}", upper + 1, location)
        return None
    raise Specialized(shapes, name, f"bounded to at most {upper} ({reached.how})", location, retrace=False)


def _check_lower(
    shapes: ShapeModel, name: str, lower: int, probe: SizeProbe | None, location: str,
    program: torch.export.ExportedProgram, constants: bool, notes: list[str],
) -> None:
    """A demanded dim torch bounds below sizes eager runs (``if x.shape[1] > 4:`` traced at 8) is
    :class:`Specialized` when the graph, without torch's assert, does not give eager's outputs one
    size below the bound: the ONNX file would compute the traced branch there.  A graph that does
    keeps the dim, with a note; a size eager rejects is the model's own limit."""
    below = lower - 1
    if probe is None or not probe.accepts(name, below):
        return
    if _serves(program, probe, name, below, constants):
        _served(notes, name, f"at least {lower}", below, location)
        return
    raise Specialized(shapes, name, f"bounded to at least {lower} (eager runs {name}={below}, the graph without "
                                    "torch's assert computes another branch there)", location, retrace=False)


def _served(notes: list[str], name: str, bound: str, size: int, location: str) -> None:
    where = f" (at {location})" if location else ""
    notes.append(f"torch.export bounds {name} to {bound} where the model takes another branch{where}; the graph, "
                 f"without torch's assert, serves {name}={size} as eager does")


def _serves(program: torch.export.ExportedProgram, probe: SizeProbe, name: str, size: int, constants: bool) -> bool:
    """Whether the program, without its runtime asserts (as the ONNX graph runs), gives eager's
    outputs on the probe's inputs at ``name`` = ``size``."""
    leaves = leaves_at(probe.shapes, {name: size})
    args, kwargs = probe.shapes.aligned.split_arguments(leaves, constants=constants)
    try:
        with torch.no_grad():
            expected = flat_outputs(probe.eager(detached_clone(leaves)))
            actual = flat_outputs(unchecked_module(program)(*args, **kwargs))
    except Exception:  # the graph fails there
        return False
    return compare(actual, expected, Tolerance()).ok
