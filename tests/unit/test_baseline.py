"""The baseline file and the gate rules; pure Python, no torch."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pytest_exportobs.engine.base.result import GraphResult, ModelResult
from pytest_exportobs.gate.baseline import Baseline, BaselineEntry, BaselineError
from pytest_exportobs.gate.judge import GateEntry, gate
from pytest_exportobs.gate.render import summary_line

HINT = "run with --export-baseline-update to record it"
LM_DIMS = {"input_ids": {"0": "batch", "1": "seq"}}
VIT_DIMS = {"pixel_values": {"0": "batch", "2": "height", "3": "width"}}
GRAPH_FIELDS = ("dims", "relations", "max_abs", "opset", "op_counts")


def result(name: str, verdict: str = "passed", **fields) -> ModelResult:
    """A model's result; the fields in ``GRAPH_FIELDS`` are its one graph's."""
    graph = {key: fields.pop(key) for key in GRAPH_FIELDS if key in fields}
    return ModelResult(name, verdict, graphs=[GraphResult("", **graph)] if graph else [], **fields)


def baseline(*results: ModelResult) -> Baseline:
    return Baseline.from_results(results)


# -- gate without a baseline ------------------------------------------------------------


def test_without_baseline_each_verdict_decides():
    results = [
        result("lm", dims=LM_DIMS),
        result("vit", "failed", stage="torch.export"),
        result("crashed", "incomplete", stage="ort-load"),
        result("idle", "skipped", reason="no observation"),
    ]
    g = gate(None, results, strict=True)
    assert g.entries == [
        GateEntry("crashed", "failed", "incomplete at ort-load"),
        GateEntry("idle", "skipped", "no observation"),
        GateEntry("lm", "passed"),
        GateEntry("vit", "failed", "failed at torch.export"),
    ]
    assert g.failed
    assert summary_line(g) == (
        "exportobs gate: 2 failures (crashed: incomplete at ort-load; vit: failed at torch.export)"
    )


def test_without_baseline_all_passed():
    g = gate(None, [result("lm"), result("idle", "skipped")], strict=False)
    assert not g.failed
    assert summary_line(g) == "exportobs gate: ok (1 passed, 1 skipped, no baseline)"


# -- regressions ----------------------------------------------------------------------------


def test_passed_then_failed_is_a_regression():
    g = gate(baseline(result("lm")), [result("lm", "failed", stage="torch.export")], strict=False)
    assert g.entries == [GateEntry("lm", "failed", "passed→failed at torch.export", regression=True)]
    assert g.failed
    assert summary_line(g) == "exportobs gate: 1 regression (lm: passed→failed at torch.export)"


def test_dim_that_became_static_is_a_regression():
    static_height = {"pixel_values": {"0": "batch", "3": "width"}}
    g = gate(
        baseline(result("lm", dims=LM_DIMS), result("vit", dims=VIT_DIMS)),
        [result("lm", "failed", stage="torch.export", dims=LM_DIMS), result("vit", dims=static_height)],
        strict=False,
    )
    assert [(e.outcome, e.regression) for e in g.entries] == [("failed", True), ("failed", True)]
    assert summary_line(g) == (
        "exportobs gate: 2 regressions "
        "(lm: passed→failed at torch.export; vit: dim pixel_values.2 (height) became static)"
    )


def test_lost_dims_and_failure_are_reported_together():
    old = baseline(result("lm", dims=LM_DIMS))
    g = gate(old, [result("lm", "failed", stage="verify", kind="mismatch", dims={})], strict=False)
    assert g.entries[0].message.split("; ") == [
        "passed→failed at verify",
        "dim input_ids.0 (batch) became static",
        "dim input_ids.1 (seq) became static",
    ]


def test_dims_are_not_compared_when_the_check_stopped_before_inferring_them():
    old = baseline(result("lm", "failed", stage="torch.export", dims=LM_DIMS))
    g = gate(old, [result("lm", "failed", stage="infer")], strict=False)
    moved = "failing stage moved: torch.export → infer"
    assert g.entries == [GateEntry("lm", "xfailed", "known failure at infer", notes=[moved])]
    assert not g.failed


def test_a_known_failure_losing_a_dim_is_a_regression():
    old = baseline(result("lm", "failed", stage="onnx-translate", dims=LM_DIMS))
    now = result("lm", "failed", stage="onnx-translate", dims={"input_ids": {"0": "batch"}})
    assert gate(old, [now], strict=False).entries == [
        GateEntry("lm", "failed", "dim input_ids.1 (seq) became static", regression=True)
    ]


CACHE_DIMS = {"input_ids": {"0": "batch", "1": "seq"}, "attention_mask": {"0": "batch", "1": "total_seq"},
              **{f"past_key_values.{kind}_{i}": {"0": "batch", "2": "past_seq"}
                 for i in (0, 1) for kind in ("key", "value")}}


def cache_renamed(dims: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """The dims with transformers 5.24's name of the cache argument."""
    return {name.replace("past_key_values", "cache"): axes for name, axes in dims.items()}


