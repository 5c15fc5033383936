"""Export one module to ONNX through explicit, separately timed stages.

``torch.export`` → decompositions → ONNX translation → ``onnx.checker`` (ORT loading is the
verifier's first step).  Every failure becomes an :class:`ExportOutcome` naming the stage, the
kind and a one-line reason; nothing raises.  The shape model is refined with what torch proved,
and the dims reported are read back from the file written.  An :class:`~.cache.ExportCache`
skips capture and translation when nothing that matters changed.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..compat.torch_private import (
    guards_on_data,
    import_export_machinery,
    onnx_registry,
    prepare_for_onnx,
    register_translations,
    rename_onnx_axes,
    to_onnx_program,
    unchecked_module,
)
from ..compat.torch_text import translated_op
from ..core.text import error_line
from ..core.trees import detached_clone, flat_outputs, spec_paths
from ..core.vocabulary import Kind, Stage
from ..shapes.model import ShapeModel
from .bound import bind_constants
from .cache import CacheEntry, ExportCache
from .decompositions import UNGUARDED_CROSS_ENTROPY
from .domain import (
    Refinement,
    Shape,
    apply_refinements,
    asserted_conditions,
    deferred_asserts,
    onnx_shapes,
    program_shapes,
    read_dims,
    refinements,
)
from .environment import EnvironmentProblem, writing
from .examples import example_to_trace, other_examples
from .patches import NO_PATCHES, TracingPatches
from .probe import SizeProbe
from .reasons import one_line_reason
from .result import ExportFiles
from .tracing import Capture, Example, Specialized, Traced, trace
from .translations import custom_translations
from .verify import Tolerance, compare

MAX_DECOMPOSED = 6  # ops decomposed, one after the other, when their translation to ONNX fails

@dataclass
class ExportOutcome(ExportFiles):
    """Result of the export stages, with the files they wrote; ``stage`` is the failing stage,
    or the last one done.

    ``kind`` of a failure: ``error`` (an exception) or ``specialized`` (a dynamic dim became a
    constant).  ``dims`` are read back from the file written (the program with target torch).
    """

    ok: bool
    stage: Stage
    shapes: ShapeModel  # the shape model, as far as the export refined it
    kind: Kind | str = ""
    error_type: str = ""
    reason: str = ""
    traceback: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    program: Any = None
    bound: bool = False  # the exported module is a BoundConstants: its inputs are tensors only
    example: Example | None = None
    dims: dict[str, dict[str, str]] = field(default_factory=dict)
    refinements: list[Refinement] = field(default_factory=list)  # what the export established
    outputs: list[str] = field(default_factory=list)  # names of the graph's outputs


class StageFailed(Exception):
    """Raised inside :class:`Stages` to stop at the failing stage."""


class Stages:
    """Times named stages and turns the first exception into a failing outcome."""

    def __init__(self, outcome: ExportOutcome):
        self.outcome = outcome

    @contextlib.contextmanager
    def run(self, name: Stage) -> Iterator[None]:
        self.outcome.stage = name
        begin = time.perf_counter()
        try:
            yield
        except EnvironmentProblem:
            raise  # the machine's, not a failure of the stage
        except Exception as e:
            self.outcome.ok = False
            self.outcome.kind = Kind.SPECIALIZED if isinstance(e, Specialized) else Kind.ERROR
            self.outcome.error_type = type(e).__name__
            self.outcome.reason = str(e) if isinstance(e, Specialized) else one_line_reason(name, e)
            self.outcome.traceback = "".join(traceback.format_exception(e))
            raise StageFailed(name) from e
        finally:
            self.outcome.timings[name] = self.outcome.timings.get(name, 0.0) + time.perf_counter() - begin


def export_model(
    module: torch.nn.Module, shapes: ShapeModel, target: str, onnx_path: Path,
    cache: ExportCache | None = None, method: str = "forward", probe: SizeProbe | None = None,
    patches: TracingPatches = NO_PATCHES,
) -> ExportOutcome:
    """Export ``module.<method>`` called on ``shapes``' example inputs with its dynamic dimensions,
    torch.export running under ``patches``; ``target`` ``onnx`` translates and writes
    ``onnx_path``, ``torch`` stops after torch.export.  The shape model is refined with what torch
    proved (equal dims, multiples of 2...).  The ``probe`` runs eager at sizes torch's bounds
    exclude (``None``: bounds are not checked)."""
    outcome = ExportOutcome(ok=True, stage=Stage.TORCH_EXPORT, shapes=shapes)
    stages = Stages(outcome)
    exported = bind_constants(module, method, shapes.aligned)
    outcome.bound = exported is not module
    outcome.example = example_to_trace(getattr(module, method), shapes, not outcome.bound, outcome.notes)
    key = None
    if target == "onnx" and cache is not None:
        key = cache.key(module, method, shapes, outcome.example.args, outcome.example.kwargs)
        if _load_cached(cache, key, onnx_path, shapes, outcome):
            return outcome
    try:
        with stages.run(Stage.TORCH_EXPORT):
            traced = _trace(exported, shapes, outcome, probe, patches)
        program, outcome.dims_form, shapes = traced.program, traced.form, traced.shapes
        outcome.program = program
        outcome.outputs = [path or "output" for path in spec_paths(program.call_spec.out_spec)]
        shapes, names = _refine(shapes, program_shapes(program), traced.splits, outcome)
        if target == "torch":
            outcome.dims = read_dims(shapes, outcome.example.inputs, program_shapes(program), names)
            _save_program(program, onnx_path.with_suffix(".pt2"), outcome)
            return outcome
        _to_onnx(stages, program, names, onnx_path, outcome)
        outcome.dims = _onnx_dims(shapes, onnx_path, outcome)
        if cache is not None and key is not None:
            _store_cached(cache, key, onnx_path, outcome)
    except StageFailed:
        pass
    return outcome


def _store_cached(cache: ExportCache, key: str, onnx_path: Path, outcome: ExportOutcome) -> None:
    """Keep the export for the next run; a cache that cannot be written costs that run its speed,
    not this model its verdict (a note)."""
    entry = CacheEntry(outcome.opset, outcome.op_counts, outcome.notes, outcome.refinements, outcome.outputs)
    try:
        cache.store(key, onnx_path, entry)
    except OSError as e:
        outcome.notes.append(f"the export cache {cache.directory} cannot be written ({e}): the next run exports again")


def _trace(
    module: torch.nn.Module, shapes: ShapeModel, outcome: ExportOutcome, probe: SizeProbe | None,
    patches: TracingPatches,
) -> Traced:
    """:func:`_trace_pinned` captured non-strict; when that fails with an error (not a dim torch
    pins), captured strict, as torch.onnx.export falls back to: TorchDynamo takes some Python
    the non-strict capture cannot (``int(lengths.max().item())``), and the graph is verified as
    any other.  The non-strict error stands when the strict capture fails too."""
    try:
        return _trace_pinned(module, shapes, outcome, probe, Capture(patches))
    except (Specialized, EnvironmentProblem):
        raise
    except Exception as error:
        notes = list(outcome.notes)
        try:
            traced = _trace_pinned(module, outcome.shapes, outcome, probe, Capture(patches, strict=True))
        except Exception:
            outcome.notes[:] = notes
            raise error from None
        outcome.notes.append(f"captured by torch.export(strict=True), torch.onnx.export's fallback: the non-strict "
                             f"capture failed ({error_line(error)})")
        return traced


def _trace_pinned(
    module: torch.nn.Module, shapes: ShapeModel, outcome: ExportOutcome, probe: SizeProbe | None, capture: Capture,
) -> Traced:
    """:func:`~.tracing.trace` on the example; when torch pins a dim at the size the example
    happens to have (a size the model treats specially: DINOv2 skips its position interpolation
    at the config's image size), traced again on recorded calls of other sizes, then on inputs
    synthesized at another size, before failing.  ``outcome.shapes`` follows the refinements
    made on the way, a failure's included."""
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
                found = trace(module, shapes, example, not outcome.bound, outcome.notes, probe, capture)
            except Specialized as again:
                outcome.shapes = shapes = again.shapes
                continue
            if not _reproduces(found.program, module, outcome.example):
                break  # the size is special for the model, not only for the trace: the pin stands
            outcome.example = example
            outcome.notes.append(f"traced on {what}: on the first example torch pinned {pinned}")
            return found
        raise


def _reproduces(program: torch.export.ExportedProgram, module: torch.nn.Module, example: Example) -> bool:
    """Whether a program traced elsewhere gives eager's outputs on ``example`` (the pinned size),
    run as the ONNX graph will run it: without the runtime asserts of the branch it took."""
    graph_module = unchecked_module(program)
    args, kwargs = detached_clone((example.args, example.kwargs))
    try:
        with torch.no_grad():
            expected = flat_outputs(module(*args, **kwargs))
            args, kwargs = detached_clone((example.args, example.kwargs))
            actual = flat_outputs(graph_module(*args, **kwargs))
    except Exception:  # the program rejects the size, or the model's own call fails there
        return False
    return compare(actual, expected, Tolerance()).ok


def _refine(
    shapes: ShapeModel, read: list[Shape], splits: list[Refinement], outcome: ExportOutcome,
) -> tuple[ShapeModel, dict[str, str]]:
    """The shape model refined from the program's input shapes (also ``outcome.shapes``), and
    the names of its symbols; ``outcome.refinements`` are the ``splits`` tracing made (already in
    ``shapes``) and what the program proves."""
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
    outcome.refinements = [*splits, *proved, *asserted]
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


def _to_onnx(stages: Stages, program: Any, names: dict[str, str], path: Path, outcome: ExportOutcome) -> None:
    register_translations(custom_translations())
    with stages.run(Stage.DECOMPOSE):
        program = _decompose(program, outcome.notes)
    with stages.run(Stage.ONNX_TRANSLATE):
        onnx_program = _translate_decomposing(program, outcome.notes)
        if names:  # ONNXProgram.rename_axes does the same from torch 2.11 on
            rename_onnx_axes(onnx_program.model, names)
        with writing(Stage.ONNX_TRANSLATE, f"the ONNX file {path}"):
            path.parent.mkdir(parents=True, exist_ok=True)
            onnx_program.save(str(path))
    with stages.run(Stage.ONNX_CHECKER):
        _check_onnx(path, outcome)
    outcome.onnx_path = str(path)


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


def _load_cached(cache: ExportCache, key: str, path: Path, shapes: ShapeModel, outcome: ExportOutcome) -> bool:
    entry = cache.load(key, path)
    if entry is None:
        return False
    outcome.stage, outcome.cache_hit, outcome.onnx_path = Stage.ONNX_CHECKER, True, str(path)
    outcome.opset, outcome.op_counts, outcome.refinements = entry.opset, entry.op_counts, entry.refinements
    outcome.outputs = entry.outputs
    outcome.shapes, _ = apply_refinements(shapes, entry.refinements)
    outcome.notes = [*entry.notes, "export cache hit: torch.export and translation skipped"]
    outcome.dims = _onnx_dims(outcome.shapes, path, outcome)
    return True


def prepare(target: str) -> None:
    """Import what the first export imports and build the torchlib registry, once, before the
    checks: checks forked from this process inherit them instead of each paying about 2 s for
    them, and they are part of the heap frozen while the checks run."""
    import_export_machinery()
    if target == "onnx":
        importlib.import_module("onnxruntime")
        onnx_registry()


def _decompose(program: torch.export.ExportedProgram, notes: list[str]) -> torch.export.ExportedProgram:
    """torch.onnx's preparation, then the nodes left without users removed: it drops the runtime
    asserts but not what only they read (transformers' ``torch_compilable_check`` of a tensor
    condition leaves ``_is_all_true``, which has no ONNX translation).  A loss over a
    data-dependent number of targets, which torch's decomposition cannot take, is decomposed
    with :data:`~.decompositions.UNGUARDED_CROSS_ENTROPY` first (and a note says so)."""
    try:
        program = prepare_for_onnx(program)
    except Exception as e:
        if not guards_on_data(e, "nll_loss"):
            raise
        program = prepare_for_onnx(program.run_decompositions(UNGUARDED_CROSS_ENTROPY))
        notes.append("cross_entropy_loss decomposed into _log_softmax and nll_loss_forward: torch's own"
                     " decomposition guards on its data-dependent number of targets")
    if program.graph_module.graph.eliminate_dead_code():
        program.graph_module.recompile()
    return program


def _translate(program: torch.export.ExportedProgram) -> Any:
    onnx_program = to_onnx_program(program)
    onnx_program.optimize()
    return onnx_program


def _translate_decomposing(program: torch.export.ExportedProgram, notes: list[str]) -> Any:
    """:func:`_translate`; when the translation of an op fails (torchlib's ``cross_entropy_loss``
    with a symbolic ``ignore_index``, as BERT's question-answering head passes), that op is
    decomposed with torch's default decomposition and the program translated again."""
    decomposed: list[str] = []
    table = torch.export.default_decompositions()
    for _ in range(MAX_DECOMPOSED):
        try:
            onnx_program = _translate(program)
        except Exception as e:
            op = _failing_op(e)
            if op is None or op not in table:
                raise
            decomposed.append(str(op))
            program = _decompose(program.run_decompositions({op: table[op]}), notes)
            continue
        if decomposed:
            notes.append(f"translated after decomposing {', '.join(decomposed)}: torch's ONNX translation failed on it")
        return onnx_program
    return _translate(program)


def _failing_op(error: BaseException) -> Any:
    """The op (``torch.ops.aten.nll_loss_nd.default``) of the node whose translation failed."""
    found = translated_op(f"{error} {error.__cause__}")
    if found is None:
        return None
    ops: Any = torch.ops
    return functools.reduce(lambda obj, name: getattr(obj, name, None), found.split("."), ops)


def _check_onnx(path: Path, outcome: ExportOutcome) -> None:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    onnx.checker.check_model(str(path))
    outcome.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    outcome.op_counts = dict(sorted(Counter(n.op_type for n in model.graph.node).items()))
