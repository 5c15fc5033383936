"""Turn one model group into a verdict: infer shapes, export, verify, explore variations."""

from __future__ import annotations

import contextlib
import math
import re
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch

from ..core.capture import captured_output
from ..core.paths import model_directory
from ..core.text import error_line
from ..core.trees import detached_clone, flat_outputs, flattening_context
from ..core.versions import package_versions
from ..observe.recorder import Observation
from ..observe.store import ModelGroup
from ..shapes.model import ShapeModel
from . import patches
from .cache import ExportCache
from .export import ExportOutcome, export_model
from .repro import write_repro
from .result import FAILED, PASSED, SKIPPED, ModelResult
from .settings import CheckSettings
from .variations import explore
from .verify import Discrepancy, OnnxRunner, Tolerance, program_runner, verify_calls

Progress = Callable[[str], None]
T = TypeVar("T")


def safe_name(name: str) -> str:
    """A file-system friendly version of a group name."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "model"


def check_model(group: ModelGroup, settings: CheckSettings, progress: Progress = lambda stage: None) -> ModelResult:
    """Check one group; never raises (every exception becomes a failed result with its stage)."""
    recorder = group.recorder
    result = ModelResult(
        name=group.name, verdict=FAILED, stage="infer", sources=list(group.sources),
        model_class=group.model_class, n_observations=recorder.num_obs(),
        expected_failure=_xfail_reason(group.options.xfail),
        n_calls=sum(vars(recorder.counts).values()), env=dict(package_versions()),
    )
    if not recorder.num_obs():
        result.verdict, result.stage = SKIPPED, "observe"
        result.reason = "no call of the model was observed"
        if recorder.errors:
            result.reason += f" ({recorder.counts.failed} calls could not be recorded: {recorder.errors[0]})"
        return result
    try:
        _ModelCheck(group, settings, result, progress).run()
    except Exception as e:  # the engine's own failures are a verdict too, never a crash
        result.verdict, result.kind = FAILED, "error"
        result.reason = error_line(e)
        result.traceback = "".join(traceback.format_exception(e))
    return result


class _ModelCheck:
    """The stages of one check, filling ``result`` as they go."""

    def __init__(self, group: ModelGroup, settings: CheckSettings, result: ModelResult, progress: Progress):
        self.group, self.settings, self.result, self.progress = group, settings, result, progress
        self.options = group.options
        self.model_dir = model_directory(settings.export_dir, group.name)
        self.shapes: ShapeModel

    def run(self) -> None:
        with patches.entered((*self.settings.patches, *self.options.patches)), flattening_context(), \
                _eval_no_grad(self.group.module):
            self._infer()
            observations = [self.group.recorder.observations[i] for i in self.shapes.aligned.kept]
            references, self.result.reference = _references(self.group, observations)
            outcome = self._export()
            if not outcome.ok:
                return
            self.progress("verify")
            runner = self._runner(outcome)
            set_aside = self._verify(runner, observations, references)
            if set_aside is None:
                return
            examples = _first(self.options.examples, self.settings.examples)
            if examples:
                self._variations(runner, examples, recorded_only=set_aside)
                if self.result.kind:
                    return
            self.result.verdict = PASSED
        self.result.output = ""

    def _infer(self) -> None:
        self.progress("infer")
        begin = time.perf_counter()
        self.shapes = ShapeModel.from_aligned(
            self.group.recorder.aligned(keep_majority=True), self.options.set_batch_dimension_for,
            self.options.dim_names,
        )
        self.result.timings["infer"] = time.perf_counter() - begin
        summary = self.shapes.to_json()
        self.result.dims, self.result.relations = summary["dims"], summary["relations"]
        self.result.bounds = summary["bounds"]
        self.result.notes.extend([*self.shapes.aligned.notes, *summary["notes"]])

    def _export(self) -> ExportOutcome:
        result, settings = self.result, self.settings
        self.progress("export")
        cache = ExportCache(settings.export_dir / "cache", (*settings.patches, *self.options.patches))
        outcome = self._quiet(lambda: export_model(
            self.group.module, self.shapes, settings.target, self.model_dir / "model.onnx",
            cache if settings.use_cache else None, method=self.options.method,
        ))
        result.timings.update(outcome.timings)
        result.notes.extend(outcome.notes)
        for name, into in outcome.equalities:
            self.shapes.merge(name, into)
        result.dims = self.shapes.to_json()["dims"]
        result.stage, result.cache_hit, result.onnx_path = outcome.stage, outcome.cache_hit, outcome.onnx_path
        result.opset, result.op_counts = outcome.opset, outcome.op_counts
        if not outcome.ok:
            result.kind, result.reason, result.traceback = "error", outcome.reason, outcome.traceback
            self._repro(self.shapes.call_leaves(self.shapes.aligned.complete_call()))
        return outcome

    def _runner(self, outcome: ExportOutcome) -> Callable[[list[Any]], list[Any]]:
        result = self.result
        tolerance = self._tolerance()
        result.atol, result.rtol = tolerance.atol, tolerance.rtol
        result.stage = "ort-load" if self.settings.target == "onnx" else "verify"
        begin = time.perf_counter()
        runner = (
            self._quiet(lambda: OnnxRunner(Path(outcome.onnx_path))) if self.settings.target == "onnx"
            else program_runner(outcome.program, self.shapes.aligned, constants=not outcome.bound)
        )
        result.timings[result.stage] = time.perf_counter() - begin
        return runner

    def _tolerance(self) -> Tolerance:
        return Tolerance(_first(self.options.atol, self.settings.atol), _first(self.options.rtol, self.settings.rtol))

    def _verify(
        self, runner: Callable[[list[Any]], list[Any]], observations: list[Observation], references: list[list[Any]],
    ) -> bool | None:
        """Verify every kept call; ``None`` when the check failed, else whether calls were set aside."""
        result, shapes = self.result, self.shapes
        result.stage = "verify"
        calls = [shapes.call_leaves(index) for index in range(shapes.aligned.n_calls)]
        begin = time.perf_counter()
        discrepancies = self._quiet(lambda: verify_calls(runner, calls, references, self._tolerance()))
        result.timings["verify"] = time.perf_counter() - begin
        result.discrepancies = [d.to_json() for d in discrepancies]
        result.max_abs = _finite_max(d.max_abs for d in discrepancies)
        result.max_rel = _finite_max(d.max_rel for d in discrepancies)
        failing = [d for d in discrepancies if not d.ok]
        bad = _without_unverifiable(shapes, failing, len(discrepancies), result)
        if not bad:
            return len(bad) < len(failing)
        worst = max(bad, key=lambda d: d.max_abs)
        source = observations[worst.index].source or "recorded call"
        result.kind = worst.kind
        result.reason = f"call {worst.index} from {source}: {worst.detail or worst.kind}" + (
            f", max |Δ| {worst.max_abs:.3g}" if worst.kind == "mismatch" else "")
        self._repro(shapes.call_leaves(worst.index))
        return None

    def _variations(self, runner: Callable[[list[Any]], list[Any]], examples: int, recorded_only: bool) -> None:
        """Generated shapes: a failure is kind ``variation`` with the smallest failing sizes.
        When calls with stood-in inputs were set aside, sizes only stand-ins had are not tried."""
        result, shapes = self.result, self.shapes
        self.progress("variations")
        result.stage = "variations"
        begin = time.perf_counter()
        method = getattr(self.group.module, self.options.method)

        def eager(leaves: list[Any]) -> list[Any]:
            args, kwargs = shapes.aligned.split_arguments(leaves)
            return flat_outputs(method(*args, **kwargs))

        variation = self._quiet(lambda: explore(
            eager=eager, run=runner, shapes=shapes, tolerance=self._tolerance(), examples=examples,
            seed=self.settings.hypothesis_seed, database_dir=self.model_dir / "hypothesis",
            recorded_only=recorded_only,
        ))
        result.timings["variations"] = time.perf_counter() - begin
        result.variations = variation.to_json()
        if variation.tried and not variation.valid:
            result.notes.append(
                f"variations: eager rejected all {variation.tried} generated examples: the model relates "
                "sizes that the shape model keeps independent (e.g. mask = seq + a constant past)"
            )
        if variation.failed:
            result.kind = "variation"
            sizes = ", ".join(f"{k}={v}" for k, v in variation.failing_sizes.items())
            result.reason = f"fails at {sizes}: {variation.detail}"
            self._repro(variation.failing_leaves)

    def _repro(self, leaves: list[Any]) -> None:
        """Write the self-contained repro of a failure; a failure to write it is only a note."""
        result = self.result
        try:
            repro = write_repro(
                self.model_dir / "repro", self.group.module, self.shapes, leaves, stage=result.stage,
                target=self.settings.target, method=self.options.method, atol=result.atol, rtol=result.rtol,
            )
        except Exception as e:  # a repro is a convenience: never let it hide the verdict
            result.notes.append(f"no repro written: {type(e).__name__}: {e}")
            return
        result.repro_path = repro.path
        if repro.note:
            result.notes.append(repro.note)

    def _quiet(self, call: Callable[[], T]) -> T:
        """Run ``call`` with its output (torch's graph dumps, C++ and logging warnings) and its Python
        warnings kept in the result: torch warns about its own internals during export, and a user
        suite running with ``-W error`` must not turn those into export failures."""
        output: list[str] = []
        try:
            with warnings.catch_warnings(record=True) as caught, captured_output() as output:
                warnings.simplefilter("always")
                return call()
        finally:
            self.result.output += "".join(output)
            self.result.output += "".join(f"{w.category.__name__}: {w.message}\n" for w in caught)


def _without_unverifiable(
    shapes: ShapeModel, bad: list[Discrepancy], n_calls: int, result: ModelResult
) -> list[Discrepancy]:
    """Failures left once calls that lacked an input are set aside when the exported graph
    cannot run them at all: an empty stand-in is not always what the absence meant (a T5 graph
    traced with its cross-attention cache cannot run without one).  Noted, never silent; when
    no call is left to verify, the failures stand."""
    unverifiable = [d for d in bad if d.kind == "error" and shapes.aligned.absent_slots(d.index)]
    if not unverifiable or len(unverifiable) == n_calls:
        return bad
    absent = sorted({name for d in unverifiable for name in shapes.aligned.absent_slots(d.index)})
    result.notes.append(
        f"calls {[d.index for d in unverifiable]} not verified: they lack {', '.join(absent)} and the "
        f"exported graph cannot run them on empty stand-ins ({unverifiable[0].detail})"
    )
    return [d for d in bad if d not in unverifiable]


def _references(group: ModelGroup, observations: list[Observation]) -> tuple[list[list[Any]], str]:
    """Eager outputs to compare with: recorded ones when made on the exported instance with its
    current weights, else recomputed on it now."""
    references, recomputed = [], 0
    for obs in observations:
        if group.is_reference_valid(obs.instance, obs.weights_version):
            references.append(obs.outputs)
            continue
        args, kwargs = detached_clone((obs.args, obs.kwargs))
        references.append(flat_outputs(getattr(group.module, group.options.method)(*args, **kwargs)))
        recomputed += 1
    if not recomputed:
        return references, "recorded"
    return references, f"recomputed on the exported instance for {recomputed} of {len(references)} calls"


def _finite_max(values: Iterable[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    return max(finite) if finite else None


def _xfail_reason(xfail: bool | str | None) -> str:
    if not xfail:
        return ""
    return xfail if isinstance(xfail, str) else "marked xfail"


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


@contextlib.contextmanager
def _eval_no_grad(module: torch.nn.Module) -> Iterator[None]:
    training = module.training
    module.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        module.train(training)
