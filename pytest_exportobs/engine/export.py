"""Export one module to ONNX through explicit, separately timed stages.

``torch.export`` → decompositions → ONNX translation → ``onnx.checker`` (ORT loading is the
verifier's first step).  Every failure becomes an :class:`ExportOutcome` naming the stage, the
exception type and a one-line reason; nothing raises.  An :class:`~.cache.ExportCache` skips
capture and translation when nothing that matters changed.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..core.text import first_line
from ..core.trees import detached_clone
from ..shapes.model import ShapeModel
from ..shapes.synthesis import example_leaves
from .cache import CacheEntry, ExportCache
from .reasons import one_line_reason


@dataclass
class ExportOutcome:
    """Result of the export stages; ``stage`` is the failing stage, or the last one done."""

    ok: bool
    stage: str
    error_type: str = ""
    reason: str = ""
    traceback: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    program: Any = None
    onnx_path: str = ""
    cache_hit: bool = False
    opset: int | None = None
    op_counts: dict[str, int] = field(default_factory=dict)
    bound: bool = False  # the exported module is a BoundConstants: its inputs are tensors only
    equalities: list[tuple[str, str]] = field(default_factory=list)  # dims torch found equal


class StageFailed(Exception):
    """Raised inside :class:`Stages` to stop at the failing stage."""


class Stages:
    """Times named stages and turns the first exception into a failing outcome."""

    def __init__(self, outcome: ExportOutcome):
        self.outcome = outcome

    @contextlib.contextmanager
    def run(self, name: str) -> Iterator[None]:
        self.outcome.stage = name
        begin = time.perf_counter()
        try:
            yield
        except Exception as e:
            self.outcome.ok = False
            self.outcome.error_type = type(e).__name__
            self.outcome.reason = one_line_reason(name, e)
            self.outcome.traceback = "".join(traceback.format_exception(e))
            raise StageFailed(name) from e
        finally:
            self.outcome.timings[name] = self.outcome.timings.get(name, 0.0) + time.perf_counter() - begin


def export_model(
    module: torch.nn.Module, shapes: ShapeModel, target: str, onnx_path: Path,
    cache: ExportCache | None = None, method: str = "forward",
) -> ExportOutcome:
    """Export ``module.<method>`` called on ``shapes``' example inputs with its dynamic dimensions;
    ``target`` ``onnx`` translates and writes ``onnx_path``, ``torch`` stops after torch.export."""
    outcome = ExportOutcome(ok=True, stage="torch.export")
    stages = Stages(outcome)
    exported = bind_constants(module, method, shapes.aligned)
    outcome.bound = exported is not module
    leaves, small = _example(getattr(module, method), shapes, outcome)
    args, kwargs = shapes.aligned.split_arguments(leaves, constants=not outcome.bound)
    key = None
    if target == "onnx" and cache is not None:
        key = cache.key(module, shapes, args, kwargs)
        if _load_cached(cache, key, onnx_path, outcome):
            return outcome
    try:
        with stages.run("torch.export"):
            program = _torch_export(exported, shapes, args, kwargs, small, outcome)
        outcome.program = program
        if target == "torch":
            return outcome
        with stages.run("decompose"):
            program = _decompose(program)
        with stages.run("onnx-translate"):
            onnx_program = _translate(program)
            _rename_axes(onnx_program, shapes)
            onnx_path.parent.mkdir(parents=True, exist_ok=True)
            onnx_program.save(str(onnx_path))
        with stages.run("onnx-checker"):
            _check_onnx(onnx_path, outcome)
        outcome.onnx_path = str(onnx_path)
        if key is not None:
            cache.store(key, onnx_path, CacheEntry(outcome.opset, outcome.op_counts, outcome.notes, outcome.equalities))
    except StageFailed:
        pass
    return outcome


def _load_cached(cache: ExportCache, key: str, onnx_path: Path, outcome: ExportOutcome) -> bool:
    entry = cache.load(key, onnx_path)
    if entry is None:
        return False
    outcome.stage, outcome.cache_hit, outcome.onnx_path = "onnx-checker", True, str(onnx_path)
    outcome.opset, outcome.op_counts, outcome.equalities = entry.opset, entry.op_counts, entry.equalities
    outcome.notes = [*entry.notes, "export cache hit: torch.export and translation skipped"]
    return True


class BoundConstants(torch.nn.Module):
    """``module.<method>`` with the calls' constant arguments bound: torch.export then sees tensor
    inputs only, under a plain signature (it cannot take a constant collected by ``**kwargs``,
    as transformers' ``return_dict``)."""

    def __init__(self, module: torch.nn.Module, method: str, constants: dict[str, Any]):
        super().__init__()
        self.module = module
        self.method = method
        self.constants = constants

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.module, self.method)(*args, **kwargs, **self.constants)


def bind_constants(module: torch.nn.Module, method: str, aligned: Any) -> torch.nn.Module:
    """``module`` itself when its ``forward`` takes the recorded tensors as they are, else a
    :class:`BoundConstants` whose ``forward`` signature names the tensor arguments."""
    if method == "forward" and not aligned.constants() and not any(s.var_keyword for s in aligned.slots):
        return module
    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    for slot in aligned.slots:
        if slot.is_constant:
            continue
        if slot.var_positional:
            parameters.append(inspect.Parameter(slot.name, inspect.Parameter.VAR_POSITIONAL))
            kind = inspect.Parameter.KEYWORD_ONLY
        else:
            parameters.append(inspect.Parameter(slot.name, kind))

    def forward(self: BoundConstants, *args: Any, **kwargs: Any) -> Any:
        return BoundConstants.forward(self, *args, **kwargs)

    forward.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    bound_class = type(f"Bound{type(module).__name__}", (BoundConstants,), {"forward": forward})
    return bound_class(module, method, aligned.constants())


