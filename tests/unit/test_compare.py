"""``python -m pytest_exportobs.compare old.json new.json``: two JSON reports side by side."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pytest_exportobs.engine.base.result import GraphResult, ModelResult
from pytest_exportobs.gate.compare import main
from pytest_exportobs.gate.reports import write_reports

OLD_ENV = {"onnx": "1.19.0", "torch": "2.13.0", "transformers": "5.23.0"}
NEW_ENV = {**OLD_ENV, "torch": "2.15.0"}
LM_DIMS = {"input_ids": {"0": "batch", "1": "seq"}}


def report(path: Path, env: dict[str, str], *results: ModelResult) -> str:
    for r in results:
        r.env = dict(env)
    write_reports(path, results, None, env)
    return str(path)


@pytest.fixture
def upgrade(tmp_path: Path) -> tuple[str, str]:
    """Reports before and after a torch upgrade that breaks ``mlp`` and fixes ``vit``."""
    old = report(
        tmp_path / "old.json", OLD_ENV,
        ModelResult("lm", "passed", stage="variations", graphs=[GraphResult("", dims=LM_DIMS)]),
        ModelResult("mlp", "passed", stage="variations", graphs=[GraphResult("", dims={"x": {"0": "batch"}})]),
        ModelResult("vit", "failed", stage="torch.export", graphs=[GraphResult("", dims={})]),
    )
    new = report(
        tmp_path / "new.json", NEW_ENV,
        ModelResult("extra", "failed", stage="infer"),
        ModelResult("lm", "passed", stage="variations", graphs=[GraphResult("", dims=LM_DIMS)]),
        ModelResult("mlp", "failed", stage="torch.export", graphs=[GraphResult("", dims={"x": {"0": "batch"}})]),
        ModelResult("vit", "passed", stage="variations", graphs=[GraphResult("", dims={"pixels": {"0": "batch"}})]),
    )
    return old, new


REGRESSION = "mlp: passed→failed at torch.export (passed with torch 2.13.0, fails with torch 2.15.0)"
SUMMARY = f"exportobs compare: 4 models, 3 changed, 1 regression ({REGRESSION})"
EXPECTED_TEXT = f"""\
versions changed: torch 2.13.0 → 2.15.0
extra  before     absent
       now        failed at infer
lm     unchanged  passed, input_ids{{0:batch,1:seq}}
mlp    before     passed, x{{0:batch}}
       now        failed at torch.export, x{{0:batch}}
vit    before     failed at torch.export, static
       now        passed, pixels{{0:batch}}
{SUMMARY}
"""


def test_an_upgrade_that_breaks_a_model(upgrade, capsys):
    assert main(list(upgrade)) == 1
    assert capsys.readouterr() == (EXPECTED_TEXT, "")


def test_markdown(upgrade, capsys):
    assert main([*upgrade, "--markdown"]) == 1
    assert capsys.readouterr().out == f"""\
# exportobs compare

Versions changed: torch 2.13.0 → 2.15.0

| model | before | now |
| --- | --- | --- |
| extra | absent | failed at infer |
| lm | passed, input_ids{{0:batch,1:seq}} | unchanged |
| mlp | passed, x{{0:batch}} | failed at torch.export, x{{0:batch}} |
| vit | failed at torch.export, static | passed, pixels{{0:batch}} |

{SUMMARY}
"""


def test_no_regression_exits_zero(tmp_path, capsys):
    old = report(tmp_path / "old.json", OLD_ENV, ModelResult("lm", "passed", graphs=[GraphResult("", dims=LM_DIMS)]))
    new = report(tmp_path / "new.json", OLD_ENV, ModelResult("lm", "passed", graphs=[GraphResult("", dims=LM_DIMS)]))
    assert main([old, new]) == 0
    assert capsys.readouterr().out == """\