def test_an_input_renamed_with_the_same_leaves_and_dims_is_a_note_not_a_regression():
    """transformers 5.24 passes generate()'s cache as ``cache``: the same dims under another name."""
    versions = {"transformers": "5.23.0"}
    old = baseline(result("llama", dims=CACHE_DIMS, env=versions))
    now = result("llama", dims=cache_renamed(CACHE_DIMS), env={"transformers": "5.24.0"})
    g = gate(old, [now], strict=False)
    renamed = "input past_key_values is now named cache: its dims are compared under the new name"
    assert g.entries == [GateEntry("llama", "passed", notes=[renamed])]
    assert not g.failed and summary_line(g) == "exportobs gate: ok (1 passed, 0 regressions)"


def test_a_dim_that_became_static_under_a_rename_is_still_a_regression():
    lost = cache_renamed(CACHE_DIMS)
    lost["cache.key_1"] = {"0": "batch"}
    g = gate(baseline(result("llama", dims=CACHE_DIMS)), [result("llama", dims=lost)], strict=False)
    assert g.entries[0].message == "dim cache.key_1.2 (past_seq) became static"
    assert g.entries[0].regression and g.failed


def test_the_graphs_of_a_renamed_input_are_compared_under_their_new_names():
    old = ModelResult("llama", "passed", graphs=[GraphResult("", dims=LM_DIMS),
                                                 GraphResult("with past_key_values", dims=CACHE_DIMS)])
    static_past = cache_renamed(CACHE_DIMS) | {"cache.value_0": {"0": "batch"}}
    now = ModelResult("llama", "passed", graphs=[GraphResult("", dims=LM_DIMS),
                                                 GraphResult("with cache", dims=static_past)])
    g = gate(baseline(old), [now], strict=False)
    assert g.entries[0].message == "[with cache] dim cache.value_0.2 (past_seq) became static"


def test_a_name_that_went_without_a_single_heir_is_no_rename():
    """Two new inputs could hold the old one's leaves: the old dims are lost, as before."""
    old = baseline(result("m", dims={"a.x": {"0": "batch"}}))
    now = result("m", dims={"b.x": {"0": "batch"}, "c.x": {"0": "batch"}})
    assert gate(old, [now], strict=False).entries[0].message == "dim a.x.0 (batch) became static"


def test_max_abs_growth_within_tolerance_is_a_note():
    old = baseline(result("lm", max_abs=3.1e-07, atol=1e-4))
    g = gate(old, [result("lm", max_abs=2e-05, atol=1e-4)], strict=False)
    grew = "max|Δ| grew 3.1e-07 → 2e-05, within tolerance"
    assert g.entries == [GateEntry("lm", "passed", notes=[grew])]
    assert not g.failed


def test_max_abs_beyond_tolerance_is_a_regression():
    old = baseline(result("lm", max_abs=3.1e-07, atol=1e-4))
    now = result("lm", "failed", stage="verify", kind="mismatch", max_abs=0.5, atol=1e-4)
    assert summary_line(gate(old, [now], strict=False)) == (
        "exportobs gate: 1 regression (lm: passed→failed at verify)"
    )


# -- known failures, fixed, missing, new ----------------------------------------------------------


def test_known_failure_is_xfailed_and_the_gate_passes():
    old = baseline(result("a"), result("b"), result("c"), result("lm", "failed", stage="torch.export"))
    now = [result("a"), result("b"), result("c"), result("lm", "failed", stage="torch.export")]
    g = gate(old, now, strict=True)
    assert g.entries[-1] == GateEntry("lm", "xfailed", "known failure at torch.export")
    assert not g.failed
    assert summary_line(g) == "exportobs gate: ok (3 passed, 1 known failure, 0 regressions)"


