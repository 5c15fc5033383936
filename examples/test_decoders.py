"""Decoder-only language models: prefill, decode steps with a DynamicCache, generate()."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

VOCAB = 1000  # as configured in conftest.py; ids 0-2 are pad, bos, eos


def decode(model, input_ids: torch.Tensor, steps: int):
    """Greedy decoding by hand: one prefill call, then ``steps`` calls of one token each, every call
    getting the attention mask of all tokens so far (past + new) and the previous call's cache."""
    batch, prompt = input_ids.shape
    mask = torch.ones(batch, prompt, dtype=torch.int64)
    out = model(input_ids=input_ids, attention_mask=mask)
    assert out.logits.shape == (batch, prompt, VOCAB)
    tokens = [input_ids]
    for step in range(steps):
        next_token = out.logits[:, -1:].argmax(-1)
        tokens.append(next_token)
        mask = torch.cat([mask, torch.ones(batch, 1, dtype=torch.int64)], dim=1)
        cache = out.past_key_values
        assert isinstance(cache, DynamicCache)
        assert cache.get_seq_length() == prompt + step
        out = model(input_ids=next_token, attention_mask=mask, past_key_values=cache)
        assert out.logits.shape == (batch, 1, VOCAB)
    return torch.cat(tokens, dim=1), out


@pytest.mark.observe_export("llama")
@pytest.mark.parametrize("batch", [1, 2])
def test_llama_prefill_then_decode(llama, batch):
    torch.manual_seed(batch)
    prompt = torch.randint(3, VOCAB, (batch, 6))
    tokens, out = decode(llama, prompt, steps=2)
    assert tokens.shape == (batch, 8)
    assert out.past_key_values.get_seq_length() == 8


@pytest.mark.observe_export("llama")
def test_llama_chunked_prefill(llama):
    """A long prompt fed in two chunks gives the same next-token logits as in one call."""
    torch.manual_seed(0)
    prompt = torch.randint(3, VOCAB, (2, 9))
    whole = llama(input_ids=prompt, attention_mask=torch.ones_like(prompt))
    first = llama(input_ids=prompt[:, :5], attention_mask=torch.ones(2, 5, dtype=torch.int64))
    second = llama(
        input_ids=prompt[:, 5:], attention_mask=torch.ones_like(prompt),
        past_key_values=first.past_key_values,
    )
    assert second.logits.shape == (2, 4, VOCAB)
    torch.testing.assert_close(second.logits[:, -1], whole.logits[:, -1], atol=1e-4, rtol=1e-4)


@pytest.mark.observe_export("llama")
def test_llama_generate_greedy(llama):
    """generate() calls forward once per new token: the plugin records those calls too."""
    torch.manual_seed(0)
    input_ids = torch.randint(3, VOCAB, (2, 5))
    generated = llama.generate(input_ids, max_new_tokens=3, do_sample=False)
    assert generated.shape == (2, 8)
    assert torch.equal(generated[:, :5], input_ids)
    # greedy decoding is deterministic, and matches decoding by hand
    manual, _ = decode(llama, input_ids, steps=2)
    assert torch.equal(generated[:, :7], manual[:, :7])


@pytest.mark.observe_export("gpt2")
@pytest.mark.parametrize("batch", [1, 2])
def test_gpt2_prefill_then_decode(gpt2, batch):
    torch.manual_seed(10 + batch)
    prompt = torch.randint(3, VOCAB, (batch, 7))
    tokens, out = decode(gpt2, prompt, steps=2)
    assert tokens.shape == (batch, 9)
    assert torch.isfinite(out.logits).all()


@pytest.mark.observe_export("static_llama")
@pytest.mark.parametrize("batch", [2, 3])
def test_static_cache_decoder(static_llama, batch):
    """A decoder with a StaticCache, model and inputs from get_untrained_model_with_inputs:
    the cache length is the static max_cache_len, batch and new tokens are dynamic."""
    from pytest_exportobs import get_untrained_model_with_inputs

    data = get_untrained_model_with_inputs(
        static_llama.config, inputs_kwargs=dict(cls_cache="StaticCache", batch_size=batch, seq_len=batch + 1),
    )
    out = static_llama(**data["inputs"])
    assert out.logits.shape == (batch, batch + 1, static_llama.config.vocab_size)
