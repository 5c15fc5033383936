"""Turn one model group into a verdict: infer shapes, export, verify, explore variations."""

from __future__ import annotations

import contextlib
import importlib
import math
import re
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from .results import FAILED, PASSED, SKIPPED, ModelResult, error_line
from .store import ModelGroup

Progress = Callable[[str], None]


@dataclass(frozen=True)
class CheckSettings:
    """Session-wide settings of the check (per-model marker options override tolerances/examples)."""

    export_dir: Path
    target: str = "onnx"
    atol: float | None = None
    rtol: float | None = None
    examples: int = 10
    patches: tuple[str, ...] = ()
    hypothesis_seed: int | None = None
    use_cache: bool = True
    env: dict[str, str] = field(default_factory=dict)


def safe_name(name: str) -> str:
    """A file-system friendly version of a group name."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "model"


def check_group(group: ModelGroup, settings: CheckSettings, progress: Progress = lambda stage: None) -> ModelResult:
    """Check one group; never raises (every exception becomes a failed result with its stage)."""
    result = ModelResult(
        name=group.name, verdict=FAILED, stage="infer", sources=list(group.sources),
        model_class=group.model_class, n_observations=group.observer.num_obs(),
        expected_failure=_xfail_reason(group.options.xfail),
        n_calls=sum(vars(group.observer.counts).values()),
        env=dict(settings.env),
    )
    if not group.observer.num_obs():
        result.verdict, result.stage = SKIPPED, "observe"
        result.reason = "no call of the model was observed"
        if group.observer.errors:
            result.reason += f" ({group.observer.counts.failed} calls could not be recorded: {group.observer.errors[0]})"
        return result
    try:
        _run(group, settings, result, progress)
    except Exception as e:  # the engine's own failures are a verdict too, never a crash
        result.verdict, result.kind = FAILED, "error"
        result.reason = error_line(e)
        result.traceback = "".join(traceback.format_exception(e))
    return result


def _run(group: ModelGroup, settings: CheckSettings, result: ModelResult, progress: Progress) -> None:
    from .observer import flattening_context
    from .shapes import ShapeModel

    options = group.options
    with _patches((*settings.patches, *options.patches)), flattening_context(), _eval_no_grad(group.module):
        progress("infer")
        begin = time.perf_counter()
        shapes = ShapeModel.from_aligned(
            group.observer.aligned(keep_majority=True), options.set_batch_dimension_for, options.dim_names
        )
        result.timings["infer"] = time.perf_counter() - begin
        summary = shapes.to_json()
        result.dims, result.relations, result.bounds = summary["dims"], summary["relations"], summary["bounds"]
        result.notes.extend([*shapes.aligned.notes, *summary["notes"]])
        _export_and_verify(group, settings, shapes, result, progress)
    if result.verdict == PASSED:
        result.output = ""


def _export_and_verify(
    group: ModelGroup, settings: CheckSettings, shapes: Any, result: ModelResult, progress: Progress
) -> None:
    from .export import ExportSettings, export_model
    from .verify import OnnxRunner, Tolerance, program_runner, verify_calls

    options = group.options
    model_dir = settings.export_dir / safe_name(group.name)
    observations = [group.observer.observations[i] for i in shapes.aligned.kept]
    references, result.reference = _references(group, observations)
    progress("export")
    export_settings = ExportSettings(
        target=settings.target,
        cache_dir=settings.export_dir / "cache" if settings.use_cache else None,
        fingerprint_extra=(*settings.patches, *options.patches),
    )
    outcome = _quiet(result, lambda: export_model(
        group.module, shapes, export_settings, model_dir / "model.onnx", method=options.method))
    result.timings.update(outcome.timings)
    result.notes.extend(outcome.notes)
    for name, into in outcome.equalities:
        shapes.merge(name, into)
    result.dims = shapes.to_json()["dims"]
    result.stage, result.cache_hit, result.onnx_path = outcome.stage, outcome.cache_hit, outcome.onnx_path
    result.opset, result.op_counts = outcome.opset, outcome.op_counts
    if not outcome.ok:
        result.kind, result.reason, result.traceback = "error", outcome.reason, outcome.traceback
        _repro(group, settings, shapes, shapes.call_leaves(shapes.aligned.complete_call()), result)
        return
    progress("verify")
    tolerance = Tolerance(_first(options.atol, settings.atol), _first(options.rtol, settings.rtol))
    result.atol, result.rtol = tolerance.atol, tolerance.rtol
    result.stage = "ort-load" if settings.target == "onnx" else "verify"
    begin = time.perf_counter()
    runner = (
        _quiet(result, lambda: OnnxRunner(Path(outcome.onnx_path))) if settings.target == "onnx"
        else program_runner(outcome.program, shapes.aligned, constants=not outcome.bound)
    )
    result.timings[result.stage] = time.perf_counter() - begin
    result.stage = "verify"
    begin = time.perf_counter()
    discrepancies = _quiet(result, lambda: verify_calls(runner, shapes, references, tolerance))
    result.timings["verify"] = time.perf_counter() - begin
    result.discrepancies = [d.to_json() for d in discrepancies]
    result.max_abs = _finite_max(d.max_abs for d in discrepancies)
    result.max_rel = _finite_max(d.max_rel for d in discrepancies)
    bad = _without_unverifiable(shapes, [d for d in discrepancies if not d.ok], len(discrepancies), result)
    set_aside = len(bad) < sum(not d.ok for d in discrepancies)
    if bad:
        worst = max(bad, key=lambda d: d.max_abs)
        source = observations[worst.index].source or "recorded call"
        result.kind = worst.kind
        result.reason = f"call {worst.index} from {source}: {worst.detail or worst.kind}" + (
            f", max |Δ| {worst.max_abs:.3g}" if worst.kind == "mismatch" else "")
        _repro(group, settings, shapes, shapes.call_leaves(worst.index), result)
        return
    examples = _first(options.examples, settings.examples)
    if examples:
        progress("variations")
        _variations(group, settings, shapes, runner, tolerance, examples, result, recorded_only=set_aside)
        if result.kind:
            return
    result.verdict = PASSED


def _without_unverifiable(shapes: Any, bad: list[Any], n_calls: int, result: ModelResult) -> list[Any]:
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


def _variations(
    group: ModelGroup, settings: CheckSettings, shapes: Any, runner: Any, tolerance: Any, examples: int,
    result: ModelResult, recorded_only: bool,
) -> None:
    """Generated shapes: a failure is kind ``variation`` with the smallest failing sizes.
    When calls with stood-in inputs were set aside, sizes only stand-ins had are not tried."""
    from .variations import explore

    result.stage = "variations"
    begin = time.perf_counter()
    method = getattr(group.module, group.options.method)

    def eager(leaves: list[Any]) -> list[Any]:
        args, kwargs = shapes.aligned.split_arguments(leaves)
        return _flat_outputs(method(*args, **kwargs))

    variation = _quiet(result, lambda: explore(
        eager=eager, run=runner, shapes=shapes, tolerance=tolerance, examples=examples, seed=settings.hypothesis_seed,
        database_dir=settings.export_dir / safe_name(group.name) / "hypothesis", recorded_only=recorded_only,
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
        _repro(group, settings, shapes, variation.failing_leaves, result)


def _repro(group: ModelGroup, settings: CheckSettings, shapes: Any, leaves: list[Any], result: ModelResult) -> None:
    """Write the self-contained repro of a failure; a failure to write it is only a note."""
    from .repro import write_repro

    try:
        repro = write_repro(
            settings.export_dir / safe_name(group.name) / "repro", group.module, shapes, leaves,
            stage=result.stage, target=settings.target, method=group.options.method,
            atol=result.atol, rtol=result.rtol,
        )
    except Exception as e:  # a repro is a convenience: never let it hide the verdict
        result.notes.append(f"no repro written: {type(e).__name__}: {e}")
        return
    result.repro_path = repro.path
    if repro.note:
        result.notes.append(repro.note)


T = TypeVar("T")


def _quiet(result: ModelResult, call: Callable[[], T]) -> T:
    """Run ``call`` with its output (torch's graph dumps, C++ and logging warnings) and its Python
    warnings kept in the result: torch warns about its own internals during export, and a user
    suite running with ``-W error`` must not turn those into export failures."""
    from .capture import captured_output

    output: list[str] = []
    try:
        with warnings.catch_warnings(record=True) as caught, captured_output() as output:
            warnings.simplefilter("always")
            return call()
    finally:
        result.output += "".join(output)
        result.output += "".join(f"{w.category.__name__}: {w.message}\n" for w in caught)


def _flat_outputs(outputs: Any) -> list[Any]:
    from torch.utils import _pytree

    return [t.detach() if hasattr(t, "detach") else None for t in _pytree.tree_leaves(outputs)]


def _finite_max(values: Iterator[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    return max(finite) if finite else None


def _references(group: ModelGroup, observations: list[Any]) -> tuple[list[list[Any]], str]:
    """Eager outputs to compare with: recorded ones when made on the exported instance with its
    current weights, else recomputed on it now."""
    from .observer import detached_clone

    references, recomputed = [], 0
    for obs in observations:
        if group.is_reference_valid(obs.instance, obs.weights_version):
            references.append(obs.outputs)
            continue
        args, kwargs = detached_clone((obs.args, obs.kwargs))
        references.append(_flat_outputs(getattr(group.module, group.options.method)(*args, **kwargs)))
        recomputed += 1
    if not recomputed:
        return references, "recorded"
    return references, f"recomputed on the exported instance for {recomputed} of {len(references)} calls"


def _xfail_reason(xfail: bool | str | None) -> str:
    if not xfail:
        return ""
    return xfail if isinstance(xfail, str) else "marked xfail"


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


@contextlib.contextmanager
def _eval_no_grad(module: Any) -> Iterator[None]:
    import torch

    training = module.training
    module.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        module.train(training)


@contextlib.contextmanager
def _patches(paths: tuple[str, ...]) -> Iterator[None]:
    """Enter the context managers made by the factories at the given dotted paths."""
    with contextlib.ExitStack() as stack:
        for path in paths:
            stack.enter_context(resolve(path)())
        yield


def resolve(path: str) -> Any:
    """The object at ``package.module.attribute`` (``package.module:attribute`` also works)."""
    module_name, _, attribute = path.replace(":", ".").rpartition(".")
    if not module_name:
        raise ValueError(f"export patch {path!r} is no dotted path module.attribute")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"export patch {path!r} cannot be imported: {e}") from e