def test_incomplete_counts_as_failed():
    old = baseline(result("lm", "incomplete", stage="ort-load"), result("vit"))
    g = gate(old, [result("lm", "failed", stage="ort-load"), result("vit", "incomplete")], strict=False)
    assert [(e.outcome, e.message) for e in g.entries] == [
        ("xfailed", "known failure at ort-load"),
        ("failed", "passed→incomplete"),
    ]


def test_fixed_model_is_xpassed_with_a_hint():
    old = baseline(result("lm"), result("vit", "failed", stage="torch.export"))
    g = gate(old, [result("lm"), result("vit")], strict=False)
    fixed = "fixed: failed at torch.export in the baseline, passes now"
    assert g.entries[1] == GateEntry("vit", "xpassed", fixed)
    assert not g.failed
    assert summary_line(g) == f"exportobs gate: ok (1 passed, 1 fixed, 0 regressions); fixed: vit — {HINT}"


def test_fixed_model_fails_in_strict_mode():
    old = baseline(result("vit", "failed", stage="torch.export"))
    g = gate(old, [result("vit")], strict=True)
    message = f"fixed: failed at torch.export in the baseline, passes now (strict) — {HINT}"
    assert g.entries == [GateEntry("vit", "failed", message)]
    assert g.failed
    assert summary_line(g) == f"exportobs gate: 1 failure (vit: {message})"


def test_several_fixed_models_are_named_together():
    old = baseline(result("a", "failed"), result("b", "failed"))
    assert summary_line(gate(old, [result("a"), result("b")], strict=False)) == (
        "exportobs gate: ok (0 passed, 2 fixed, 0 regressions); "
        "fixed: a, b — run with --export-baseline-update to record them"
    )


def test_missing_model_is_reported_and_fails_in_strict_mode():
    old = baseline(result("gone"), result("lm"))
    g = gate(old, [result("lm")], strict=False)
    assert g.entries[0] == GateEntry("gone", "missing", "in the baseline but not observed")
    assert summary_line(g) == "exportobs gate: ok (1 passed, 1 missing, 0 regressions)"
    strict = gate(old, [result("lm")], strict=True)
    assert strict.failed
    assert summary_line(strict) == (
        "exportobs gate: 1 failure (gone: in the baseline but not observed (strict))"
    )


def test_a_model_whose_tests_were_not_collected_is_left_out_not_missing():
    old = baseline(result("lm", sources=["t.py::test_lm"]), result("vit", sources=["t.py::test_vit", "u.py::test_vit"]),
                   result("old"))  # no tests recorded: missing whenever it is not observed
    shard = gate(old, [result("lm", sources=["t.py::test_lm"])], strict=True, collected={"t.py::test_lm"})
    assert [(e.name, e.outcome) for e in shard.entries] == [("lm", "passed"), ("old", "failed")]
    assert shard.uncollected == ["vit"]
    assert summary_line(shard) == (
        "exportobs gate: 1 failure (old: in the baseline but not observed (strict)); "
        "1 baseline model not collected here")
    skipped = gate(old, [], collected={"u.py::test_vit"})  # collected but not observed (skipped test, ...)
    assert [(e.name, e.outcome) for e in skipped.entries] == [("old", "missing"), ("vit", "missing")]
    assert skipped.uncollected == ["lm"]


def test_model_absent_from_the_baseline_is_checked_on_its_own():
    old = baseline(result("lm"))
    g = gate(old, [result("lm"), result("new", "failed", stage="verify"), result("ok")], strict=False)
    assert g.entries == [
        GateEntry("lm", "passed"),
        GateEntry("new", "failed", "failed at verify", notes=["not in the baseline"]),
        GateEntry("ok", "passed", notes=["not in the baseline"]),
    ]
    assert g.failed
    assert summary_line(g) == "exportobs gate: 1 failure (new: failed at verify)"


def test_regressions_and_failures_in_one_line():
    old = baseline(result("lm"), result("vit", "failed"))
    now = [result("lm", "failed", stage="verify"), result("new", "failed"), result("vit")]
    assert summary_line(gate(old, now, strict=False)) == (
        "exportobs gate: 1 regression (lm: passed→failed at verify), 1 failure (new: failed); "
        f"fixed: vit — {HINT}"
    )


def test_skipped_model_is_skipped_whatever_the_baseline():
    old = baseline(result("lm", "failed", stage="verify"))
    g = gate(old, [result("lm", "skipped", reason="--export-target torch")], strict=True)
    assert g.entries == [GateEntry("lm", "skipped", "--export-target torch")]
    assert not g.failed


