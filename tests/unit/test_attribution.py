"""Regressions name the package versions that changed since the baseline; the gate lists the
models whose state changed.  Pure Python, no torch."""

from __future__ import annotations

import json

from pytest_exportobs.core.files import json_text
from pytest_exportobs.engine.base.result import GraphResult, ModelResult
from pytest_exportobs.gate.baseline import Baseline
from pytest_exportobs.gate.judge import Change, GateEntry, changed_versions, gate, state
from pytest_exportobs.gate.render import gate_json, summary_line, versions_text

OLD_ENV = {"onnx": "1.19.0", "torch": "2.13.0", "transformers": "4.57.6"}
X = {"x": {"0": "batch", "1": "seq"}}


def recorded(*results: ModelResult, env: dict[str, str] = OLD_ENV) -> Baseline:
    return Baseline(Baseline.from_results(results).models, dict(env))


def now(name: str, verdict: str = "passed", env: dict[str, str] | None = None, dims: dict | None = None,
        **fields) -> ModelResult:
    graphs = [] if dims is None else [GraphResult("", dims=dims)]
    return ModelResult(name, verdict, env=dict(OLD_ENV if env is None else env), graphs=graphs, **fields)


def test_regression_names_the_package_that_changed():
    env = {**OLD_ENV, "transformers": "5.23.0"}
    g = gate(recorded(ModelResult("mlp", "passed")), [now("mlp", "failed", env, stage="torch.export")])
    message = "passed→failed at torch.export (passed with transformers 4.57.6, fails with transformers 5.23.0)"
    assert g.entries == [GateEntry("mlp", "failed", message, regression=True)]
    assert summary_line(g) == f"exportobs gate: 1 regression (mlp: {message})"
    assert g.versions == {"transformers": ("4.57.6", "5.23.0")}
    assert versions_text(g.versions) == "transformers 4.57.6 → 5.23.0"


def test_several_changed_packages_are_listed_by_name():
    env = {"onnx": "1.20.0", "torch": "2.15.0", "transformers": "5.23.0"}
    g = gate(recorded(ModelResult("lm", "passed")), [now("lm", "failed", env, stage="verify")])
    assert g.entries[0].message == (
        "passed→failed at verify (passed with onnx 1.19.0, torch 2.13.0 and transformers 4.57.6, "
        "fails with onnx 1.20.0, torch 2.15.0 and transformers 5.23.0)"
    )
    assert versions_text(g.versions) == "onnx 1.19.0 → 1.20.0, torch 2.13.0 → 2.15.0, transformers 4.57.6 → 5.23.0"


def test_dims_that_became_static_name_the_versions_once():
    env = {**OLD_ENV, "torch": "2.15.0"}
    g = gate(recorded(ModelResult("lm", "passed", graphs=[GraphResult("", dims=X)])), [now("lm", env=env, dims={})])
    assert g.entries[0].message.split("; ") == [
        "dim x.0 (batch) became static (dynamic with torch 2.13.0, static with torch 2.15.0)",
        "dim x.1 (seq) became static",
    ]


def test_a_failure_and_lost_dims_name_the_versions_on_the_failure():
    env = {**OLD_ENV, "torch": "2.15.0"}
    g = gate(recorded(ModelResult("lm", "passed", graphs=[GraphResult("", dims=X)])),
             [now("lm", "failed", env, stage="verify", dims={})])
    assert g.entries[0].message.split("; ") == [
        "passed→failed at verify (passed with torch 2.13.0, fails with torch 2.15.0)",
        "dim x.0 (batch) became static",
        "dim x.1 (seq) became static",
    ]


def test_unchanged_versions_and_packages_on_one_side_only_are_not_named():
    assert changed_versions({"torch": "2.13.0", "onnx": "1.19.0"}, {"torch": "2.13.0", "transformers": "5.23.0"}) == {}
    g = gate(recorded(ModelResult("mlp", "passed"), env={"torch": "2.13.0"}),
             [now("mlp", "failed", {"torch": "2.13.0", "transformers": "5.23.0"}, stage="torch.export")])
    assert g.entries[0].message == "passed→failed at torch.export"
    assert versions_text(g.versions) == "none"