def _example(call: Any, shapes: ShapeModel, outcome: ExportOutcome) -> tuple[list[Any], list[str]]:
    """Example leaves and the dims that are still 0 or 1 in them.

    A recorded call with every dynamic size >= 2, else synthesized inputs (checked by running
    the module eagerly), else the richest recorded call, exported size-oblivious.
    """
    index = shapes.safe_call()
    if index is None:
        leaves = example_leaves(shapes)
        args, kwargs = detached_clone(shapes.aligned.split_arguments(leaves))  # the call grows caches in place
        try:
            with torch.no_grad():
                call(*args, **kwargs)
        except Exception as e:
            outcome.notes.append(f"synthesized example rejected by eager ({type(e).__name__}); using a recorded call")
        else:
            outcome.notes.append("no recorded call has every dynamic size >= 2: exported on synthesized inputs")
            return leaves, []
        index = shapes.aligned.complete_call()
    small = shapes.small_variables(index)
    if small:
        outcome.notes.append(f"dims {', '.join(small)} are 0 or 1 in the example: exported size-oblivious")
    return shapes.call_leaves(index), small


def _torch_export(
    module: torch.nn.Module, shapes: ShapeModel, args: tuple, kwargs: dict, small: list[str], outcome: ExportOutcome
) -> torch.export.ExportedProgram:
    """``torch.export.export`` with named dims; falls back to independent ``Dim.DYNAMIC`` when
    torch rejects a relation, and captures size-oblivious when a dynamic size is 0 or 1."""
    config = (
        torch.fx.experimental._config.patch(backed_size_oblivious=True) if small else contextlib.nullcontext()
    )
    constants = not isinstance(module, BoundConstants)
    named = shapes.to_dynamic_shapes(named=True, constants=constants)
    with config:
        try:
            return torch.export.export(module, args, kwargs, dynamic_shapes=named)
        except torch._dynamo.exc.UserError as e:
            if "Constraints violated" not in str(e):
                raise
            rejection = e
        try:  # torch's suggested fixes: derived dims (total = past + seq), ranges (seq <= 128)
            refined = torch.export.dynamic_shapes.refine_dynamic_shapes_from_suggested_fixes(rejection.msg, named)
            program = torch.export.export(module, args, kwargs, dynamic_shapes=refined)
        except Exception:
            outcome.notes.append(
                f"torch.export rejected the named dims ({first_line(str(rejection))}): "
                "exported with independent Dim.DYNAMIC dims"
            )
            return torch.export.export(module, args, kwargs, dynamic_shapes=shapes.to_dynamic_shapes(constants=constants))
        fixes = _suggested_fixes(rejection.msg)
        outcome.notes.append(f"named dims refined with torch's suggested fixes: {'; '.join(fixes) or 'none listed'}")
        outcome.equalities = [
            (left.strip(), right.strip()) for left, _, right in (fix.partition("=") for fix in fixes)
            if right.strip().isidentifier()
        ]
        return program


def _suggested_fixes(message: str) -> list[str]:
    """The ``name = expression`` lines torch suggests after 'Suggested fixes:'."""
    fixes = message.partition("Suggested fixes:")[2]
    return [line.strip() for line in fixes.splitlines() if "=" in line]


# The two steps ``torch.onnx.export(exported_program)`` runs, called apart so that each is timed
# and reported on its own, with one torchlib registry per process.
@functools.cache
def _registry() -> Any:
    from torch.onnx._internal.exporter import _registration

    return _registration.ONNXRegistry.from_torchlib()


def _decompose(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    from torch.onnx._internal.exporter import _core

    return _core._prepare_exported_program_for_export(program, registry=_registry())


def _translate(program: torch.export.ExportedProgram) -> Any:
    from torch.onnx._internal.exporter import _core

    onnx_program = _core._exported_program_to_onnx_program(program, registry=_registry())
    onnx_program.optimize()
    return onnx_program


def _rename_axes(onnx_program: Any, shapes: ShapeModel) -> None:
    """Name the symbolic dims of the ONNX inputs (and through them the outputs) after the variables."""
    inputs = onnx_program.model.graph.inputs
    tensor_axes = [
        axes for axes, value in zip(shapes.leaf_axes(), shapes.aligned.calls[shapes.aligned.complete_call()])
        if value is None or isinstance(value, torch.Tensor)
    ]
    mapping: dict[str, str] = {}
    for value, axes in zip(inputs, tensor_axes):
        for dim, name in axes.items():
            symbol = value.shape[dim] if value.shape is not None else None
            if symbol is not None and not isinstance(symbol, int) and str(symbol) not in mapping:
                mapping.setdefault(str(symbol), name)
    if mapping:
        onnx_program.rename_axes(mapping)


def _check_onnx(path: Path, outcome: ExportOutcome) -> None:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    onnx.checker.check_model(str(path))
    outcome.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    outcome.op_counts = dict(sorted(Counter(n.op_type for n in model.graph.node).items()))