# -- the file ---------------------------------------------------------------------------------


def recorded() -> Baseline:
    return baseline(
        result("vit", "failed", stage="torch.export", kind="error", reason="boom", env={"torch": "2.9.0"}),
        result(
            "lm", dims=LM_DIMS, relations=["seq == past + 1"], max_abs=3.1e-07, atol=1e-4, rtol=0.1,
            opset=18, op_counts={"MatMul": 2, "Add": 1}, stage="variations", env={"onnx": "1.19.0"},
            sources=["test_lm.py::test_generate", "test_lm.py::test_forward"],
        ),
    )


EXPECTED_FILE = """\
{
  "env": {
    "onnx": "1.19.0",
    "torch": "2.9.0"
  },
  "models": {
    "lm": {
      "atol": 0.0001,
      "dims": {
        "input_ids": {
          "0": "batch",
          "1": "seq"
        }
      },
      "max_abs": 3.1e-07,
      "op_counts": {
        "Add": 1,
        "MatMul": 2
      },
      "opset": 18,
      "relations": [
        "seq == past + 1"
      ],
      "rtol": 0.1,
      "stage": "",
      "tests": [
        "test_lm.py::test_forward",
        "test_lm.py::test_generate"
      ],
      "verdict": "passed"
    },
    "vit": {
      "atol": null,
      "dims": {},
      "max_abs": null,
      "op_counts": {},
      "opset": null,
      "relations": [],
      "rtol": null,
      "stage": "torch.export",
      "tests": [],
      "verdict": "failed"
    }
  },
  "schema_version": 1
}
"""


def test_file_format_is_stable_sorted_and_versioned(tmp_path):
    path = recorded().write(tmp_path / "baseline.json")
    first = path.read_bytes()
    assert first.decode() == EXPECTED_FILE
    recorded().write(path)
    assert path.read_bytes() == first


def test_round_trip(tmp_path):
    path = recorded().write(tmp_path / "deep" / "er" / "baseline.json")
    assert Baseline.load(path) == recorded()


def test_baseline_copies_what_it_keeps():
    lm = result("lm", dims={"x": {"0": "batch"}})
    kept = Baseline.from_results([lm])
    lm.dims["x"]["1"] = "seq"
    assert kept.models["lm"] == BaselineEntry("passed", dims={"x": {"0": "batch"}})


def test_write_leaves_no_temporary_file(tmp_path):
    recorded().write(tmp_path / "baseline.json")
    recorded().write(tmp_path / "baseline.json")
    assert [p.name for p in tmp_path.iterdir()] == ["baseline.json"]


