"""What runs one exported graph on flat leaves for its check: onnxruntime (else onnx's reference
evaluator), torch's program, or ExecuTorch's runtime.  A runtime that cannot be opened ends the
check (:class:`GraphEnded`) with the stage, kind and reason a user reads."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..core.text import error_line
from ..core.vocabulary import Kind, Runtime, Stage, Target, Verdict
from ..shapes.model import ShapeModel
from .base.result import GraphResult
from .context import ModelContext
from .export.lowering import Delegation, UpperBound
from .export.outcome import ExportOutcome
from .verify.pte_runner import PteRunner, probe_run
from .verify.runtimes import NativeCrash, Unrunnable, onnx_runner, program_runner

GraphRunner = Callable[[Sequence[Any]], Sequence[Any]]  # runs the exported graph on flat leaves


class GraphEnded(Exception):
    """Raised by the stage that ends a graph's check, once it has set the result's stage, kind and
    reason (and its verdict when the graph is skipped rather than failed)."""


def open_runner(
    context: ModelContext, result: GraphResult, outcome: ExportOutcome, shapes: ShapeModel, calls: list[int],
    upper_bounds: dict[str, UpperBound], repro: Callable[[], None],
) -> GraphRunner:
    """What runs the graph exported for ``context.target``: onnxruntime, else onnx's reference
    evaluator (see :func:`~.verify.runtimes.onnx_runner`), torch's program, or ExecuTorch's
    runtime (see :func:`_pte_runner`).  The check ends when nothing here can (the graph is then
    skipped, kind ``runtime``: the export itself is fine), when onnxruntime crashed natively on
    it (probed in a process of its own: stage ``isolate``, kind ``crash``; ``repro`` written) or
    cannot load it."""
    target = context.target
    if target == Target.EXECUTORCH:
        return _pte_runner(context, result, outcome, shapes, calls, upper_bounds, repro)
    result.stage = Stage.ORT_LOAD if target == Target.ONNX else Stage.VERIFY
    begin = time.perf_counter()
    try:
        if target == Target.ONNX:
            path, dtype = Path(outcome.onnx_path), _float_dtype(context.module)
            runner: GraphRunner = context.quiet(lambda: onnx_runner(path, dtype, result.notes))
            result.runtime = runner.runtime  # type: ignore[attr-defined]  # an OnnxRunner or a ReferenceRunner
        else:
            runner = program_runner(outcome.program, shapes.aligned, constants=not outcome.bound)
            result.runtime = Runtime.PROGRAM
    except Unrunnable as gap:
        if gap.crash:
            repro()  # of stage ort-load
            result.stage, result.kind = Stage.ISOLATE, Kind.CRASH
            result.reason = f"{gap}: the session and the other models are intact; report it to onnxruntime"
        else:
            result.verdict, result.kind = Verdict.SKIPPED, Kind.RUNTIME
            result.reason = (f"{gap}: the ONNX was written and checked but cannot run here; verify the model in "
                             "float32, or with an execution provider that has the kernel")
        raise GraphEnded from gap
    except Exception as e:
        if not type(e).__module__.startswith("onnxruntime"):
            raise
        result.kind, result.reason = Kind.ERROR, f"onnxruntime cannot load the ONNX written: {error_line(e)}"
        raise GraphEnded from e
    finally:
        result.timings[result.stage] = time.perf_counter() - begin
    return runner


def _pte_runner(
    context: ModelContext, result: GraphResult, outcome: ExportOutcome, shapes: ShapeModel, calls: list[int],
    upper_bounds: dict[str, UpperBound], repro: Callable[[], None],
) -> GraphRunner:
    """ExecuTorch's runtime on the ``.pte`` file, once every recorded call is found within the
    upper bounds memory was planned for (a call beyond one fails the graph, kind
    ``specialized``).  The program is first loaded and run on one call in a forked process: a
    native crash there fails the graph (stage ``isolate``, kind ``crash``); a program the runtime
    cannot load fails it (stage ``run``)."""
    result.stage, result.runtime = Stage.RUN, Runtime.EXECUTORCH
    beyond = _beyond_bound(context, shapes, calls, upper_bounds)
    if beyond:
        result.kind, result.reason = Kind.SPECIALIZED, beyond
        raise GraphEnded
    begin = time.perf_counter()
    bounds = {leaf: {dim: (name, upper_bounds[name].size) for dim, name in axes.items() if name in upper_bounds}
              for leaf, axes in enumerate(shapes.leaf_axes())}
    path, mutated = Path(outcome.pte_path), Delegation.from_json(outcome.delegation).mutated_inputs
    try:
        context.quiet(lambda: probe_run(path, shapes.call_leaves(0)))
        return context.quiet(lambda: PteRunner(path, bounds, mutated))
    except NativeCrash as crash:
        repro()
        result.stage, result.kind = Stage.ISOLATE, Kind.CRASH
        result.reason = (f"ExecuTorch's runtime crashed natively ({crash}) loading or running the program, in a "
                         "process of its own: the session and the other models are intact; report it to ExecuTorch")
        raise GraphEnded from crash
    except RuntimeError as e:  # an error code of the runtime: an operator its kernels lack...
        result.kind, result.reason = Kind.ERROR, f"ExecuTorch's runtime cannot load the program: {error_line(e)}"
        raise GraphEnded from e
    finally:
        result.timings[Stage.RUN] = time.perf_counter() - begin


def _beyond_bound(context: ModelContext, shapes: ShapeModel, calls: list[int],
                  upper_bounds: dict[str, UpperBound]) -> str:
    """The first recorded call with a size beyond the upper bound its variable's memory is
    planned for, said as a reason; ``""`` when every call is within its bounds."""
    for var in shapes.variables:
        bound = upper_bounds.get(var.name)
        beyond = [(index, size) for index, size in enumerate(var.values) if bound and (size or 0) > bound.size]
        if bound and beyond:
            index, size = beyond[0]
            source = context.observations[calls[index]].source or "recorded call"
            return (f"call {context.ids[calls[index]]} from {source}: {var.name} = {size} is beyond the upper bound "
                    f"{bound.size} ExecuTorch plans memory for ({bound.source})")
    return ""


def _float_dtype(module: torch.nn.Module) -> torch.dtype | None:
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), None)
