"""Fixtures of the example project: tiny untrained models, built offline from transformers configs
and plain torch.

Every fixture is function-scoped and seeds torch before building its model, so that two tests asking
for the same fixture get identical weights: the plugin groups their calls into one model to export.
"""

from __future__ import annotations

import pytest
import torch
import transformers

VOCAB = 1000
HIDDEN = 64


def _seeded(build, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build().eval()


@pytest.fixture
def llama() -> torch.nn.Module:
    """A 2-layer Llama-style decoder (grouped-query attention, rotary embeddings)."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    return _seeded(lambda: transformers.LlamaForCausalLM(config))


@pytest.fixture
def gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=128,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    return _seeded(lambda: transformers.GPT2LMHeadModel(config))


@pytest.fixture
def bert() -> torch.nn.Module:
    """A BERT encoder returning hidden states and the pooled output."""
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=128, type_vocab_size=2,
    )
    return _seeded(lambda: transformers.BertModel(config, add_pooling_layer=True))


@pytest.fixture
def t5() -> torch.nn.Module:
    """A T5 encoder-decoder (its decoder caches self- and cross-attention: EncoderDecoderCache)."""
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
        num_heads=4, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )
    return _seeded(lambda: transformers.T5ForConditionalGeneration(config))


class TinyConvNet(torch.nn.Module):
    """An image classifier accepting any image size (adaptive pooling before the head)."""

    def __init__(self, n_classes: int = 10):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, kernel_size=3, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, kernel_size=3, stride=2, padding=1), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
        )
        self.head = torch.nn.Linear(32, n_classes)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(pixel_values).flatten(1))


@pytest.fixture
def convnet() -> torch.nn.Module:
    return _seeded(TinyConvNet)


class GatedScorer(torch.nn.Module):
    """Picks one of two heads depending on the *values* of its input: fine in eager mode, but a
    data-dependent branch that torch.export cannot capture in a graph."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.positive = torch.nn.Linear(8, 1)
        self.negative = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.proj(x))
        if x.sum() > 0:
            return self.positive(h)
        return self.negative(h)


@pytest.fixture
def gated_scorer() -> torch.nn.Module:
    return _seeded(GatedScorer)


@pytest.fixture
def static_llama() -> torch.nn.Module:
    """A tiny Llama configured for a StaticCache, built by pytest_exportobs' own helper."""
    from pytest_exportobs import get_untrained_model_with_inputs

    return get_untrained_model_with_inputs(
        transformers.LlamaConfig(), model_kwargs=dict(cache_implementation="static"), inputs_kwargs=dict(cls_cache="StaticCache"),
    )["model"]
