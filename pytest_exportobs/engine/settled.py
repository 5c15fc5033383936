"""A group with nothing to export, found without checking it: no call recorded, or its calls or
weights on the meta device.

Light on purpose (torch and the observed groups, no exporter): the test process asks it while the
tests still run (:mod:`.early`), where importing the exporter's modules would add their objects to
every garbage collection the tests run.
"""

from __future__ import annotations

from typing import Any

from ..core.trees import on_meta_device
from ..core.versions import package_versions
from ..core.vocabulary import Kind, Stage, Target, Verdict
from ..observe.store import ModelGroup
from .base.result import ModelResult


def settled(group: ModelGroup) -> ModelResult | None:
    """The result of a group with nothing to export (no call recorded; calls or weights on the
    meta device), found without checking it; ``None`` for a group to check."""
    result = new_result(group)
    return result if is_settled(group, result) else None


def new_result(group: ModelGroup, target: Target = Target.ONNX) -> ModelResult:
    """The result a check of ``group`` for ``target`` starts from: what the group records, failed
    at inference until a stage says otherwise."""
    recorder = group.recorder
    return ModelResult(
        name=group.name, target=target, verdict=Verdict.FAILED, stage=Stage.INFER, sources=list(group.sources),
        model_class=group.model_class, n_observations=recorder.num_obs(),
        expected_failure=_xfail_reason(group.options.xfail),
        n_calls=sum(vars(recorder.counts).values()), env=dict(package_versions()),
    )


def is_settled(group: ModelGroup, result: ModelResult) -> bool:
    """Whether ``result`` is settled before any check: its verdict set when there is nothing
    to export."""
    recorder = group.recorder
    if not recorder.num_obs():
        _unobserved(result, recorder)
        return True
    on_meta = [on_meta_device(o) for o in recorder.observations]
    if group.kept.on_meta or all(on_meta):
        result.verdict, result.stage = Verdict.SKIPPED, Stage.OBSERVE
        result.reason = ("its calls ran on the meta device (shapes, no values): nothing to run eagerly, export or "
                         "compare" if all(on_meta) else "its weights are on the meta device (shapes, no values), moved "
                         "there after its calls: nothing to export or compare")
        return True
    return False


def _unobserved(result: ModelResult, recorder: Any) -> None:
    """No call was recorded: skipped when the model was never called, failed when its calls
    could not be recorded (a cache class that cannot be flattened is no reason to skip)."""
    result.stage = Stage.OBSERVE
    if not recorder.counts.failed:
        result.verdict, result.reason = Verdict.SKIPPED, "no call of the model was observed"
        return
    result.verdict, result.kind = Verdict.FAILED, Kind.UNSUPPORTED_INPUT
    result.reason = f"none of its {recorder.counts.failed} calls could be recorded: {recorder.errors[0]}"


def _xfail_reason(xfail: bool | str | None) -> str:
    if not xfail:
        return ""
    return xfail if isinstance(xfail, str) else "marked xfail"
