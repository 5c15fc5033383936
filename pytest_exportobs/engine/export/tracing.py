"""torch.export with the shape model's named dims, and what to do with torch's suggested fixes.

torch rejects named dims with "Constraints violated" and a list of suggested fixes.  Fixes that
keep a dim dynamic are taken: an equality (``encoder_seq = seq``), a derived dim
(``height = 2*_height``), a range (``seq <= 128``).  A fix making a dim a constant (``batch = 2``)
is never taken for a dim a deployment needs: that is a :class:`Specialized` failure naming the
dim, the constant and the user's line that forced it.  A guessed dim (a generic input's second
axis) is made static instead, with a note.  A bound torch puts on a dim is the model's limit, a
failure, or a sliding window: the model's own next step holds some of the dim's axes at the
bound while the others go on, and those axes get a length of their own.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ...compat.lean_tracing import dispatches_cached, lean_tracing
from ...compat.torch_private import (
    DEFERRED_ASSERTS,
    ExportUserError,
    rnn_while_loops,
    size_oblivious,
    unchecked_module,
)
from ...compat.torch_text import pinned_sizes, rejects_dims, suggested_fixes, violations
from ...core.text import error_line, first_line
from ...core.trees import detached_clone, flat_outputs
from ...shapes.model import ShapeModel
from ...shapes.spec import spec_api, to_shapes_spec
from ..base.eager import call_model
from ..verify.compare import Tolerance, compare
from .bounds import check_bounds
from .domain import Refinement, apply_refinements, program_shapes, static_axes
from .learned import LearnedDims, names
from .probe import SizeProbe
from .specializations import SpecializationLog, Specialized, logged_specializations
from .tracing_patches import NO_PATCHES, TracingPatches

MAX_ATTEMPTS = 4  # exports tried with refined dims before giving up on named dims
SPEC_NOTE = "dims as a torch ShapesSpec"


@dataclass
class Example:
    """The call an export traces: its flat leaves, ``(args, kwargs)`` as the exported module
    takes them, and the leaves that are tensors (one graph input each, in order)."""

    leaves: list[Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    @classmethod
    def of(cls, shapes: ShapeModel, leaves: list[Any], constants: bool) -> Example:
        """The example of a call's flat ``leaves``; ``constants``: the exported module takes the
        call's constants as arguments (``False``: they are bound in it)."""
        return cls(leaves, *shapes.aligned.split_arguments(leaves, constants=constants))

    @property
    def inputs(self) -> list[int]:
        return [leaf for leaf, value in enumerate(self.leaves) if isinstance(value, torch.Tensor)]


@dataclass
class Traced:
    """What :func:`trace` made: the program, the form its dims were given in (``ShapesSpec`` or
    ``Dim``), the shape model as refined on the way, and the variables split there (a sliding
    window's axes held apart from the others: see :mod:`.bounds`)."""

    program: torch.export.ExportedProgram
    form: str
    shapes: ShapeModel
    splits: list[Refinement]


@dataclass(frozen=True)
class Capture:
    """How torch.export captures a model: under the export ``patches``, non-strict (what
    torch.onnx.export tries first) or ``strict`` (its fallback, TorchDynamo capturing the model's
    Python: ``int(lengths.max().item())`` becomes an unbacked size there), with sizes 0 and 1
    taken as any other (``oblivious``, what torch.onnx.export sets) or as torch.export alone
    takes them (where the size-oblivious capture cannot prove what the model assumes: a mask's
    batch ratio of 1); always without what buys a trace nothing (``compat.lean_tracing``); with
    what torch said of the model's named dims in its earlier traces (``learned``, shared by the
    captures of one model's check: see :mod:`.learned`)."""

    patches: TracingPatches = NO_PATCHES
    strict: bool = False
    oblivious: bool = True
    learned: LearnedDims = field(default_factory=LearnedDims, compare=False)

    def __str__(self) -> str:
        """``torch.export(strict=True)``, ``torch.export without size-oblivious sizes``..."""
        return f"torch.export({'strict=True' if self.strict else ''})" + (
            "" if self.oblivious else " without size-oblivious sizes")

    def export(self, module: torch.nn.Module, example: Example, dynamic_shapes: Any,
               **options: Any) -> torch.export.ExportedProgram:
        with self.patches.tracing(), lean_tracing():
            program = torch.export.export(module, example.args, example.kwargs, dynamic_shapes=dynamic_shapes,
                                          strict=self.strict, **options)
        return dispatches_cached(program)


NON_STRICT = Capture()


