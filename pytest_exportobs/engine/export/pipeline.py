"""Export one module to ONNX, or to ExecuTorch, through explicit, separately timed stages.

``torch.export`` → decompositions → ONNX translation → ``onnx.checker`` (ORT loading is the
verifier's first step); for ExecuTorch, ``torch.export`` → ``lower`` (the edge dialect, the
XNNPACK delegate, the ``.pte`` file).  Every failure becomes an :class:`ExportOutcome` naming the stage, the
kind and a one-line reason; nothing raises.  The shape model is refined with what torch proved,
and the dims reported are read back from the file written.  An :class:`~.cache.ExportCache`
skips the capture when nothing the trace depends on changed, and the decomposition and
translation when the traced program is one it holds (the lowering when it holds the trace's
``.pte`` for the same weights); a check of several targets traces once, each target after the
first taking the program traced for it (:class:`Traced`).
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ...compat.torch_private import (
    import_export_machinery,
    onnx_decompositions,
    output_order,
    register_translations,
)
from ...core.text import error_line
from ...core.trees import spec_paths
from ...core.vocabulary import Stage, Target
from ...shapes.model import ShapeModel
from ..base.environment import EnvironmentProblem, writing
from .cache import ExportCache, GraphEntry, GraphHit, TraceEntry
from .capturing import begin, captured
from .digests import call_structure, module_state
from .domain import (
    Refinement,
    Shape,
    apply_refinements,
    asserted_conditions,
    deferred_asserts,
    made_static,
    onnx_shapes,
    output_elements,
    program_shapes,
    read_dims,
    refinements,
)
from .executorch_stages import load_lowered, to_executorch
from .learned import LearnedDims
from .onnx_stages import check_onnx, decompose, finish, save_with_weights, translate
from .outcome import ExportOutcome, StageFailed, Stages
from .probe import SizeProbe
from .replay import failed_as_before, failure_of, keep, restore, trace_entry
from .trace_inputs import example_to_trace, planned_example
from .tracing_patches import NO_PATCHES, TracingPatches
from .translations import custom_translations


@dataclass(frozen=True)
class Traced:
    """A program traced for one target of a check, for the next target to take under the same
    trace key: the program, its symbols' names and what the trace established (as a trace entry)."""

    program: torch.export.ExportedProgram
    names: dict[str, str]
    entry: TraceEntry


def export_model(
    module: torch.nn.Module, shapes: ShapeModel, target: Target, path: Path,
    cache: ExportCache | None = None, method: str = "forward", probe: SizeProbe | None = None,
    patches: TracingPatches = NO_PATCHES, traces: dict[str, Traced] | None = None,
    learned: LearnedDims | None = None,
) -> ExportOutcome:
    """Export ``module.<method>`` called on ``shapes``' example inputs with its dynamic dimensions,
    torch.export running under ``patches``; ``target`` ``onnx`` translates and writes ``path``,
    ``executorch`` lowers the program and writes ``path`` as a ``.pte`` (see :mod:`.lowering`),
    ``torch`` stops after torch.export.  The shape model is refined with what torch proved (equal
    dims, multiples of 2...).  The ``probe`` runs eager at sizes torch's bounds exclude (``None``:
    bounds are not checked).  ``traces`` holds the programs traced for the check's other targets,
    by trace key: one found there is not traced again, one traced here is added.  ``learned``: what
    torch said of the model's named dims in its earlier traces (see :mod:`.learned`)."""
    outcome, exported = begin(module, shapes, method)
    stages = Stages(outcome)
    cached = cache if target != Target.TORCH else None
    state = module_state(exported)
    planned = None
    if cached is not None:
        # the example a trace takes unless eager rejects it: a trace the cache holds runs no eager
        planned = outcome.example = planned_example(shapes, not outcome.bound)
        key = outcome.trace_key = cached.trace_key(module, method, shapes, planned.args, planned.kwargs)
        if _served(cached, key, target, state, path, shapes, outcome):
            return outcome
    outcome.example = example_to_trace(getattr(module, method), shapes, not outcome.bound, outcome.notes)
    if cached is not None and planned is not None and call_structure(
            outcome.example.args, outcome.example.kwargs) != call_structure(planned.args, planned.kwargs):
        key = outcome.trace_key = cached.trace_key(module, method, shapes, outcome.example.args,
                                                   outcome.example.kwargs)
        if _served(cached, key, target, state, path, shapes, outcome):
            return outcome
    try:
        program, final, names = _traced(stages, exported, shapes, outcome, probe, patches, traces, learned)
        if target == Target.TORCH:
            outcome.dims = read_dims(final, outcome.example.inputs, program_shapes(program), names)
            _save_program(program, path.with_suffix(".pt2"), outcome)
            return outcome
        if target == Target.EXECUTORCH:
            outcome.dims = read_dims(final, outcome.example.inputs, program_shapes(program), names)
            to_executorch(stages, program, module, path, outcome, cached, state)
            return outcome
        traced_notes = list(outcome.notes)
        graph = _to_onnx(stages, program, names, path, outcome, cache, state)
        outcome.dims = _onnx_dims(final, path, outcome)
        if cache is not None:
            entry = replace(trace_entry(outcome, graph), notes=traced_notes)
            keep(outcome, cache, lambda: cache.store_trace(key, entry))
    except StageFailed:
        if cached is not None and outcome.stage != Stage.LOWER and (failed := _failed_entry(shapes, outcome)):
            keep(outcome, cached, lambda: cached.store_trace(outcome.trace_key, failed))
    return outcome


