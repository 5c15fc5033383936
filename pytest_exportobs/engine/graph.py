"""One exported graph of a model: probe the unvaried dims, export, verify its calls, explore.

:class:`GraphCheck` fills a :class:`~.base.result.GraphResult`.  Calls that ran on stand-ins for
absent arguments and that the graph does not reproduce are handed back (``split``): they need
a graph of their own, they do not fail this one.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ..core.files import file_digest
from ..core.trees import detached_clone
from ..core.vocabulary import Kind, Runtime, Stage, Target, Verdict
from ..observe.binding import value_text
from ..shapes.model import ShapeModel
from .base.environment import writing
from .base.origins import failure_line
from .base.result import GraphResult
from .context import ModelContext
from .diagnosis import Diagnosis
from .explore.variations import VariationOutcome, explore
from .export.cache import ExportCache
from .export.domain import conditions, expression, satisfied
from .export.lowering import Delegation, UpperBound, bounds_note
from .export.outcome import ExportOutcome
from .export.pipeline import export_model
from .export.probe import SizeProbe, probed_unvaried_dims
from .graph_runtime import GraphEnded, GraphRunner, open_runner
from .guesses import Refine, kept_static, moved_guesses, stepped
from .planning import GraphPlan, choice
from .verify.compare import Discrepancy, OutputLayout, float64_note, padded_note, verify_calls
from .verify.references import Reproduction, refreshed, reproduction

_FILES = {Target.ONNX: "model.onnx", Target.EXECUTORCH: "model.pte", Target.TORCH: "model.pt2"}
VERIFIED_NOTE = ("verified as on an earlier check: the same ONNX file, runtime, inputs and references passed there "
                 "(the export cache holds the comparisons), not run again")


class GraphCheck:
    """Export and verify one :class:`GraphPlan` on its projected shape model."""

    def __init__(self, context: ModelContext, plan: GraphPlan, shapes: ShapeModel, directory: Path):
        self.context, self.plan, self.shapes, self.directory = context, plan, shapes, directory
        self.result = GraphResult(name=plan.name, calls=list(plan.calls), constants=_json_native(plan.constants))
        self.runner: GraphRunner | None = None
        self.layout = OutputLayout()
        self.split: list[int] = []  # model call indices to move to a graph of their own
        self.apart = ""  # the sizes of calls split off because a restriction excludes them
        self.asserted: list[Any] = []  # conditions on sizes the program asserts, the ONNX file does not check
        self.output_elements: Any = None  # how many elements the outputs hold, by the variables (None: unknown)
        self.program: torch.export.ExportedProgram | None = None  # as traced (None: from the export cache)
        self.graph_file: Path | None = None  # the ONNX file the runner runs
        self._graph_digest = ""
        self.upper_bounds: dict[str, UpperBound] = {}  # of the variables, where the target plans memory for them
        self.diagnosis = Diagnosis(context, self.result, directory)
        # a choice of structure torch restricts (see planning.by_choice): the plan is planned again by it
        self.choice, self.why = "", ""
        self.result.notes.extend([plan.why] if plan.why else [])

    def run(self) -> GraphResult:
        """The stages in order: the first that ends the check (:class:`GraphEnded`) leaves the
        result as it set it; past the last one the graph passes."""
        try:
            self._stages()
        except GraphEnded:
            return self.result
        self.result.verdict = Verdict.PASSED
        return self.result

    def _stages(self) -> None:
        context = self.context
        self.shapes = probed_unvaried_dims(context.module, context.method, self.shapes, context.eager(self.shapes),
                                           self.result.notes, self._cache())
        while True:
            outcome = self._export()
            self.program = outcome.program
            onnx = context.target == Target.ONNX and outcome.onnx_path
            self.graph_file, self._graph_digest = (Path(outcome.onnx_path) if onnx else None), ""
            self.runner = open_runner(self.context, self.result, outcome, self.shapes, self.plan.calls,
                                      self.upper_bounds, lambda: self.diagnosis.repro(self.shapes))
            self.layout = OutputLayout.of(outcome.outputs, self.shapes.aligned.leaf_names, outcome.output_order)
            self._verify(self.runner)
            if not context.examples:
                return
            variation = self._variations(self.runner, outcome.trace_key)
            while variation.failed and self._guessed_again(stepped, variation, outcome.onnx_path):
                variation = self._variations(self.runner, outcome.trace_key)  # the same graph, sizes in steps
            if not variation.failed:
                return
            if not self._guessed_again(kept_static, variation, outcome.onnx_path):
                raise GraphEnded
            # exported again without the guessed dims

    def _guessed_again(self, refine: Refine, variation: VariationOutcome, onnx_path: str) -> bool:
        """Whether ``refine`` (see :mod:`.guesses`) takes the guessed dims a failing variation moved
        otherwise; if so, the shape model is so refined and the failure withdrawn."""
        shapes = refine(self.shapes, variation, onnx_path, self.result.notes)
        if shapes is None:
            return False
        self.shapes = shapes
        self.result.kind, self.result.reason, self.result.repro_path = None, "", ""
        return True

    def serves(self, shapes: ShapeModel, calls: list[int]) -> bool:
        """Whether this graph reproduces the given calls of another plan (``shapes``: this
        graph's calls then those, projected on its arguments); if so they join its calls."""
        runner, references, tensors = self.runner, self.context.references, self.layout.in_graph_order
        if runner is None or not self.result.passed or not self.result.calls:
            return False
        given = len(tensors(references[self.result.calls[0]]))  # what the graph gives: it passed its calls
        if any(len(tensors(references[c])) != given for c in calls):
            return False  # another number of outputs (attention maps asked for, or not): no run says more
        first = shapes.aligned.n_calls - len(calls)
        leaves = [shapes.call_leaves(first + i) for i in range(len(calls))]
        found = self._compared(runner, leaves, [references[c] for c in calls])
        if not all(d.ok for d in found):
            return False
        self.result.calls.extend(calls)
        self.result.notes.append(
            f"calls {[self.context.ids[c] for c in calls]} of other arguments or constants also run on this graph")
        return True

    def _export(self) -> ExportOutcome:
        context, result = self.context, self.result
        context.progress(Stage.TORCH_EXPORT, self.plan.name)
        cache = self._cache()
        probe = SizeProbe(self.shapes, context.eager(self.shapes, flat=False))
        outcome = context.quiet(lambda: export_model(
            context.module, self.shapes, context.target, self.directory / _FILES[context.target], cache,
            method=context.method, probe=probe, patches=context.patches, traces=context.traces,
            learned=context.learned,
        ))
        for stage, seconds in outcome.timings.items():  # summed over the exports of this graph
            result.timings[stage] = result.timings.get(stage, 0.0) + seconds
        result.notes.extend(note for note in outcome.notes if note not in result.notes)
        self.shapes = outcome.shapes  # as the export refined it
        self.diagnosis.capture = outcome.capture
        self.asserted = conditions(outcome.refinements)
        self.output_elements = expression(outcome.output_elements) if outcome.output_elements else None
        summary = self.shapes.to_json()
        result.relations, result.bounds = summary["relations"], summary["bounds"]
        result.dim_sources = {v.name: v.source for v in self.shapes.variables if v.axes}
        result.dims = outcome.dims if outcome.ok else summary["dims"]
        result.stage = outcome.stage
        result.hold_files(outcome)
        if outcome.example is not None:
            result.inputs = [self.shapes.aligned.leaf_names[leaf] for leaf in outcome.example.inputs]
        if not outcome.ok and outcome.kind == Kind.SPECIALIZED and choice(self.shapes, outcome.pinned):
            self.choice, self.why = outcome.pinned, f"torch.export pins it ({outcome.reason})"
            raise GraphEnded
        if not outcome.ok:
            result.kind, result.reason, result.traceback = outcome.kind, outcome.reason, outcome.traceback
            self.diagnosis.repro(self.shapes)
            raise GraphEnded
        self.upper_bounds = outcome.upper_bounds
        result.upper_bounds = {name: bound.to_json() for name, bound in outcome.upper_bounds.items()}
        lowering = [bounds_note(outcome.upper_bounds), Delegation.from_json(outcome.delegation).note()] \
            if context.target == Target.EXECUTORCH else []
        result.notes.extend(note for note in lowering if note and note not in result.notes)
        return outcome

    def _verify(self, runner: GraphRunner, arbitrated: bool = False) -> None:
        """Run every call of the plan; the check ends when the graph fails.  Calls that lacked an
        argument of the graph and fail are split off instead.  A mismatch whose reference eager
        gives again is verified again ``arbitrated``: the model in float64 decides which side
        rounds (see :mod:`.verify.arbiter`); one, or other outputs, that eager no longer gives
        (the model changed after its calls: a backbone's shared config) against eager now."""
        context, result = self.context, self.result
        stage = Stage.RUN if context.target == Target.EXECUTORCH else Stage.VERIFY
        context.progress(stage, self.plan.name)
        result.stage = stage
        begin = time.perf_counter()
        outside = self._outside_restrictions()
        served = [i for i in range(len(self.plan.calls)) if i not in outside]
        leaves = [self.shapes.call_leaves(i) for i in served]
        references = [context.references[self.plan.calls[i]] for i in served]
        found = self._compared(runner, leaves, references, arbitrated)
        for d in found:  # numbered as the plan's calls
            d.index = served[d.index]
        result.timings[stage] = result.timings.get(stage, 0.0) + time.perf_counter() - begin
        call_ids = [context.ids[c] for c in self.plan.calls]
        result.notes.extend(note for note in (padded_note(found, call_ids), float64_note(found, call_ids)) if note)
        stood_in = {i for i in range(len(self.plan.calls)) if None in self.shapes.aligned.calls[i]}
        self.split = [self.plan.calls[i] for i in outside] + [
            self.plan.calls[d.index] for d in found if not d.ok and d.index in stood_in]
        result.calls = [c for c in result.calls if c not in self.split]
        kept = [d for d in found if self.plan.calls[d.index] not in self.split]
        result.discrepancies = [d.to_json() | {"index": self.plan.calls[d.index]} for d in kept]
        result.max_abs = _finite_max(d.max_abs for d in kept)
        result.max_rel = _finite_max(d.max_rel for d in kept)
        bad = [d for d in found if not d.ok and d.index not in stood_in]
        if not bad:
            return
        if self._excluded_choice([d.index for d in bad if d.kind in (Kind.MISMATCH, Kind.ERROR)]):
            raise GraphEnded
        if self._evaluator_failed(next((d.detail for d in bad if d.kind == Kind.ERROR), "")):
            raise GraphEnded
        worst = max(bad, key=lambda d: d.max_abs)
        judged = worst.kind in (Kind.MISMATCH, Kind.OUTPUTS) and not arbitrated
        problem = self._reference_problem(self.plan.calls[worst.index]) if judged else None
        if problem == Reproduction.NONDETERMINISTIC:
            raise GraphEnded
        if problem == Reproduction.STALE or problem == Reproduction.SAME and worst.kind == Kind.MISMATCH:
            # against references eager gives today; eager giving them, float64 decides which side rounds
            self._verify(runner, arbitrated=problem == Reproduction.SAME)
            return
        source = context.observations[self.plan.calls[worst.index]].source or "recorded call"
        result.kind = worst.kind
        call = context.ids[self.plan.calls[worst.index]]
        result.reason = f"call {call} from {source}: {worst.detail or worst.kind}" + (
            f", max |Δ| {worst.max_abs:.3g}" if worst.kind == Kind.MISMATCH else "")
        if worst.kind in (Kind.MISMATCH, Kind.OUTPUTS):
            self.diagnosis.explain(self.shapes, self.program, self.layout, leaves[worst.index], references[worst.index],
                                   values=worst.kind == Kind.MISMATCH)
        self.diagnosis.repro(self.shapes, leaves[worst.index])
        raise GraphEnded

    def _compared(self, runner: GraphRunner, leaves: list[list[Any]], references: list[list[Any]],
                  arbitrated: bool = False) -> list[Discrepancy]:
        """The graph run on each call's ``leaves`` and compared with its reference (``arbitrated``:
        the model in float64 judging a mismatch); kept in the export cache unless a run raised
        (what a runtime raises may be the machine's: memory), and taken from it for the same ONNX
        file, runtime, leaves and references (what the model gives in float64 with them too): a
        graph that does not serve another plan's calls, or that eager's rounding failed, is not
        run again on a rerun."""
        context, cache = self.context, self._cache()
        key = ""
        if cache is not None and self.graph_file is not None and leaves:
            self._graph_digest = self._graph_digest or file_digest(self.graph_file)
            settings = {"tolerance": asdict(context.tolerance), "layout": repr(self.layout), "arbitrated": arbitrated}
            key = cache.verified_key(self._graph_digest, str(self.result.runtime), leaves, references, settings)
            if (stored := cache.load_verified(key)) is not None:
                found = [Discrepancy.from_json(d) for d in stored]
                if all(d.ok for d in found) and VERIFIED_NOTE not in self.result.notes:
                    self.result.notes.append(VERIFIED_NOTE)
                return found
        float64 = context.float64(self.shapes) if arbitrated else None
        found = context.quiet(lambda: verify_calls(runner, leaves, references, context.tolerance, self.layout, float64))
        if cache is not None and key and all(d.kind != Kind.ERROR for d in found):
            with contextlib.suppress(OSError):  # a cache that cannot be written keeps nothing
                cache.store_verified(key, [d.to_json() for d in found])
        return found

    def _outside_restrictions(self) -> list[int]:
        """The calls of the plan whose sizes break a restriction torch.export put on the graph
        (``height = 16*height_div16``, a Swin traced at 32 padding nothing to its windows, called
        at 40): the graph does not serve them, which it would not check; they are checked on a
        graph of their own (``self.apart`` says why, a note which calls)."""
        outside = {i: broken for i in range(len(self.plan.calls)) if (broken := self.shapes.broken(i))}
        if not outside:
            return []
        first, broken = next(iter(outside.items()))
        sizes = self.shapes.sizes_at(first)
        self.apart = ", ".join(f"{r.derived}={sizes[r.derived]}" for r in broken)
        note = (f"calls {[self.context.ids[self.plan.calls[i]] for i in outside]} break {'; '.join(map(str, broken))} "
                "(torch.export's restriction of this graph): checked on a graph of their own")
        self.result.notes.extend([note] if note not in self.result.notes else [])  # once, verified again or not
        return list(outside)

    def _excluded_choice(self, failing: list[int]) -> bool:
        """Whether the calls ``failing`` (of the plan) fail because the graph asserts a condition
        on a choice of structure that their sizes break (traced with 3 position sections, the
        graph asserts ``Ne(sections, 4)`` and computes the other branch for 4): the plan is then
        planned again by it (``self.choice``)."""
        for condition in self.asserted:
            symbols = [str(symbol) for symbol in condition.free_symbols]
            var = next((v for v in self.shapes.variables if [v.name] == symbols), None)
            if var is None or not failing or not choice(self.shapes, var.name):
                continue
            sizes = [var.values[i] for i in failing]
            if all(size is not None and not satisfied([condition], {var.name: size}) for size in sizes):
                self.choice, self.why = var.name, f"the graph torch traced asserts {condition}"
                return True
        return False

    def _evaluator_failed(self, error: str) -> bool:
        """Whether onnx's reference evaluator, standing in for onnxruntime, raised (``error``) on a
        call: the graph is then skipped (kind ``runtime``), the evaluator having gaps of its own
        (its GatherElements fails on some shapes); a mismatch it computes still fails the graph."""
        if not error or self.result.runtime != Runtime.REFERENCE:
            return False
        result = self.result
        result.verdict, result.kind = Verdict.SKIPPED, Kind.RUNTIME
        result.reason = (f"onnxruntime cannot run the graph here and onnx's reference evaluator fails on it ({error}): "
                         "the ONNX was written and checked but cannot run here; verify the model in float32")
        return True

    def _reference_problem(self, call: int) -> Reproduction:
        """Before blaming a mismatch on the export, check that eager gives the reference again
        (see :func:`~.verify.references.reproduction`).  Nondeterministic eager fails the graph;
        references eager no longer gives are recomputed for every call."""
        context, result = self.context, self.result
        observation = context.observations[call]
        reference = context.references[call]
        found = context.quiet(lambda: reproduction(context.group, observation, reference, context.tolerance))
        if found == Reproduction.NONDETERMINISTIC:
            opaque = ", ".join(f"{name} ({value_text(value)})" for name, value in
                               self.shapes.aligned.opaque_arguments().items())
            why = (f"they depend on {opaque}, bound as the tests passed it: random state?" if opaque
                   else "sampling? a submodule in training mode?")
            result.kind = Kind.NONDETERMINISTIC
            result.reason = (f"call {context.ids[call]} from {observation.source or 'recorded call'}: two eager runs "
                             f"differ, the outputs cannot be compared ({why})")
        elif found == Reproduction.STALE:
            fresh = context.quiet(lambda: refreshed(context.group, context.observations))
            context.references[:] = fresh.outputs
            result.notes.append(f"references {fresh.origin}")
        return found

    def _cache(self) -> ExportCache | None:
        settings = self.context.settings
        if not settings.use_cache:
            return None
        return ExportCache(settings.cache_dir, self.context.patches.paths, self.context.module_digest)

    def _variations(self, runner: GraphRunner, trace_key: str) -> VariationOutcome:
        """Generated shapes: a failure is kind ``variation`` with the failing sizes nearest the
        traced ones.  Variations this trace passed on an earlier run with the same settings (the
        export cache's exploration entry) are not explored again, nor those that failed on sizes
        of guessed dims (which are then kept static, whatever the failure: no reason, no repro):
        what they depend on, the model's code and configuration, the traced graph and the shape
        model, is the trace's key; the weights' values are not (the recorded calls were verified
        with this run's)."""
        context, result = self.context, self.result
        context.progress(Stage.VARIATIONS, self.plan.name)
        result.stage = Stage.VARIATIONS
        cache = self._cache()
        key = cache.exploration_key(trace_key, self._exploration_settings()) if cache and trace_key else ""
        earlier = VariationOutcome.from_json(cache.load_exploration(key)) if cache and key else None
        if earlier is not None and (not earlier.failed or moved_guesses(self.shapes, earlier)):
            result.variations = earlier.to_json()
            what = "failing on sizes of dims the tests never varied" if earlier.failed else \
                f"{earlier.valid} examples passed"
            result.notes.append(f"variations: as explored on an earlier check of this trace ({what}), not again (the "
                                "export cache holds the outcome)")
            return earlier
        begin = time.perf_counter()
        with writing(Stage.VARIATIONS, f"the hypothesis database in {self.directory}"):
            self.directory.mkdir(parents=True, exist_ok=True)
        database = "hypothesis" if context.target == Target.ONNX else f"hypothesis-{context.target}"
        variation = context.quiet(lambda: explore(
            eager=context.eager(self.shapes), run=runner, shapes=self.shapes, tolerance=context.tolerance,
            examples=context.examples, seed=context.settings.hypothesis_seed,
            database_dir=self.directory / database, storage_dir=context.settings.hypothesis_dir,
            ceilings={name: bound.size for name, bound in self.upper_bounds.items()},
            outputs=self.layout,
            pad_token_id=getattr(getattr(context.module, "config", None), "pad_token_id", None),
            asserted=self.asserted, float64=context.float64(self.shapes), output_elements=self.output_elements,
        ))
        result.timings[Stage.VARIATIONS] = time.perf_counter() - begin
        result.variations = variation.to_json()
        guessed = bool(variation.failed and moved_guesses(self.shapes, variation))  # then kept static (see _stages)
        if cache and key and (not variation.failed or guessed):
            with contextlib.suppress(OSError):  # an unwritable cache costs the next run its speed, noted by the export
                cache.store_exploration(key, result.variations)
        result.notes.extend(variation.notes())
        if guessed:
            return variation  # no reason, no repro: _stages keeps the dims static and exports again
        if variation.failed and variation.max_abs is None and self._evaluator_failed(variation.detail):
            return variation
        if variation.failed:
            # find() returned the smallest failing example: its sizes and leaves are set
            assert variation.failing_sizes is not None and variation.failing_leaves is not None
            result.kind = Kind.VARIATION
            sizes = ", ".join(f"{k}={v}" for k, v in variation.failing_sizes.items())
            line = failure_line(result.onnx_path, variation.detail)
            result.reason = f"fails at {sizes}{f' in {line}' if line else ''}: {variation.detail}"
            if variation.max_abs is not None:  # a mismatch, not an error of the graph
                leaves = variation.failing_leaves
                expected = context.eager(self.shapes)(detached_clone(leaves))
                self.diagnosis.explain(self.shapes, self.program, self.layout, leaves, expected, values=True)
            self.diagnosis.repro(self.shapes, variation.failing_leaves)
        return variation

    def _exploration_settings(self) -> dict[str, Any]:
        """What an exploration of this graph depends on besides its trace."""
        context = self.context
        return {"target": context.target, "examples": context.examples, "seed": context.settings.hypothesis_seed,
                "atol": context.tolerance.atol, "rtol": context.tolerance.rtol, "shapes": self.shapes.to_json(),
                "asserted": [str(condition) for condition in self.asserted]}


def _json_native(values: dict[str, Any]) -> dict[str, Any]:
    """Constant arguments as JSON has them (strings for anything but numbers and booleans)."""
    return {k: v if isinstance(v, (bool, int, float, str)) else value_text(v) for k, v in values.items()}


def _finite_max(values: Iterable[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    return max(finite) if finite else None