def trace(
    module: torch.nn.Module, shapes: ShapeModel, example: Example, constants: bool, notes: list[str],
    probe: SizeProbe | None, capture: Capture = NON_STRICT, pinned: Specialized | None = None,
) -> Traced:
    """``torch.export.export`` of ``module`` on the example with the shape model's named dims,
    refined with torch's suggested fixes, captured as ``torch.onnx.export`` captures (see
    :func:`capturing`), as ``capture`` says (under the export patches; the probe's eager runs are
    not).  A dim the program still has as a constant is checked like a suggested constant; a
    demanded dim torch bounds above is a :class:`Specialized` failure when the ``probe`` finds
    eager reaching a size past the bound, or exported again split where the model's own next step
    holds some of its axes at the bound.  ``pinned``: how the dims were pinned on another example;
    pinned again at the same line, the dim is not tried as ``Dim.DYNAMIC`` (that line pins every
    size).  With ``pinned`` the named dims are tried first: torch pinned them once the ShapesSpec
    export had failed on the other example (a dim of the spec, unbacked, is never pinned), and
    that export fails alike at any size.  Raises :class:`Specialized`, or torch's error."""
    splits: list[Refinement] = []
    spec = spec_api() is not None and pinned is None
    with capturing(capture.oblivious), logged_specializations() as specializations:
        while True:
            program = _spec_export(module, shapes, example, constants, notes, capture) if spec else None
            form = "Dim" if program is None else "ShapesSpec"
            if program is None:
                program, shapes = _export(module, shapes, example, constants, specializations, notes, capture,
                                          pinned)
            read = program_shapes(program)
            for axis in static_axes(shapes, example.inputs, read):
                shapes = _keep_static(shapes, {axis.variable.name: axis.value}, specializations, notes)
            probe = replace(probe, shapes=shapes) if probe is not None else None
            split = check_bounds(module, shapes, program, example.inputs, constants, probe, specializations, notes)
            if split is None:
                return Traced(program, form, shapes, splits)
            splits.append(split)
            shapes, split_notes = apply_refinements(shapes, [split])
            notes.extend(split_notes)


def _spec_export(
    module: torch.nn.Module, shapes: ShapeModel, example: Example, constants: bool, notes: list[str],
    capture: Capture,
) -> torch.export.ExportedProgram | None:
    """Export with the shape model as a ``ShapesSpec`` (torch >= 2.14): relations become checks
    of the exported program.  ``None``, with a note, when torch cannot (a branch on a size of an
    unbacked dim, a nest the spec cannot address): the named dims are tried then."""
    try:
        spec = to_shapes_spec(shapes, constants)
        program = capture.export(module, example, spec)
    except Exception as e:  # whatever the spec path meets, the named dims remain
        notes.append(f"dims as named torch.export.Dim: the ShapesSpec export failed ({error_line(e)})")
        return None
    notes.append(f"{SPEC_NOTE}: relations are checked by the exported program")
    return program


def _export(
    module: torch.nn.Module, shapes: ShapeModel, example: Example, constants: bool, specializations: SpecializationLog,
    notes: list[str], capture: Capture, pinned: Specialized | None = None,
) -> tuple[torch.export.ExportedProgram, ShapeModel]:
    """Named dims, refined until torch accepts them; else ``Dim.DYNAMIC`` and torch's ranges,
    unless a demanded dim is ``pinned`` as before.  Returns the program and the shape model without
    the guessed dims torch made constant."""
    learned = capture.learned
    named: tuple[Any, ...] | dict[str, Any] | list[Any] = shapes.to_dynamic_shapes(named=True, constants=constants)
    known = sorted(learned.unfixed & names(named))
    reason = f"{', '.join(known)} on an earlier graph of the model, suggesting no fix"
    if not known:
        named = _with_learned(named, shapes, example, learned, notes)
    for _ in range(0 if known else MAX_ATTEMPTS):
        try:
            return _torch_export(module, example, named, capture), shapes
        except ExportUserError as e:
            if not rejects_dims(str(e)):
                raise
            rejection = e
        reason = first_line(str(rejection))
        fixes = suggested_fixes(rejection.msg)
        specialized = pinned_sizes(fixes)
        if specialized:
            try:
                shapes = _keep_static(shapes, specialized, specializations, notes)
            except Specialized as again:
                if again.pins_as(pinned):
                    raise
                return _unnamed_export(module, again.shapes, example, constants, again, notes, capture), again.shapes
            named = _with_learned(shapes.to_dynamic_shapes(named=True, constants=constants), shapes, example, learned,
                                  notes)
            continue
        unfixed = _unfixed(rejection.msg, fixes)
        if unfixed:  # refined, the named dims would be rejected again for these
            learned.unfixed |= unfixed
            break
        try:
            named = torch.export.dynamic_shapes.refine_dynamic_shapes_from_suggested_fixes(rejection.msg, named)
        except Exception:  # no fix torch can apply itself (a stride-2 range, ...)
            break
        learned.learn(fixes)
        notes.append("named dims refined with torch's suggested fixes: " + "; ".join(f"{n} = {v}" for n, v in fixes))
    notes.append(
        f"torch.export rejected the named dims ({reason}): exported with Dim.DYNAMIC dims, torch deriving their ranges"
    )
    return _torch_export(module, example, shapes.to_dynamic_shapes(constants=constants), capture), shapes