def _traced(
    stages: Stages, exported: torch.nn.Module, shapes: ShapeModel, outcome: ExportOutcome,
    probe: SizeProbe | None, patches: TracingPatches, traces: dict[str, Traced] | None, learned: LearnedDims | None,
) -> tuple[torch.export.ExportedProgram, ShapeModel, dict[str, str]]:
    """The program, the shape model it refined and its symbols' names: the program traced for
    another target under the same key, else traced here (and kept in ``traces``)."""
    known = traces.get(outcome.trace_key) if traces is not None and outcome.trace_key else None
    if known is not None:
        restore(known.entry, shapes, outcome)
        outcome.cache_hit, outcome.program, outcome.stage = False, known.program, Stage.TORCH_EXPORT
        outcome.notes = list(known.entry.notes)
        return known.program, outcome.shapes, known.names
    with stages.run(Stage.TORCH_EXPORT):
        traced = captured(exported, shapes, outcome, probe, patches, learned)
    refined = [*made_static(shapes, traced.shapes), *traced.splits]  # already in traced.shapes
    program, outcome.dims_form = traced.program, traced.form
    outcome.program = program
    outcome.outputs = [path or "output" for path in spec_paths(program.call_spec.out_spec)]
    final, names = _refine(traced.shapes, program_shapes(program), refined, outcome)
    outcome.output_elements = output_elements(program, names)
    if traces is not None and outcome.trace_key:
        traces[outcome.trace_key] = Traced(program, names, trace_entry(outcome))
    return program, final, names


def _served(
    cache: ExportCache, key: str, target: Target, state: dict[str, torch.Tensor], path: Path, shapes: ShapeModel,
    outcome: ExportOutcome,
) -> bool:
    """Whether the export cache serves the export under trace ``key`` (``outcome`` then set as the
    export would have it): the trace's ONNX graph or ``.pte`` file, or an earlier run's failure."""
    if target == Target.EXECUTORCH:
        return load_lowered(cache, key, state, path, shapes, outcome)
    return _load_traced(cache, key, state, path, shapes, outcome)


