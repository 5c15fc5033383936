"""How torch.export captures a program: the captures tried in turn, a retrace on another example
when torch pins a dim at the size the example happens to have."""

from __future__ import annotations

import dataclasses

import torch

from ...core.text import error_line
from ...core.vocabulary import Stage
from ...shapes.model import ShapeModel
from ..base.environment import EnvironmentProblem
from .bound import bind_constants
from .learned import LearnedDims
from .outcome import ExportOutcome
from .probe import SizeProbe
from .specializations import Specialized
from .trace_inputs import example_to_trace, other_examples
from .tracing import Capture, Example, Traced, reproduces, trace
from .tracing_patches import NO_PATCHES, TracingPatches


def traced_program(
    module: torch.nn.Module, shapes: ShapeModel, method: str = "forward", patches: TracingPatches = NO_PATCHES,
    capture: Capture | None = None,
) -> torch.export.ExportedProgram:
    """The program torch.export traces, as :func:`export_model` traced it (a graph whose ONNX
    file came from the export cache, traced again to localize a mismatch), by its ``capture``
    when known; raises on failure."""
    outcome, exported = begin(module, shapes, method)
    outcome.example = example_to_trace(getattr(module, method), shapes, not outcome.bound, outcome.notes)
    if capture is None:
        return captured(exported, shapes, outcome, None, patches).program
    return _pinned(exported, shapes, outcome, None, dataclasses.replace(capture, patches=patches)).program


def begin(module: torch.nn.Module, shapes: ShapeModel, method: str) -> tuple[ExportOutcome, torch.nn.Module]:
    """A fresh outcome, and the module to export (constants bound)."""
    outcome = ExportOutcome(ok=True, stage=Stage.TORCH_EXPORT, shapes=shapes)
    exported = bind_constants(module, method, shapes.aligned)
    outcome.bound = exported is not module
    return outcome, exported


def captured(
    module: torch.nn.Module, shapes: ShapeModel, outcome: ExportOutcome, probe: SizeProbe | None,
    patches: TracingPatches, learned: LearnedDims | None = None,
) -> Traced:
    """:func:`_pinned` captured as torch.onnx.export captures first (non-strict, sizes 0
    and 1 taken as any other); when that fails with an error (not a dim torch pins), captured
    the other ways, each graph then verified as any other: without size-oblivious sizes
    (torch.export's default, which proves what the size-oblivious capture cannot: a mask's batch
    ratio of 1), then strict, as torch.onnx.export falls back to (TorchDynamo takes some Python
    the non-strict capture cannot: ``int(lengths.max().item())``).  The first error stands when
    every capture fails.  ``outcome.capture`` says which capture the program comes from.
    ``learned``: what torch said of the model's named dims in its earlier traces (see :mod:`.learned`)."""
    learned = learned if learned is not None else LearnedDims()
    first = outcome.capture = Capture(patches, learned=learned)
    try:
        return _pinned(module, shapes, outcome, probe, first)
    except (Specialized, EnvironmentProblem):
        raise
    except Exception as error:
        notes = list(outcome.notes)
        for capture in (Capture(patches, oblivious=False, learned=learned),
                        Capture(patches, strict=True, learned=learned)):
            outcome.notes[:] = notes
            try:
                traced = _pinned(module, outcome.shapes, outcome, probe, capture)
            except Exception:
                continue
            outcome.capture = capture
            outcome.notes.append(f"captured by {capture}: {first}, as torch.onnx.export captures first, failed "
                                 f"({error_line(error)})")
            return traced
        outcome.notes[:] = notes
        raise error from None


def _pinned(
    module: torch.nn.Module, shapes: ShapeModel, outcome: ExportOutcome, probe: SizeProbe | None, capture: Capture,
) -> Traced:
    """:func:`~.tracing.trace` on the example; when torch pins a dim at the size the example
    happens to have (a size the model treats specially: DINOv2 skips its position interpolation
    at the config's image size), traced again on recorded calls of other sizes, then on inputs
    synthesized at another size, before failing.  The pin stands as soon as another size is
    pinned at the same line: that line pins every size (Mamba's ``for i in range(seq_len)``), not
    the one the example happened to have.  ``outcome.shapes`` follows the refinements made on the
    way, a failure's included."""
    assert outcome.example is not None
    try:
        return trace(module, shapes, outcome.example, not outcome.bound, outcome.notes, probe, capture)
    except Specialized as pinned:
        outcome.shapes = shapes = pinned.shapes
        if not pinned.retrace:
            raise
        for what, leaves in other_examples(shapes, outcome.example, pinned.name, probe):
            example = Example.of(shapes, leaves, constants=not outcome.bound)
            try:
                found = trace(module, shapes, example, not outcome.bound, outcome.notes, probe, capture, pinned)
            except Specialized as again:
                outcome.shapes = shapes = again.shapes
                if again.pins_as(pinned):
                    break
                continue
            if not reproduces(found.program, module, outcome.example):
                break  # the size is special for the model, not only for the trace: the pin stands
            outcome.example = example
            outcome.notes.append(f"traced on {what}: on the first example torch pinned {pinned}")
            return found
        raise