def _with_learned(named: Any, shapes: ShapeModel, example: Example, learned: LearnedDims, notes: list[str]) -> Any:
    """The shape model's ``named`` dims with the fixes torch suggested in the model's earlier
    traces, where the example's sizes are of their form (see :mod:`.learned`)."""
    sizes = {variable.name: [example.leaves[leaf].shape[axis] for leaf, axis in variable.axes
                             if isinstance(example.leaves[leaf], torch.Tensor)] for variable in shapes.variables}
    named, taken = learned.refine(named, sizes)
    if taken:
        notes.append("named dims as torch suggested on an earlier graph of the model: "
                     + "; ".join(line for fix in taken for line in fix.lines))
    return named


def _unfixed(message: str, fixes: list[tuple[str, str]]) -> set[str]:
    """The dims torch rejects and suggests no fix for (in no fix's name or expression) on guards
    of that dim alone: refining the others leaves those guards, and torch rejects it again (a
    backbone's ``batch != 1``)."""
    fixed = {word for name, value in fixes for word in (name, *re.findall(r"\w+", value))}
    rejected = violations(message)
    return {name for name, violation in rejected.items()
            if name not in fixed and not any(other.source in guard for guard in violation.guards
                                             for other_name, other in rejected.items() if other_name != name)}


def _unnamed_export(
    module: torch.nn.Module, shapes: ShapeModel, example: Example, constants: bool, pinned: Specialized,
    notes: list[str], capture: Capture,
) -> torch.export.ExportedProgram:
    """``Dim.DYNAMIC`` dims when torch pins a demanded named dim: named dims make torch solve its
    guards for one value (a conv stack's ``(w // 16 - 6) == 244``) where unnamed ones keep a range.
    The pin stands when that export fails too, or when its graph does not serve a recorded call
    (DINOv2 traced at its configured image size leaves its position interpolation out, asserting
    ``(height//8)**2 == 16``): tracing on another recorded size is tried then (:func:`trace` still
    checks what the program keeps)."""
    try:
        program = _torch_export(module, example, shapes.to_dynamic_shapes(constants=constants), capture)
    except Exception:  # torch's own error on the unnamed dims: the pin named dims gave is the reason
        raise pinned from None
    if not reproduces(program, module, *(Example.of(shapes, shapes.call_leaves(i), constants)
                                          for i in range(shapes.aligned.n_calls))):
        raise pinned
    notes.append(f"exported with Dim.DYNAMIC dims: with named dims, {pinned.name} was {pinned.what}")
    return program


def reproduces(program: torch.export.ExportedProgram, module: torch.nn.Module, *examples: Example) -> bool:
    """Whether the program, run as its ONNX graph runs (no runtime assert: some are spurious, a
    conv stack's ``Eq(length//16, 500)``), gives eager's outputs on every example; one the
    program or the model's own call rejects is not reproduced."""
    graph = unchecked_module(program)
    for example in examples:
        try:
            with torch.no_grad():
                args, kwargs = detached_clone((example.args, example.kwargs))
                expected = flat_outputs(call_model(module, *args, **kwargs))
                actual = flat_outputs(graph(*detached_clone(example.args), **detached_clone(example.kwargs)))
        except Exception:
            return False
        if not compare(actual, expected, Tolerance()).ok:
            return False
    return True


def _torch_export(
    module: torch.nn.Module, example: Example, dynamic_shapes: Any, capture: Capture,
) -> torch.export.ExportedProgram:
    """torch.export as torch.onnx.export calls it: guards that can wait become runtime asserts
    (a GRU's ``seq != 1`` does not stop its sequence from being dynamic)."""
    options: dict[str, Any] = {"prefer_deferred_runtime_asserts_over_guards": True} if DEFERRED_ASSERTS else {}
    return capture.export(module, example, dynamic_shapes, **options)


@contextlib.contextmanager
def capturing(oblivious: bool = True) -> Iterator[None]:
    """What ``torch.onnx.export`` enters around torch.export: size-oblivious sizes (0 and 1 are
    not specialized; ``oblivious``) and, where this torch has them, the RNN decompositions into a
    while loop that keep a GRU's or an LSTM's sequence dynamic."""
    with size_oblivious() if oblivious else contextlib.nullcontext(), rnn_while_loops():
        yield


def _keep_static(
    shapes: ShapeModel, constants: dict[str, int], specializations: SpecializationLog, notes: list[str],
) -> ShapeModel:
    """The shape model with the guessed dims torch pins static; a demanded one raises
    :class:`Specialized` (holding the model with the guessed dims before it made static)."""
    for name, value in constants.items():
        var = next((v for v in shapes.variables if v.name == name), None)
        if var is None:
            continue
        inputs = sorted({shapes.aligned.leaf_slot(leaf).name for leaf, _ in var.axes})
        location = specializations.location_of(value, inputs)
        if var.demanded:
            raise Specialized(shapes, name, f"specialized to {value}", location)
        shapes = shapes.without(name)
        where = f" at {location}" if location else ""
        notes.append(f"{name} kept static: torch.export specializes it to {value}{where}")
    return shapes