def _refine(
    shapes: ShapeModel, read: list[Shape], traced: list[Refinement], outcome: ExportOutcome,
) -> tuple[ShapeModel, dict[str, str]]:
    """The shape model refined from the program's input shapes (also ``outcome.shapes``), and
    the names of its symbols; ``outcome.refinements`` are the refinements tracing made (already
    in ``shapes``: dims made static, splits) and what the program proves."""
    assert outcome.example is not None
    inputs = outcome.example.inputs
    asserts = deferred_asserts(outcome.program)
    names, proved = refinements(shapes, inputs, read, asserts)
    shapes, notes = apply_refinements(shapes, proved)
    for var in shapes.variables:  # every other symbol of an input axis is named after its variable
        for leaf, dim in var.axes:
            if leaf in inputs:
                names.setdefault(str(read[inputs.index(leaf)][dim]), var.name)
    asserted = asserted_conditions(shapes, names, asserts)  # those the refined model does not imply
    shapes, more = apply_refinements(shapes, asserted)
    outcome.refinements = [*traced, *proved, *asserted]
    outcome.shapes = shapes
    outcome.notes.extend([*notes, *more])
    return shapes, names


def _save_program(program: torch.export.ExportedProgram, path: Path, outcome: ExportOutcome) -> None:
    """Save the program (``--export-target torch``'s artifact); one torch cannot serialize is a
    note, never a failure of the model."""
    with writing(Stage.TORCH_EXPORT, f"the exported program {path}"):
        path.parent.mkdir(parents=True, exist_ok=True)
        program.example_inputs = None  # a cache among them would need allow-listed classes to load
        try:
            torch.export.save(program, path)
        except OSError:
            raise
        except Exception as e:  # an operator torch.export.save does not serialize
            outcome.notes.append(f"the exported program was not saved ({error_line(e)})")
            return
    outcome.program_path = str(path)


def _to_onnx(
    stages: Stages, program: Any, names: dict[str, str], path: Path, outcome: ExportOutcome,
    cache: ExportCache | None, state: dict[str, torch.Tensor],
) -> str:
    """Decompose, translate, optimize, write and check ``path``; the key of the graph entry kept
    (``""`` without a cache).  A graph entry of the same traced program skips the first two.
    ``state`` is the exported module's, by the names of the program's weights."""
    key = ""
    if cache is not None:
        key = cache.graph_key(program, names, set(state))
        hit = cache.load_graph(key)
        if hit is not None and _place(hit, state, path, outcome):
            outcome.notes.append("the traced graph is one the export cache holds: decomposition and translation "
                                 "skipped")
            return key
    register_translations(custom_translations())
    first_note = len(outcome.notes)
    with stages.run(Stage.DECOMPOSE):
        prepared = decompose(program, outcome.notes)
    with stages.run(Stage.ONNX_TRANSLATE):
        onnx_program = translate(prepared, outcome.notes, traced=program)
        _reordered(outcome, output_order(program, onnx_program.exported_program))
        finish(onnx_program, names, path, set(state))
        weight_names = sorted(name for name in onnx_program.model.graph.initializers if name in state)
    with stages.run(Stage.ONNX_CHECKER):
        check_onnx(path, outcome)
    outcome.onnx_path = str(path)
    if cache is not None:
        entry = GraphEntry(outcome.opset, outcome.op_counts, outcome.notes[first_note:], weight_names, names,
                           outcome.output_order)
        keep(outcome, cache, lambda: cache.store_graph(key, path, entry))
    return key


def _place(hit: GraphHit, state: dict[str, torch.Tensor], path: Path, outcome: ExportOutcome) -> bool:
    """Write the cached graph to ``path`` with the weights of ``state`` over those it holds:
    when they differ, they are applied by name (a note says so, timed as translation).  ``False``
    when that fails (the graph is then exported)."""
    entry = hit.entry
    if any(name not in state for name in entry.weight_names):
        return False
    begin = time.perf_counter()
    try:
        changed = save_with_weights(hit.path, {name: state[name] for name in entry.weight_names}, path)
    except EnvironmentProblem:
        raise
    except Exception:
        return False
    if changed:
        outcome.timings[Stage.ONNX_TRANSLATE] = time.perf_counter() - begin
        outcome.notes.append("the weights differ from those of the cached graph: applied to it by name")
    outcome.opset, outcome.op_counts, outcome.onnx_path = entry.opset, entry.op_counts, str(path)
    outcome.output_order = entry.output_order
    outcome.notes.extend(note for note in entry.notes if note not in outcome.notes)
    return True


