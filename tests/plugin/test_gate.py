"""The baseline gate in real pytest sessions: record, known failure, regression, fix (with -n 2);
updates of a subset, pruning, concurrent updates."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pytest_exportobs.engine.base.result import ModelResult
from pytest_exportobs.gate.baseline import Baseline, BaselineEntry, update_baseline

from models import SOURCE as MODELS

pytestmark = pytest.mark.slow  # pytest sessions in subprocesses

TESTS = '''
import os
import pytest, torch
from models import MLP, Branchy

@pytest.fixture
def mlp():
    torch.manual_seed(0)
    return MLP().eval()

@pytest.mark.observe_export("mlp", static=("x:0",) if os.environ.get("STATIC_MLP") else ())
def test_mlp(mlp):
    mlp(torch.randn(2, 8))
    if not os.environ.get("STATIC_MLP"):
        mlp(torch.randn(5, 8))

def test_branchy(export_observer):
    model = export_observer.watch(Branchy(), name="branchy")
    model(torch.randn(2, 4))
    model(torch.randn(3, 4))
'''

ARGS = ("--export-check", "--export-target=torch", "--export-baseline=baseline.json", "--export-examples=0",
        "-p", "no:cacheprovider", "-rA")


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_record_gate_break_and_fix(pytester: pytest.Pytester, workers: list[str]) -> None:
    pytester.makepyfile(models=MODELS, test_models=TESTS)

    recorded = pytester.runpytest_subprocess(*ARGS, "--export-baseline-update", *workers)
    assert recorded.ret == 0
    baseline = json.loads((pytester.path / "baseline.json").read_text())
    assert {name: entry["verdict"] for name, entry in baseline["models"].items()} == {
        "branchy": "failed", "mlp": "passed"}
    assert baseline["models"]["mlp"]["dims"] == {"x": {"0": "batch"}}

    again = pytester.runpytest_subprocess(*ARGS, *workers)
    assert again.ret == 0
    again.assert_outcomes(passed=3, xfailed=1)
    again.stdout.fnmatch_lines(["exportobs gate: ok (1 passed, 1 known failure, 0 regressions)"])

    working = (pytester.path / "models.py").read_text()
    forward = "return self.l2(torch.relu(self.l1(x)))"
    pytester.makepyfile(models=working.replace(forward, f"{forward} if x.sum() > 0 else x[:, :4]"))
    broken = pytester.runpytest_subprocess(*ARGS, *workers)
    assert broken.ret == 1
    broken.assert_outcomes(passed=2, failed=1, xfailed=1)
    broken.stdout.fnmatch_lines(["exportobs gate: 1 regression (mlp: passed→failed at torch.export)"])

    pytester.makepyfile(models=working)
    fixed = pytester.runpytest_subprocess(*ARGS, *workers)
    assert fixed.ret == 0
    assert (pytester.path / "baseline.json").read_text() == json.dumps(baseline, indent=2, sort_keys=True) + "\n"


def test_dim_that_becomes_static_is_a_regression(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makepyfile(models=MODELS, test_models=TESTS)
    assert pytester.runpytest_subprocess(*ARGS, "--export-baseline-update").ret == 0
    monkeypatch.setenv("STATIC_MLP", "1")
    result = pytester.runpytest_subprocess(*ARGS)
    assert result.ret == 1
    result.stdout.fnmatch_lines(["exportobs gate: 1 regression (mlp: dim x.0 (batch) became static)"])


def test_regression_names_the_versions_changed_since_the_baseline(pytester: pytest.Pytester) -> None:
    """A baseline recorded with another transformers; the model breaks: the gate line, the Markdown
    report and a comparison of the two reports name both versions."""
    pytester.makepyfile(models=MODELS, test_models=TESTS)
    assert pytester.runpytest_subprocess(*ARGS, "--export-baseline-update", "--export-report=old.json").ret == 0
    baseline = json.loads((pytester.path / "baseline.json").read_text())
    installed = baseline["env"]["transformers"]
    baseline["env"]["transformers"] = "4.56.2"  # as if recorded with transformers 4.56.2
    (pytester.path / "baseline.json").write_text(json.dumps(baseline))
    old = json.loads((pytester.path / "old.json").read_text())
    for model in old["models"]:
        model["env"]["transformers"] = "4.56.2"
    (pytester.path / "old.json").write_text(json.dumps(old))
    working = (pytester.path / "models.py").read_text()
    forward = "return self.l2(torch.relu(self.l1(x)))"
    pytester.makepyfile(models=working.replace(forward, f"{forward} if x.sum() > 0 else x[:, :4]"))

    broken = pytester.runpytest_subprocess(*ARGS, "--export-report=new.json")
    assert broken.ret == 1
    regression = ("mlp: passed→failed at torch.export "
                  f"(passed with transformers 4.56.2, fails with transformers {installed})")
    broken.stdout.fnmatch_lines([f"exportobs gate: 1 regression ({regression})"])
    changed = (pytester.path / "new.md").read_text().split("## Changed since baseline\n\n")[1].split("\n\n")[0]
    assert changed.splitlines() == [
        "| model | before | now | versions changed |",
        "| --- | --- | --- | --- |",
        f"| mlp | passed, x{{0:batch}} | failed at torch.export, x{{0:batch}} | transformers 4.56.2 → {installed} |",
    ]
    compared = pytester.run(sys.executable, "-m", "pytest_exportobs.compare", "old.json", "new.json")
    assert compared.ret == 1
    assert compared.outlines[-1] == f"exportobs compare: 2 models, 1 changed, 1 regression ({regression})"


def test_fixed_model_is_xpassed_and_fails_when_strict(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(models=MODELS, test_models=TESTS)
    entry = {"verdict": "failed", "stage": "torch.export", "dims": {}, "relations": [], "max_abs": None,
             "atol": None, "rtol": None, "opset": None, "op_counts": {}}
    (pytester.path / "baseline.json").write_text(json.dumps(
        {"schema_version": 1, "env": {}, "models": {"mlp": entry, "branchy": entry, "gone": entry}}))
    result = pytester.runpytest_subprocess(*ARGS)
    assert result.ret == 0
    result.assert_outcomes(passed=2, xfailed=1, xpassed=1, skipped=1)
    result.stdout.fnmatch_lines(["*fixed: mlp*--export-baseline-update*"])
    strict = pytester.runpytest_subprocess(*ARGS, "--export-strict")
    assert strict.ret == 1
    strict.assert_outcomes(passed=2, failed=2, xfailed=1)


@pytest.mark.parametrize("content", ['{"schema_version": 1, "models": {"mlp": {"verd', "not json at all",
                                     '{"schema_version": 99, "models": {}}'],
                         ids=["truncated", "not-json", "schema"])
def test_bad_baseline_is_a_usage_error_and_stays_untouched(pytester: pytest.Pytester, content: str) -> None:
    pytester.makepyfile(models=MODELS, test_models=TESTS)
    path = pytester.path / "baseline.json"
    path.write_text(content)
    result = pytester.runpytest(*ARGS)  # in process: the session stops at configure, before any model
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*baseline.json*"])
    assert path.read_text() == content


def test_reports_are_written(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(models=MODELS, test_models=TESTS)
    result = pytester.runpytest_subprocess("--export-check", "--export-examples=0", "--export-report=out/report.json",
                                           "-p", "no:cacheprovider")
    assert result.ret == 1
    report = json.loads((pytester.path / "out" / "report.json").read_text())
    assert sorted(m["name"] for m in report["models"]) == ["branchy", "mlp"]
    assert "| mlp | passed |" in (pytester.path / "out" / "report.md").read_text()


# -- updates: partial runs, pruning, concurrent sessions ---------------------------------------


def entries(pytester: pytest.Pytester) -> dict[str, str]:
    return {name: e["verdict"]
            for name, e in json.loads((pytester.path / "baseline.json").read_text())["models"].items()}


def test_an_update_of_a_subset_keeps_the_other_entries_until_pruned(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(models=MODELS, test_models=TESTS)
    assert pytester.runpytest_subprocess(*ARGS, "--export-baseline-update").ret == 0

    subset = pytester.runpytest_subprocess(*ARGS, "--export-baseline-update", "-k", "mlp")
    assert subset.ret == 0
    subset.stdout.fnmatch_lines(["exportobs: baseline */baseline.json updated: 1 written, 1 kept (not checked in "
                                 "this session: branchy; --export-baseline-prune removes them)"])
    assert entries(pytester) == {"branchy": "failed", "mlp": "passed"}

    pruned = pytester.runpytest_subprocess(*ARGS, "--export-baseline-update", "--export-baseline-prune", "-k", "mlp")
    assert pruned.ret == 0
    pruned.stdout.fnmatch_lines(["exportobs: baseline */baseline.json updated: 1 written, 1 pruned (branchy)"])
    assert entries(pytester) == {"mlp": "passed"}


@pytest.mark.parametrize(("args", "message"), [
    (["--export-baseline=b.json", "--export-baseline-update"],
     "ERROR: --export-baseline-update needs --export-check (or ini export_check = true): "
     "without the check there is nothing to record"),
    (["--export-check", "--export-baseline=b.json", "--export-baseline-prune"],
     "ERROR: --export-baseline-prune only applies with --export-baseline-update"),
], ids=["update-without-check", "prune-without-update"])
def test_update_options_without_what_they_need_are_usage_errors(
    pytester: pytest.Pytester, args: list[str], message: str
) -> None:
    pytester.makepyfile(models=MODELS, test_models=TESTS)
    result = pytester.runpytest(*args, "-p", "no:cacheprovider")  # in process: it stops at configure
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])
    assert not (pytester.path / "b.json").exists()


def test_an_unreadable_old_baseline_is_replaced_by_an_update_and_said_so(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(models=MODELS, test_models=TESTS)
    (pytester.path / "baseline.json").write_text("not json")
    result = pytester.runpytest_subprocess(*ARGS, "--export-baseline-update")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["exportobs: baseline */baseline.json updated: 2 written; the old file was unreadable "
                                 "and is replaced "
                                 "(*baseline.json: not valid JSON (Expecting value at line 1, column 1))"])
    assert entries(pytester) == {"branchy": "failed", "mlp": "passed"}


def test_two_sessions_updating_one_baseline_at_once_keep_both_entries(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(models=MODELS, test_models=TESTS)
    command = [sys.executable, "-m", "pytest", *ARGS, "--export-baseline-update"]
    sessions = [pytester.popen([*command, "-k", name], stdin=subprocess.DEVNULL) for name in ("mlp", "branchy")]
    outputs = [session.communicate(timeout=300) for session in sessions]  # reads and closes the pipes
    assert [session.returncode for session in sessions] == [0, 0], outputs
    assert entries(pytester) == {"branchy": "failed", "mlp": "passed"}


def test_an_update_waits_for_the_lock_and_merges_what_was_written_meanwhile(tmp_path: Path) -> None:
    fcntl = pytest.importorskip("fcntl")
    path = tmp_path / "baseline.json"
    Baseline({"old": BaselineEntry("passed")}).write(path)
    with open(tmp_path / ".baseline.json.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another session is updating
        update = threading.Thread(target=update_baseline, args=(path, [ModelResult("new", "passed")], ["new"]))
        update.start()
        update.join(0.5)
        assert update.is_alive()
        Baseline({"old": BaselineEntry("passed"), "theirs": BaselineEntry("failed", "verify")}).write(path)
    update.join(30)
    assert sorted(Baseline.load(path).models) == ["new", "old", "theirs"]
