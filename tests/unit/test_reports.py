"""JSON and Markdown reports; pure Python, no torch."""

from __future__ import annotations

import json

from pytest_exportobs.engine.base.result import GraphResult, ModelResult
from pytest_exportobs.gate.baseline import Baseline
from pytest_exportobs.gate.judge import gate
from pytest_exportobs.gate.reports import write_reports

ENV = {"torch": "2.10.0", "onnx": "1.19.0"}
LM_DIMS = {"input_ids": {"0": "batch", "1": "seq"}}
REGRESSION = "vit: passed→failed at torch.export (passed with torch 2.9.0, fails with torch 2.10.0)"


def results() -> list[ModelResult]:
    return [
        ModelResult(
            "vit", "failed", stage="torch.export", kind="error", reason="data-dependent branch at m.py:41",
            repro_path=".exportobs/vit/repro.py", n_observations=1, env=ENV,
            graphs=[GraphResult("", timings={"export": 0.5})],
        ),
        ModelResult(
            "lm", "passed", n_observations=2, env=ENV,
            graphs=[GraphResult("", dims=LM_DIMS, max_abs=3.1e-07, runtime="onnxruntime",
                                timings={"export": 1.0, "verify": 0.25})],
        ),
    ]


def session_gate():
    old = Baseline.from_results([
        ModelResult("gone", "passed"),
        ModelResult("lm", "passed", env={"torch": "2.9.0", "onnx": "1.19.0"},
                    graphs=[GraphResult("", dims=LM_DIMS, max_abs=1e-07)]),
        ModelResult("vit", "passed"),
    ])
    return gate(old, results(), strict=False)


EXPECTED_MARKDOWN = """\
# exportobs report

exportobs gate: 1 regression (vit: passed→failed at torch.export (passed with torch 2.9.0, fails with torch 2.10.0))

| model | outcome | stage | dynamic dims | obs | max abs Δ | verified by | time |
| --- | --- | --- | --- | --- | --- | --- | --- |
| gone | missing |  |  |  |  |  |  |
| lm | passed |  | `input_ids{0:batch,1:seq}` | 2 | 3.1e-07 | onnxruntime | 1.2 s |
| vit | failed | torch.export | `static` | 1 |  |  | 0.5 s |

## Changed since baseline

| model | before | now | versions changed |
| --- | --- | --- | --- |
| gone | passed, static | absent | torch 2.9.0 → 2.10.0 |
| vit | passed, static | failed at torch.export, static | torch 2.9.0 → 2.10.0 |

## Notes

- lm: max|Δ| grew 1e-07 → 3.1e-07, within tolerance

## vit: failed

passed→failed at torch.export (passed with torch 2.9.0, fails with torch 2.10.0)

- stage: `torch.export` (error)
- repro: `.exportobs/vit/repro.py`

```text
data-dependent branch at m.py:41
```

Environment: onnx 1.19.0, torch 2.10.0
"""


def test_json_and_markdown(tmp_path):
    paths = write_reports(tmp_path / "out" / "report.json", results(), session_gate(), ENV)
    assert paths == [tmp_path / "out" / "report.json", tmp_path / "out" / "report.md"]
    vit, lm = results()
    assert json.loads(paths[0].read_text()) == {
        "schema_version": 1,
        "env": ENV,
        "gate": {
            "failed": True,
            "summary": f"exportobs gate: 1 regression ({REGRESSION})",
            "entries": [
                {"name": "gone", "outcome": "missing", "message": "in the baseline but not observed",
                 "regression": False, "notes": []},
                {"name": "lm", "outcome": "passed", "message": "", "regression": False,
                 "notes": ["max|Δ| grew 1e-07 → 3.1e-07, within tolerance"]},
                {"name": "vit", "outcome": "failed", "message": REGRESSION.removeprefix("vit: "),
                 "regression": True, "notes": []},
            ],
            "versions": {"torch": ["2.9.0", "2.10.0"]},
            "changes": [
                {"name": "gone", "before": "passed, static", "now": "absent"},
                {"name": "vit", "before": "passed, static", "now": "failed at torch.export, static"},
            ],
            "uncollected": [],
        },
        "models": [lm.to_json(), vit.to_json()],
    }
    assert paths[1].read_text() == EXPECTED_MARKDOWN
    assert sorted(p.name for p in paths[0].parent.iterdir()) == ["report.json", "report.md"]