def test_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = baseline(result("old")).write(tmp_path / "baseline.json")
    before = path.read_bytes()

    def refuse(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="disk full"):
        recorded().write(path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["baseline.json"]


def test_missing_file(tmp_path):
    path = tmp_path / "nope.json"
    with pytest.raises(BaselineError) as info:
        Baseline.load(path)
    assert str(info.value) == f"{path}: cannot be read (No such file or directory)"


def assert_refused(path: Path, problem: str) -> None:
    """Loading fails with ``<path>: <problem>`` and leaves the file (and its directory) untouched."""
    before, stat = path.read_bytes(), path.stat()
    with pytest.raises(BaselineError) as info:
        Baseline.load(path)
    assert str(info.value) == f"{path}: {problem}"
    assert isinstance(info.value, ValueError)
    assert path.read_bytes() == before
    assert path.stat().st_mtime_ns == stat.st_mtime_ns
    assert [p.name for p in path.parent.iterdir()] == [path.name]


UNREADABLE = {
    "not json": ("hello", "not valid JSON (Expecting value at line 1, column 1)"),
    "truncated": (
        EXPECTED_FILE[: len(EXPECTED_FILE) // 2],
        "not valid JSON (Unterminated string starting at at line 25, column 7)",
    ),
    "top level": ("[]", "the top level must be an object, got []"),
    "no version": ('{"models": {}}', "no schema_version (not an exportobs baseline?)"),
    "future version": ('{"schema_version": 99}', "schema_version 99 is not supported (expected 1)"),
    "version as text": ('{"schema_version": "1"}', 'schema_version "1" is not supported (expected 1)'),
}


@pytest.mark.parametrize("text, problem", UNREADABLE.values(), ids=UNREADABLE.keys())
def test_unreadable_file(tmp_path, text, problem):
    path = tmp_path / "baseline.json"
    path.write_text(text)
    assert_refused(path, problem)


A_VERDICT = "one of failed, incomplete, passed, skipped"
WRONG_VALUES = [  # (keys to a value in a valid file, a wrong value, what the value must be)
    (["models"], [], "models must be an object"),
    (["env"], {"torch": 2}, "env must be an object of strings"),
    (["models", "lm"], "passed", "model 'lm' must be an object"),
    (["models", "lm", "verdict"], 3, f"model 'lm': verdict must be {A_VERDICT}"),
    (["models", "lm", "verdict"], "pased", f"model 'lm': verdict must be {A_VERDICT}"),
    (["models", "lm", "dims"], {"x": []}, "model 'lm': dims must be an object of {axis: dim name} objects"),
    (["models", "lm", "relations"], "a == b", "model 'lm': relations must be a list of strings"),
    (["models", "lm", "max_abs"], "big", "model 'lm': max_abs must be a number or null"),
    (["models", "lm", "opset"], True, "model 'lm': opset must be an integer or null"),
    (["models", "lm", "op_counts"], {"Add": 1.5}, "model 'lm': op_counts must be an object of integers"),
]


@pytest.mark.parametrize(
    "keys, value, must_be", WRONG_VALUES, ids=[f"{k[-1]}={json.dumps(v)}" for k, v, _ in WRONG_VALUES]
)
def test_wrong_value(tmp_path, keys, value, must_be):
    data = recorded().to_json()
    *parents, last = keys
    target = data
    for key in parents:
        target = target[key]
    target[last] = value
    path = tmp_path / "baseline.json"
    path.write_text(json.dumps(data))
    assert_refused(path, f"{must_be}, got {json.dumps(value)}")


def test_entry_without_verdict(tmp_path):
    data = recorded().to_json()
    del data["models"]["lm"]["verdict"]
    path = tmp_path / "baseline.json"
    path.write_text(json.dumps(data))
    assert_refused(path, "model 'lm' has no verdict")


def test_file_that_is_not_text(tmp_path):
    path = tmp_path / "baseline.json"
    path.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(BaselineError, match="not UTF-8 text"):
        Baseline.load(path)


def test_minimal_entries_get_defaults(tmp_path):
    path = tmp_path / "baseline.json"
    path.write_text('{"schema_version": 1, "models": {"lm": {"verdict": "passed"}}}')
    assert Baseline.load(path) == Baseline({"lm": BaselineEntry("passed")})


def test_versions_never_decide_an_outcome():
    old = baseline(result("lm", env={"torch": "2.8.0"}))
    now = result("lm", env={"torch": "2.9.0"})
    g = gate(old, [now], strict=True)
    assert g.entries == [GateEntry("lm", "passed")]
    assert (g.versions, g.changes, g.failed) == ({"torch": ("2.8.0", "2.9.0")}, [], False)


def test_a_recorded_file_s_versions_are_named_by_a_regression(tmp_path):
    path = tmp_path / "baseline.json"
    path.write_text(EXPECTED_FILE)
    now = result("lm", "failed", stage="verify", dims=LM_DIMS, env={"onnx": "1.19.0", "torch": "2.10.0"})
    assert gate(Baseline.load(path), [now]).entries[0].message == (
        "passed→failed at verify (passed with torch 2.9.0, fails with torch 2.10.0)"
    )


def test_paths_may_be_strings(tmp_path):
    path = recorded().write(str(tmp_path / "b.json"))
    assert path == tmp_path / "b.json"
    assert Baseline.load(str(path)) == recorded()


def test_marker_xfail_turns_a_failure_into_xfailed_and_a_pass_into_xpassed() -> None:
    failing = ModelResult(name="lm", verdict="failed", stage="torch.export", expected_failure="needs torch.cond")
    passing = ModelResult(name="vit", verdict="passed", stage="verify", expected_failure="marked xfail")
    entries = {e.name: e for e in gate(None, [failing, passing]).entries}
    assert (entries["lm"].outcome, entries["lm"].message) == ("xfailed", "expected failure: needs torch.cond")
    assert (entries["vit"].outcome, entries["vit"].message) == (
        "xpassed", "passes although marked xfail (marked xfail)")
    assert gate(None, [failing, passing], strict=True).failed