versions changed: none
lm  unchanged  passed, input_ids{0:batch,1:seq}
exportobs compare: 1 model, 0 changed, no regression
"""


def test_a_dim_that_became_static_is_a_regression(tmp_path, capsys):
    old = report(tmp_path / "old.json", OLD_ENV, ModelResult("lm", "passed", graphs=[GraphResult("", dims=LM_DIMS)]))
    new = report(tmp_path / "new.json", NEW_ENV,
                 ModelResult("lm", "passed", graphs=[GraphResult("", dims={"input_ids": {"0": "batch"}})]))
    assert main([old, new]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == (
        "exportobs compare: 1 model, 1 changed, 1 regression "
        "(lm: dim input_ids.1 (seq) became static (dynamic with torch 2.13.0, static with torch 2.15.0))"
    )


def test_python_m_runs_the_comparison(upgrade):
    done = subprocess.run([sys.executable, "-m", "pytest_exportobs.compare", *upgrade], capture_output=True, text=True)
    assert (done.returncode, done.stdout, done.stderr) == (1, EXPECTED_TEXT, "")


def test_comparing_imports_no_torch(upgrade):
    code = ("import sys; from pytest_exportobs.gate.compare import main; main(sys.argv[1:]); "
            "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code, *upgrade], capture_output=True, text=True)
    assert done.stdout.splitlines()[-1] == "False"


def bad_report(path: Path, content: str) -> str:
    path.write_text(content)
    return str(path)


BAD = {
    "not json": ("hello", "not valid JSON (Expecting value at line 1, column 1)"),
    "no version": ('{"models": []}', "no schema_version (not an exportobs report?)"),
    "future version": ('{"schema_version": 2, "models": []}', "schema_version 2 is not supported (expected 1)"),
    "a baseline": (
        '{"schema_version": 1, "env": {}, "models": {"lm": {"verdict": "passed"}}}',
        'models must be a list of objects, got {"lm": {"verdict": "passed"}}',
    ),
    "no name": (
        '{"schema_version": 1, "models": [{"verdict": "passed"}]}',
        "models[0].name must be a string, got null",
    ),
    "bad verdict": (
        '{"schema_version": 1, "models": [{"name": "lm", "verdict": "ok"}]}',
        "model 'lm': verdict must be one of failed, incomplete, passed, skipped, got \"ok\"",
    ),
    "bad env": (
        '{"schema_version": 1, "models": [{"name": "lm", "verdict": "passed", "env": {"torch": 2}}]}',
        "model 'lm': env must be an object of strings, got {\"torch\": 2}",
    ),
}


@pytest.mark.parametrize("content, problem", BAD.values(), ids=BAD.keys())
def test_a_file_that_is_no_report_is_a_usage_error(tmp_path, upgrade, capsys, content, problem):
    path = bad_report(tmp_path / "bad.json", content)
    assert main([upgrade[0], path]) == 2
    assert capsys.readouterr() == ("", f"exportobs compare: error: {path}: {problem}\n")


def test_a_missing_file_is_a_usage_error(tmp_path, upgrade, capsys):
    missing = tmp_path / "nope.json"
    assert main([str(missing), upgrade[1]]) == 2
    assert capsys.readouterr() == (
        "", f"exportobs compare: error: {missing}: cannot be read (No such file or directory)\n")


def test_wrong_arguments_are_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["only-one.json"])
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "python -m pytest_exportobs.compare: error: the following arguments are required: new"
    )



def test_shards_merge_keeping_the_result_that_says_least_and_every_test(tmp_path: Path) -> None:
    """``python -m pytest_exportobs.merge``: a model two shards observed keeps the failure of one."""
    from pytest_exportobs.gate.merge import main as merge
    from pytest_exportobs.gate.reports import Report

    first = report(tmp_path / "a.json", OLD_ENV,
                   ModelResult("lm", "passed", stage="variations", sources=["test_a.py::test_lm"]),
                   ModelResult("mlp", "skipped", sources=["test_a.py::test_mlp"]))
    second = report(tmp_path / "b.json", OLD_ENV,
                    ModelResult("lm", "failed", stage="verify", sources=["test_b.py::test_lm"]),
                    ModelResult("mlp", "passed", stage="verify", sources=["test_b.py::test_mlp"]))
    assert merge([first, second, "--report", str(tmp_path / "merged.json")]) == 1  # lm failed: no baseline
    merged = {r.name: r for r in Report.load(tmp_path / "merged.json").results}
    assert {name: (r.verdict, r.stage, r.sources) for name, r in merged.items()} == {
        "lm": ("failed", "verify", ["test_a.py::test_lm", "test_b.py::test_lm"]),
        "mlp": ("skipped", "", ["test_a.py::test_mlp", "test_b.py::test_mlp"]),
    }
    assert (tmp_path / "merged.md").exists()
    with pytest.raises(SystemExit):
        merge([first, "--report", str(tmp_path / "m.json"), "--baseline-update"])  # needs --baseline
    assert merge([str(tmp_path / "missing.json"), "--report", str(tmp_path / "m.json")]) == 2