def test_reports_are_deterministic(tmp_path):
    first = write_reports(tmp_path / "a.json", results(), session_gate(), ENV)
    second = write_reports(tmp_path / "b.json", results()[::-1], session_gate(), dict(reversed(ENV.items())))
    assert [p.read_bytes() for p in first] == [p.read_bytes() for p in second]
    assert first[0].read_text().endswith("}\n")


def test_without_gate_the_verdict_is_the_outcome(tmp_path):
    json_path, md_path = write_reports(tmp_path / "report.json", results(), None, {})
    assert json.loads(json_path.read_text())["gate"] is None
    assert md_path.read_text() == """\
# exportobs report

| model | outcome | stage | dynamic dims | obs | max abs Δ | verified by | time |
| --- | --- | --- | --- | --- | --- | --- | --- |
| lm | passed |  | `input_ids{0:batch,1:seq}` | 2 | 3.1e-07 | onnxruntime | 1.2 s |
| vit | failed | torch.export | `static` | 1 |  |  | 0.5 s |

## vit: failed

- stage: `torch.export` (error)
- repro: `.exportobs/vit/repro.py`

```text
data-dependent branch at m.py:41
```
"""


def test_known_failure_and_regression_without_failed_verdict_get_sections(tmp_path):
    old = Baseline.from_results([
        ModelResult("known", "failed", stage="verify"),
        ModelResult("vit", "passed", graphs=[GraphResult("", dims={"x": {"2": "h"}})]),
    ])
    now = [ModelResult("known", "failed", stage="verify", kind="mismatch"), ModelResult("vit", "passed")]
    _, md_path = write_reports(tmp_path / "report.json", now, gate(old, now, strict=False), {})
    sections = md_path.read_text().split("\n## ")[1:]
    assert sections == [
        "Changed since baseline\n\n| model | before | now | versions changed |\n| --- | --- | --- | --- |\n"
        "| vit | passed, x{2:h} | passed, static | none |\n",
        "known: xfailed\n\nknown failure at verify\n\n- stage: `verify` (mismatch)\n",
        "vit: failed\n\ndim x.2 (h) became static\n",
    ]


def test_table_cells_are_escaped(tmp_path):
    odd = ModelResult("a|b", "skipped")
    _, md_path = write_reports(tmp_path / "r.json", [odd], None, {})
    assert "| a\\|b | skipped |  | `static` | 0 |  |  | 0.0 s |" in md_path.read_text().splitlines()


def test_a_localized_mismatch_lists_its_nodes(tmp_path):
    node = {"value": "gelu", "torch_op": "aten.gelu.default", "onnx_ops": ["Relu"], "onnx_node": "node_gelu",
            "line": "m.py:7: return gelu(x)", "dtype": "float32", "introduced": 0.17, "accumulated": None,
            "beyond": True}
    graph = GraphResult("", kind="mismatch", localization={"compared": 6, "first": node, "largest": [node]})
    failed = ModelResult("mlp", "failed", stage="verify", kind="mismatch", reason="first diverging op: Relu",
                         graphs=[graph])
    _, md_path = write_reports(tmp_path / "report.json", [failed], None, {})
    assert md_path.read_text().split("```\n\n", 1)[1] == (
        "Largest errors a node introduces on torch's own inputs (`python repro.py --localize` prints them again):\n\n"
        "| tolerance | ONNX ops | node | torch op | source line | max Δ introduced | max Δ accumulated |\n"
        "| --- | --- | --- | --- | --- | --- | --- |\n"
        "| **beyond** | Relu | `node_gelu` | `aten.gelu.default` | `m.py:7: return gelu(x)` | 0.17 | inf |\n")
