"""The result model: graphs are the unit, the model's summaries derive from them; pure Python."""

from __future__ import annotations

import json

from pytest_exportobs.engine.base.result import GraphResult, ModelResult

PREFILL = {"input_ids": {"0": "batch", "1": "seq"}}
DECODE = {"input_ids": {"0": "batch"}, "past_key_values.0": {"0": "batch", "2": "past"}}


def two_graphs() -> ModelResult:
    result = ModelResult("lm", "failed", model_notes=["2 input structures"], model_timings={"infer": 0.5},
                         inferred={"dims": PREFILL, "relations": [], "bounds": {"batch": [2, 3]}})
    prefill = GraphResult(
        "prefill", "passed", dims=PREFILL, max_abs=1e-6, notes=["probed"], opset=18,
        timings={"torch.export": 2.0, "verify": 0.25}, variations={"tried": 5, "valid": 4, "invalid": 1, "failed": 0},
    )
    decode = GraphResult(
        "decode", "failed", "verify", "mismatch", "call 3: 2 values beyond tolerance", dims=DECODE, max_abs=0.5,
        notes=["cache hit"], timings={"torch.export": 1.0},
        variations={"tried": 3, "valid": 3, "invalid": 0, "failed": 1},
    )
    result.conclude([prefill, decode], "")
    return result


def test_the_model_concludes_from_its_first_failing_graph_and_summarizes_them_all():
    result = two_graphs()
    assert (result.verdict, result.stage, result.kind) == ("failed", "verify", "mismatch")
    assert result.reason == "[decode] call 3: 2 values beyond tolerance"
    assert (result.dims, result.opset, result.max_abs) == (PREFILL, 18, 0.5)
    assert result.notes == ["2 input structures", "[prefill] probed", "[decode] cache hit"]
    assert result.timings == {"infer": 0.5, "torch.export": 3.0, "verify": 0.25}
    assert result.variations == {"tried": 8, "valid": 7, "invalid": 1, "failed": 1}


def test_json_carries_the_summaries_and_reads_back_the_same_result():
    result = two_graphs()
    data = json.loads(json.dumps(result.to_json()))
    assert (data["dims"], data["max_abs"], data["timings"]["torch.export"]) == (PREFILL, 0.5, 3.0)
    assert data["notes"] == ["2 input structures", "[prefill] probed", "[decode] cache hit"]
    again = ModelResult.from_json(data)
    assert again == result
    assert again.to_json() == data  # nothing added up twice


def test_before_any_graph_the_dims_are_the_inferred_ones():
    result = ModelResult("lm", "failed", "infer", inferred={"dims": PREFILL, "relations": ["seq == past + 1"]})
    assert (result.dims, result.relations) == (PREFILL, ["seq == past + 1"])
    assert (result.max_abs, result.onnx_path, result.notes) == (None, "", [])
    hand_written = {"name": "lm", "verdict": "passed", "dims": DECODE}  # a report without graphs
    assert ModelResult.from_json(hand_written).dims == DECODE
