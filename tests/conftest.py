"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tiny_llama():
    """A 2-layer LlamaForCausalLM with random weights (no download), in eval mode."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()