def _reordered(outcome: ExportOutcome, order: list[int]) -> None:
    """Keep the order of the ONNX file's outputs when it is not the traced program's (``order``
    not empty), with a note naming them as the file has them."""
    if not order:
        return
    outcome.output_order = order
    outcome.notes.append(
        "the ONNX file's outputs come in another order than the model's (torch's decomposition rebuilds its "
        f"output class in the order of its fields): {', '.join(outcome.outputs[i] for i in order)}; each is compared "
        "with the model's output of its name")


def _onnx_dims(shapes: ShapeModel, path: Path, outcome: ExportOutcome) -> dict[str, dict[str, str]]:
    """Dims of the ONNX file's inputs (the intended ones, with a note, if they cannot be matched)."""
    read = onnx_shapes(path)
    assert outcome.example is not None
    if len(read) != len(outcome.example.inputs):
        outcome.notes.append(
            f"the ONNX model has {len(read)} inputs for {len(outcome.example.inputs)} tensors: dims not read back"
        )
        return shapes.to_json()["dims"]
    return read_dims(shapes, outcome.example.inputs, read, {})


def _failed_entry(shapes: ShapeModel, outcome: ExportOutcome) -> TraceEntry | None:
    """The trace entry of a failed export of ``shapes``; ``None`` when the failure is not one
    to keep (a lack of memory) or the shape model it left cannot be restored from refinements."""
    assert outcome.kind is not None
    if outcome.error_type == "MemoryError":
        return None
    found = outcome.refinements or made_static(shapes, outcome.shapes)
    if apply_refinements(shapes, found)[0].to_json() != outcome.shapes.to_json():
        return None
    return replace(trace_entry(outcome, failure=failure_of(outcome)), refinements=found)


def _load_traced(
    cache: ExportCache, key: str, state: dict[str, torch.Tensor], path: Path, shapes: ShapeModel,
    outcome: ExportOutcome,
) -> bool:
    """Restore the outcome of an earlier export of the same trace: write its graph, or fail as
    it failed."""
    entry = cache.load_trace(key)
    if entry is not None and entry.failure is not None:
        failed_as_before(entry, entry.failure, shapes, outcome)
        return True
    hit = cache.load_graph(entry.graph) if entry is not None else None
    if entry is None or hit is None:
        return False
    notes, outcome.notes = outcome.notes, list(entry.notes)
    if not _place(hit, state, path, outcome):
        outcome.notes = notes
        return False
    outcome.stage = Stage.ONNX_CHECKER
    restore(entry, shapes, outcome)
    outcome.notes.append("export cache hit: torch.export and translation skipped")
    outcome.dims = _onnx_dims(outcome.shapes, path, outcome)
    return True


def prepare(targets: tuple[Target, ...], translating: bool = True) -> None:
    """Import what the first export imports and, when graphs are to be ``translating`` (not a
    rerun whose export cache holds the traces), build the torchlib registry with this
    package's translations and the decomposition table a program taken as traced is read
    with: once, before forked checks, which inherit them instead of each paying about 2 s for
    the registry and 0.07 s for the table (which a translation registered later builds again);
    they are part of the heap frozen while the checks run.  ExecuTorch's lowering and runtime
    are imported too when a target is ExecuTorch (about 3 s each child would pay)."""
    import_export_machinery()
    if Target.EXECUTORCH in targets:
        importlib.import_module("executorch.exir")
        importlib.import_module("executorch.backends.xnnpack.partition.xnnpack_partitioner")
        importlib.import_module("executorch.runtime")
    if Target.ONNX in targets:
        importlib.import_module("onnxruntime")
        if translating:
            register_translations(custom_translations())
            onnx_decompositions()