def test_a_baseline_without_env_names_no_version():
    g = gate(recorded(ModelResult("mlp", "passed"), env={}), [now("mlp", "failed", stage="verify")])
    assert (g.entries[0].message, g.versions) == ("passed→failed at verify", {})


def test_a_result_without_versions_is_attributed_with_the_session_s_versions():
    """A crashed check (no env of its own) ran in the same environment as the other models."""
    env = {**OLD_ENV, "torch": "2.15.0"}
    crashed = ModelResult("lm", "failed", stage="isolate", reason="the isolated check process died (signal SIGSEGV)")
    g = gate(recorded(ModelResult("lm", "passed"), ModelResult("mlp", "passed")), [crashed, now("mlp", env=env)])
    assert g.entries[0].message == "passed→failed at isolate (passed with torch 2.13.0, fails with torch 2.15.0)"


def test_changes_list_every_model_whose_state_differs():
    old = recorded(
        ModelResult("gone", "passed"),
        ModelResult("lm", "passed", graphs=[GraphResult("", dims=X)]),
        ModelResult("same", "failed", stage="torch.export", graphs=[GraphResult("", dims=X)]),
        ModelResult("vit", "failed", stage="infer"),
        ModelResult("moved", "failed", stage="torch.export"),
    )
    g = gate(old, [
        now("lm", "failed", stage="verify", dims={"x": {"0": "batch"}}),
        now("same", "failed", stage="torch.export", dims=X),
        now("vit", stage="variations", dims={"pixels": {"0": "batch"}}),
        now("moved", "incomplete", stage="ort-load", dims=X),
        now("new", "skipped", stage="observe"),
    ])
    assert g.changes == [
        Change("gone", "passed, static", "absent"),
        Change("lm", "passed, x{0:batch,1:seq}", "failed at verify, x{0:batch}"),
        Change("moved", "failed at torch.export, static", "incomplete at ort-load"),
        Change("new", "absent", "skipped"),
        Change("vit", "failed at infer", "passed, pixels{0:batch}"),
    ]
    assert gate(None, [now("lm")]).changes == []


def test_the_order_of_dims_is_no_change():
    """A baseline file sorts its keys; a session keeps the inputs in signature order."""
    session = {"input_ids": {"1": "seq", "0": "batch"}, "attention_mask": {"0": "batch", "10": "k", "2": "t"}}
    exported = ModelResult("lm", "passed", graphs=[GraphResult("", dims=session)])
    written = json.loads(json_text(recorded(exported).to_json()))
    assert list(written["models"]["lm"]["dims"]) == ["attention_mask", "input_ids"]
    g = gate(Baseline.from_json(written), [now("lm", dims=session)])
    assert g.changes == []
    assert state("passed", "", session) == "passed, attention_mask{0:batch,2:t,10:k} input_ids{0:batch,1:seq}"


def test_state_shows_dims_only_where_the_check_knew_them():
    assert state("passed", "variations", X) == "passed, x{0:batch,1:seq}"
    assert state("failed", "torch.export", X) == "failed at torch.export, x{0:batch,1:seq}"
    assert state("failed", "infer", {}) == "failed at infer"
    assert state("failed", "isolate", X) == "failed at isolate"
    assert state("incomplete", "observe", {}) == "incomplete at observe"
    assert state("skipped", "observe", {}) == "skipped"


def test_gate_json_carries_versions_and_changes():
    env = {**OLD_ENV, "torch": "2.15.0"}
    data = gate_json(gate(recorded(ModelResult("mlp", "passed")), [now("mlp", "failed", env, stage="verify")]))
    assert data["versions"] == {"torch": ["2.13.0", "2.15.0"]}
    assert data["changes"] == [{"name": "mlp", "before": "passed, static", "now": "failed at verify, static"}]
