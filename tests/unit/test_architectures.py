"""transformers architectures beyond attention decoders: mixture-of-experts and state-space models,
as their own tests build them (tiny, untrained; no pytest session)."""

from __future__ import annotations

import re
from pathlib import Path

import onnxruntime
import pytest
import torch

from pytest_exportobs.engine.base.settings import CheckSettings
from pytest_exportobs.engine.check import check_model
from pytest_exportobs.observe.store import ObserveOptions, SessionStore

transformers = pytest.importorskip("transformers")


def settings(tmp_path: Path) -> CheckSettings:
    return CheckSettings(export_dir=tmp_path, examples=4, hypothesis_seed=0, use_cache=False)


@pytest.mark.slow
def test_a_mixture_of_experts_with_transformers_default_experts_exports_and_serves_unseen_sizes(
        tmp_path: Path) -> None:
    """Mixtral's experts run ``grouped_mm`` (transformers 5): torchlib has no translation of it,
    transformers' own exporter ships one, which the check uses."""
    config = transformers.MixtralConfig(
        vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).eval()
    store = SessionStore()
    with store.observe(model, "mixtral", ObserveOptions(), "t::test") as group, torch.no_grad():
        model(torch.randint(0, 99, (2, 7)), attention_mask=torch.ones(2, 7, dtype=torch.long))
        model(torch.randint(0, 99, (3, 5)), attention_mask=torch.ones(3, 5, dtype=torch.long))
    result = check_model(group, settings(tmp_path))
    assert (result.verdict, result.stage) == ("passed", "variations"), result.reason
    assert result.dims == {"input_ids": {"0": "batch", "1": "seq"}, "attention_mask": {"0": "batch", "1": "seq"}}
    ids, mask = torch.randint(0, 99, (4, 9)), torch.ones(4, 9, dtype=torch.long)
    session = onnxruntime.InferenceSession(result.onnx_path, providers=["CPUExecutionProvider"])
    logits = session.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0]
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(torch.from_numpy(logits), expected, rtol=1e-3, atol=1e-4)


@pytest.mark.slow
def test_a_mixture_of_experts_in_bfloat16_translates_its_grouped_matmuls_with_offsets(tmp_path: Path) -> None:
    """In bfloat16 the experts run ``aten._grouped_mm`` with offsets, whose torchlib translation
    refuses them ("ragged/MoE is not supported"): transformers' one is used instead."""
    config = transformers.MixtralConfig(
        vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).eval().to(torch.bfloat16)
    store = SessionStore()
    with store.observe(model, "mixtral", ObserveOptions(), "t::test") as group, torch.no_grad():
        model(torch.randint(0, 99, (2, 7)))
        model(torch.randint(0, 99, (3, 5)))
    result = check_model(group, settings(tmp_path))
    assert result.stage not in ("torch.export", "decompose", "onnx-translate", "onnx-checker"), result.reason
    assert Path(result.onnx_path).is_file() and result.op_counts["MatMul"] >= 8  # an unrolled matmul per expert


@pytest.fixture
def tiny_mamba() -> torch.nn.Module:
    if not hasattr(transformers.cache_utils, "LinearAttentionLayer"):
        pytest.skip("this transformers keeps Mamba's states in a MambaCache")
    config = transformers.MambaConfig(vocab_size=50, hidden_size=16, state_size=4, num_hidden_layers=2, conv_kernel=3)
    torch.manual_seed(0)
    return transformers.MambaModel(config).eval()


@pytest.mark.slow
def test_a_state_space_models_outputs_hold_its_states_and_its_loop_names_the_installed_line(
        tiny_mamba: torch.nn.Module, tmp_path: Path) -> None:
    """MambaModel returns its hidden states beside a cache of linear-attention layers; its
    reference scan loops over the sequence in Python: torch.export specializes ``seq`` there, and
    the failure names that line of the installed package."""
    store = SessionStore()
    with store.observe(tiny_mamba, "mamba", ObserveOptions(), "t::test") as group, torch.no_grad():
        tiny_mamba(torch.randint(0, 50, (2, 5)), use_cache=True)
        tiny_mamba(torch.randint(0, 50, (3, 6)), use_cache=True)
    first = group.recorder.observations[0]
    assert [tuple(t.shape) for t in first.outputs] == [(2, 5, 16), (2, 32, 3), (2, 32, 4), (2, 32, 3), (2, 32, 4)]
    result = check_model(group, settings(tmp_path))
    assert (result.verdict, result.stage, result.kind) == ("failed", "torch.export", "specialized")
    assert re.search(r"seq \(input_ids\.1, the tests vary it\) specialized to \d by torch\.export at "
                     r"transformers/models/mamba/modeling_mamba\.py:\d+: for index in range\(seq_len\):$",
                     result.reason), result.reason
