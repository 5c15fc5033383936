"""A suite written as transformers writes its model tests, observed whole: every structure at once.

One model class called with 2-D int masks, a bool mask, a custom 4-D float mask, single- and
multi-label targets of rank 1 and 2, ``output_hidden_states=True, return_dict=False``, and a
bfloat16 copy.  Expected outcomes, decided without the plugin: each call structure exports and
serves its calls (the float32 groups pass, their ONNX serving held-out sizes); the bfloat16 copy
exports, onnxruntime's CPU provider cannot run it, widened to float32 and rounded at each op's
outputs it does (passed, its runtime named); ordinary tests keep their outcomes.
"""

from __future__ import annotations

import json

import numpy as np
import onnxruntime
import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification  # imported before pytester snapshots modules

from models import junit_cases

pytestmark = pytest.mark.slow  # the example suite's sessions

TEST_BERT = '''
import pytest, torch
from transformers import BertConfig, BertForSequenceClassification

def config(**kwargs):
    return BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=37, max_position_embeddings=64, num_labels=3, **kwargs)

@pytest.fixture
def inputs():
    torch.manual_seed(0)
    ids = torch.randint(1, 99, (13, 7))
    mask = torch.ones(13, 7, dtype=torch.long)
    mask[:4, :2] = 0  # a padded batch
    return ids, mask

def check(export_observer, problem_type=None, dtype=torch.float32):
    torch.manual_seed(0)
    model = BertForSequenceClassification(config(problem_type=problem_type)).to(dtype).eval()
    return export_observer.watch(model)

def test_logits(export_observer, inputs):
    ids, mask = inputs
    assert check(export_observer)(input_ids=ids, attention_mask=mask).logits.shape == (13, 3)

def test_other_sizes(export_observer):
    model = check(export_observer)
    model(input_ids=torch.randint(1, 99, (2, 9)), attention_mask=torch.ones(2, 9, dtype=torch.long))

def test_bool_mask(export_observer, inputs):
    ids, mask = inputs
    check(export_observer)(input_ids=ids, attention_mask=mask.bool())

def test_custom_4d_mask(export_observer, inputs):
    ids, _ = inputs
    mask4d = torch.zeros(13, 1, 7, 7)
    check(export_observer)(input_ids=ids, attention_mask=mask4d)

def test_single_label(export_observer, inputs):
    ids, mask = inputs
    out = check(export_observer)(input_ids=ids, attention_mask=mask, labels=torch.randint(0, 3, (13,)))
    assert out.loss.dim() == 0

def test_hidden_states_as_tuple(export_observer, inputs):
    ids, mask = inputs
    out = check(export_observer)(input_ids=ids, attention_mask=mask, output_hidden_states=True, return_dict=False)
    assert len(out) == 2 and len(out[1]) == 3

def test_multi_label(export_observer, inputs):
    ids, mask = inputs
    model = check(export_observer, problem_type="multi_label_classification")
    out = model(input_ids=ids, attention_mask=mask, labels=torch.randint(0, 2, (13, 3)).float())
    assert out.loss.dim() == 0

def test_bfloat16(export_observer, inputs):
    ids, mask = inputs
    check(export_observer, dtype=torch.bfloat16)(input_ids=ids, attention_mask=mask)

def test_a_failing_user_test(export_observer, inputs):
    ids, mask = inputs
    check(export_observer)(input_ids=ids, attention_mask=mask)
    assert False, "an ordinary failure"
'''


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_a_transformers_style_suite_gets_a_graph_per_structure(pytester: pytest.Pytester, workers: list[str]) -> None:
    pytester.makepyfile(test_bert=TEST_BERT)
    result = pytester.runpytest_subprocess(
        "--export-check", "--export-examples=2", "--export-report=report.json", "--junitxml=junit.xml",
        "-p", "no:cacheprovider", "-rA", *workers)
    cases = junit_cases(pytester.path / "junit.xml")
    ordinary = {k: v for k, v in cases.items() if k.startswith("test_bert::")}
    assert ordinary == {f"test_bert::test_{name}": "passed" for name in (
        "logits", "other_sizes", "bool_mask", "custom_4d_mask", "single_label", "hidden_states_as_tuple",
        "multi_label", "bfloat16")} | {"test_bert::test_a_failing_user_test": "failure"}
    models = {m["name"]: m for m in json.loads((pytester.path / "report.json").read_text())["models"]}
    verdicts = sorted(("bf16" if any("bfloat16" in n for n in m["notes"]) else "fp32", m["verdict"])
                      for m in models.values())
    assert verdicts == [("bf16", "passed"), ("fp32", "passed"), ("fp32", "passed")], {
        m["name"]: m["reason"] for m in models.values()}
    single = next(m for m in models.values() if len(m["graphs"]) > 1)
    structures = sorted((tuple(g["inputs"]), json.dumps(g["constants"], sort_keys=True)) for g in single["graphs"])
    assert len(single["graphs"]) >= 4 and all(g["verdict"] == "passed" for g in single["graphs"]), single["reason"]
    masks = {str(g["dims"].get("attention_mask")) for g in single["graphs"]}
    assert {"{'0': 'batch', '1': 'seq'}", "{'0': 'batch', '2': 'seq', '3': 'seq'}"} <= masks, structures
    half = next(m for m in models.values() if m["runtimes"] == ["onnxruntime-float32"])
    widened = ("run by onnxruntime in float32, each op's outputs rounded to their half-precision type (as a "
               "half-precision kernel computes): onnxruntime's CPUExecutionProvider has no kernel")
    assert any(note.startswith(widened) and note.endswith(" in bfloat16") for note in half["notes"]), half["notes"]
    assert "INTERNALERROR" not in result.stdout.str()
    _serves_unseen_sizes(single)


def _serves_unseen_sizes(model: dict) -> None:
    """The graph of the plain calls (2-D int64 mask, no labels, default constants) serves a batch
    and a length the tests never used, with a tokenizer's left padding, as eager does."""

    graph = next(g for g in model["graphs"] if g["inputs"] == ["input_ids", "attention_mask"] and not g["constants"]
                 and g["dims"]["attention_mask"] == {"0": "batch", "1": "seq"})
    torch.manual_seed(0)
    eager = BertForSequenceClassification(BertConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        max_position_embeddings=64, num_labels=3)).eval()
    ids = torch.randint(1, 99, (5, 11))
    mask = torch.ones(5, 11, dtype=torch.long)
    mask[1, :4] = 0
    session = onnxruntime.InferenceSession(graph["onnx_path"], providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    (logits,) = session.run(None, dict(zip(names, (ids.numpy(), mask.numpy()))))[:1]
    with torch.no_grad():
        expected = eager(input_ids=ids, attention_mask=mask).logits
    np.testing.assert_allclose(logits, expected.numpy(), atol=1e-4, rtol=1e-4)
