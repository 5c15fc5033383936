"""Checks begun while the tests run (``--export-overlap auto``): they fill the export cache, the
check at the end reads it, and the verdicts are those of a session checking at the end only."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from models import MLP_CONFTEST
from models import SOURCE as MODELS

pytestmark = pytest.mark.slow  # pytest sessions in subprocesses

# the model's calls settle in the first test; the last test runs until a check of it has ended
# (its record in the export cache), as a suite's remaining tests would, at most WAIT seconds, and
# finds the exporter's modules imported in the check's process only
SETTLED = '''
import glob, os, sys, time
import pytest, torch

@pytest.mark.observe_export("mlp")
def test_two_batches(mlp):
    assert mlp(torch.randn(2, 8)).shape == (2, 4)
    assert mlp(torch.randn(5, 8)).shape == (5, 4)

def test_something_else():
    assert sum(range(4)) == 6

def test_slow_but_unrelated():
    deadline = time.monotonic() + float(os.environ["WAIT"])
    while not glob.glob(".exportobs/cache/check-*.json") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not {"pytest_exportobs.engine.check", "onnx", "onnxruntime"} & sys.modules.keys()
'''

# the same, and a later test records a call at a new batch size: the group has changed since its
# early check
CHANGED_LATER = SETTLED + '''
@pytest.mark.observe_export("mlp")
def test_batch_3_after_the_check(mlp):
    assert mlp(torch.randn(3, 8)).shape == (3, 4)
'''


def _session(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, overlap: str, tests: str,
) -> tuple[pytest.RunResult, dict]:
    """A first run (empty export directory) of ``tests`` with ``--export-overlap overlap`` (off:
    no test waits for a check)."""
    pytester.makepyfile(models=MODELS, conftest=MLP_CONFTEST, test_suite=tests)
    monkeypatch.setenv("WAIT", "240" if overlap == "auto" else "0")
    result = pytester.runpytest_subprocess("--export-check", "--export-examples=3", "--export-report=report.json",
                                           f"--export-overlap={overlap}", "-p", "no:cacheprovider")
    (model,) = json.loads((pytester.path / "report.json").read_text())["models"]
    return result, model


@pytest.fixture
def derandomized(monkeypatch: pytest.MonkeyPatch, pytester: pytest.Pytester) -> Path:
    """The same hypothesis examples in every session (as on CI); the sessions' temporary
    directory, where the early checks' export directory goes."""
    monkeypatch.setenv("CI", "true")
    scratch = pytester.path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    return scratch


def test_a_model_checked_during_the_tests_is_served_at_the_end_with_the_same_verdict(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, derandomized: Path,
) -> None:
    result, model = _session(pytester, monkeypatch, "auto", SETTLED)
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["exportobs: the checks of 1 model(s) began while the tests ran (--export-overlap)*"])
    (graph,) = model["graphs"]
    assert (model["verdict"], model["dims"], graph["calls"]) == ("passed", {"x": {"0": "batch"}}, [0, 1])
    assert graph["cache_hit"] and not {"torch.export", "decompose", "variations"} & graph["timings"].keys()
    assert any(note.startswith("verified as on an earlier check") for note in graph["notes"])
    assert (pytester.path / ".exportobs" / "mlp" / "model.onnx").is_file()  # the session's own files
    assert not list(derandomized.iterdir())  # the early check's export directory is removed

    shutil.rmtree(pytester.path / ".exportobs")
    result, alone = _session(pytester, monkeypatch, "off", SETTLED)
    result.assert_outcomes(passed=4)
    assert "began while the tests ran" not in result.stdout.str()
    (fresh,) = alone["graphs"]
    assert not fresh["cache_hit"] and "torch.export" in fresh["timings"]
    for key in ("verdict", "dims", "n_calls"):
        assert alone[key] == model[key]
    assert (fresh["variations"], fresh["discrepancies"]) == (graph["variations"], graph["discrepancies"])


def test_a_model_with_calls_recorded_after_its_early_check_is_checked_on_all_of_them(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, derandomized: Path,
) -> None:
    result, model = _session(pytester, monkeypatch, "auto", CHANGED_LATER)
    result.assert_outcomes(passed=5)
    (graph,) = model["graphs"]
    assert (model["verdict"], model["dims"], model["n_observations"]) == ("passed", {"x": {"0": "batch"}}, 3)
    # the early check compared two calls; the one recorded after it is compared at the end
    assert graph["calls"] == [0, 1, 2] and len(graph["discrepancies"]) == 3
    assert not any(note.startswith("verified as on an earlier check") for note in graph["notes"])


# two models settling one after the other; each waiting test waits for the early child before it
# to end (the session's children: the test runs in the session's process)
TWO_SETTLING = '''
import glob, multiprocessing, os, time
import pytest, torch
from models import MLP

@pytest.fixture(scope="module")
def first():
    torch.manual_seed(0)
    return MLP().eval()

@pytest.fixture(scope="module")
def second():
    torch.manual_seed(1)
    return MLP().eval()

def _wait(records):
    deadline = time.monotonic() + float(os.environ["WAIT"])
    while time.monotonic() < deadline and (
            len(glob.glob(".exportobs/cache/check-*.json")) < records or multiprocessing.active_children()):
        time.sleep(0.2)

@pytest.mark.observe_export("first")
def test_first(first):
    assert first(torch.randn(2, 8)).shape == (2, 4)
    assert first(torch.randn(5, 8)).shape == (5, 4)

def test_first_settles():
    pass

def test_first_checked():
    _wait(1)

@pytest.mark.observe_export("second")
def test_second(second):
    assert second(torch.randn(3, 8)).shape == (3, 4)
    assert second(torch.randn(6, 8)).shape == (6, 4)

def test_second_settles():
    _wait(1)

def test_second_checked():
    _wait(2)
'''


def test_a_rerun_ends_the_early_checks_once_a_child_finds_its_checks_recorded(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, derandomized: Path,
) -> None:
    """First run: each model checked early, one child after the other.  Rerun: the first child
    finds its model's check recorded and ends; no child is forked for the second model, which
    the session's check serves from the cache all the same."""
    pytester.makepyfile(models=MODELS, test_suite=TWO_SETTLING)
    monkeypatch.setenv("WAIT", "240")
    args = ("--export-check", "--export-examples=3", "--export-report=report.json", "-p", "no:cacheprovider")
    verdicts = []
    for began in (2, 1):
        result = pytester.runpytest_subprocess(*args)
        result.assert_outcomes(passed=8)
        result.stdout.fnmatch_lines([f"exportobs: the checks of {began} model(s) began while the tests ran*"])
        models = json.loads((pytester.path / "report.json").read_text())["models"]
        verdicts.append(sorted((m["name"], m["verdict"], m["graphs"][0]["cache_hit"]) for m in models))
    assert verdicts == [[("first", "passed", True), ("second", "passed", True)]] * 2
