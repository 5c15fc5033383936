"""What a failing graph's result gets besides its verdict: why its outputs differ (an export patch
under which eager changes, else the first ONNX node beyond tolerance) and a self-contained repro."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.vocabulary import Runtime, Target
from ..shapes.model import ShapeModel
from .base.result import GraphResult
from .context import ModelContext
from .explore.localize import localize_call
from .export.capturing import traced_program
from .export.lowering import Delegation, UpperBound, lower, symbol_maxima
from .export.tracing import Capture
from .repro import write_repro
from .verify.compare import Discrepancy, OutputLayout, compare
from .verify.pte_runner import PteRunner

# a model checked for several targets keeps one repro per target
_REPRO_DIRECTORIES = {Target.ONNX: "repro", Target.TORCH: "repro", Target.EXECUTORCH: "repro-executorch"}


@dataclass
class Diagnosis:
    """The diagnosis of one graph's failure, written into its ``result`` (files under ``directory``);
    ``capture``: how torch.export captured the graph's program, once the export was tried."""

    context: ModelContext
    result: GraphResult
    directory: Path
    capture: Capture | None = None

    def explain(self, shapes: ShapeModel, program: torch.export.ExportedProgram | None, layout: OutputLayout,
                leaves: list[Any], expected: Sequence[Any], values: bool) -> None:
        """Why the graph's outputs on ``leaves`` differ from ``expected`` (eager as the tests ran
        it), added to the reason: an export patch under which eager no longer gives them (the
        graph, traced under it, follows the patched model), else for differing ``values`` the
        node they come from (:meth:`_localize`; ``program`` as traced, ``None`` when the export
        cache served the graph; ``layout`` the graph's outputs)."""
        context = self.context
        patch = context.quiet(lambda: context.patches.changing_outputs(
            context.eager(shapes), leaves, expected, context.tolerance))
        if patch:
            self.result.reason += (f": the export patch {patch} changes what the model computes here (eager under "
                                   "it differs from eager as the tests ran it), and the graph, traced under it, "
                                   "follows the patched model")
        elif values and context.target == Target.EXECUTORCH:
            self._undelegated(shapes, program, leaves, layout.in_graph_order(expected))
        elif values:
            self._localize(shapes, program, leaves, layout.in_graph_order(expected))

    def _undelegated(self, shapes: ShapeModel, program: torch.export.ExportedProgram | None, leaves: list[Any],
                     expected: Sequence[Any]) -> None:
        """Whether a mismatch of the ``.pte`` on ``leaves`` is the XNNPACK delegate's: the same
        program lowered without it (every op on ExecuTorch's portable kernels) is run on the call
        and compared with ``expected``; one sentence added to the reason.  Never the verdict."""
        context, result = self.context, self.result
        begin = time.perf_counter()

        def portable() -> Discrepancy:
            traced = self._program(shapes, program)
            bounds = {name: UpperBound.from_json(bound) for name, bound in result.upper_bounds.items()}
            inputs = [shapes.aligned.leaf_names.index(name) for name in result.inputs]
            path = self.directory / "portable.pte"
            lowered = lower(traced, symbol_maxima(traced, shapes, inputs, bounds), path, delegate=False)
            return compare(PteRunner(path, mutated_inputs=lowered.mutated_inputs)(leaves), expected, context.tolerance)

        try:
            found = context.quiet(portable)
        except Exception as e:  # a diagnosis never hides the verdict
            result.notes.append(f"not lowered again without the delegate: {type(e).__name__}: {e}")
            return
        finally:
            result.timings["undelegated"] = time.perf_counter() - begin
        taken = Delegation.from_json(result.delegation).taken_text() if result.delegation else ""
        if found.ok:
            result.reason += (f"; without the XNNPACK delegate (ExecuTorch's portable kernels) the same program is "
                              f"within tolerance (max |Δ| {found.max_abs:.3g}): the delegate computes differently "
                              f"here{f' (it took {taken})' if taken else ''}")
        else:
            result.reason += (f"; without the XNNPACK delegate the program is off too (max |Δ| {found.max_abs:.3g}): "
                              "not the delegate's")

    def _localize(self, shapes: ShapeModel, program: torch.export.ExportedProgram | None, leaves: list[Any],
                  expected: Sequence[Any]) -> None:
        """Name the node a mismatch of the ONNX graph on ``leaves`` comes from (``expected``, the
        graph's outputs as eager gives them; see
        :mod:`.explore.localize`; a graph from the export cache is traced again for it): one line
        added to the reason, the nodes kept for the reports.  Never the verdict."""
        context, result = self.context, self.result
        if context.target != Target.ONNX or not result.onnx_path:
            return
        begin = time.perf_counter()

        def traced() -> torch.export.ExportedProgram:
            return self._program(shapes, program)

        found = context.quiet(lambda: localize_call(traced, result.onnx_path, leaves, context.tolerance,
                                                    Runtime(result.runtime), expected))
        result.timings["localize"] = time.perf_counter() - begin
        result.localization, result.reason = found.to_json(), f"{result.reason}; {found.summary()}"

    def _program(self, shapes: ShapeModel,
                 program: torch.export.ExportedProgram | None) -> torch.export.ExportedProgram:
        """The graph's program as traced, traced again when the export cache served the graph (``None``)."""
        context = self.context
        return program if program is not None else traced_program(
            context.module, shapes, context.method, context.patches, self.capture)

    def repro(self, shapes: ShapeModel, leaves: list[Any] | None = None) -> None:
        """Write the self-contained repro of a failure on ``leaves`` (by default the richest
        recorded call's); a failure to write it is only a note."""
        result, context = self.result, self.context
        if leaves is None:
            leaves = shapes.call_leaves(shapes.aligned.complete_call())
        try:
            repro = write_repro(
                self.directory / _REPRO_DIRECTORIES[context.target], context.module, shapes, leaves,
                stage=result.stage, target=context.target, method=context.method,
                atol=context.tolerance.atol, rtol=context.tolerance.rtol, capture=self.capture,
                upper_bounds={name: bound["max"] for name, bound in result.upper_bounds.items()},
            )
        except Exception as e:  # a repro is a convenience: never let it hide the verdict
            result.notes.append(f"no repro written: {type(e).__name__}: {e}")
            return
        result.repro_path = repro.path
        if repro.note:
            result.notes.append(repro.note)
