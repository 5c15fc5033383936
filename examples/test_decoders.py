"""Decoder language models: hand-written decoding loops, training-style calls, generate()."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from zoo import EOS, PAD, VOCAB


def prompts(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=generator)


@pytest.mark.observe_export("llama", name="llama_greedy")
def test_greedy_loop_with_a_preallocated_cache(llama):
    """Prefill with an empty DynamicCache, then three greedy steps, as a serving loop does."""
    input_ids = prompts(2, 6)
    out = llama(input_ids=input_ids, past_key_values=DynamicCache(), use_cache=True)
    generated = []
    for _ in range(3):
        next_token = out.logits[:, -1:].argmax(-1)
        generated.append(next_token)
        out = llama(input_ids=next_token, past_key_values=out.past_key_values, use_cache=True)
    assert torch.cat(generated, dim=1).shape == (2, 3)
    assert out.past_key_values.get_seq_length() == 9


def decode(model, input_ids: torch.Tensor, steps: int):
    """Prefill with a mask, then ``steps`` decode steps, each with the mask of all tokens so far."""
    mask = torch.ones_like(input_ids)
    out = model(input_ids=input_ids, attention_mask=mask)
    for _ in range(steps):
        next_token = out.logits[:, -1:].argmax(-1)
        mask = torch.cat([mask, torch.ones_like(next_token)], dim=1)
        out = model(input_ids=next_token, attention_mask=mask, past_key_values=out.past_key_values)
    return out


@pytest.mark.observe_export("llama")
@pytest.mark.parametrize("batch", [2, 3])
def test_prefill_then_decode(llama, batch):
    out = decode(llama, prompts(batch, 5, seed=batch), steps=3)
    assert out.logits.shape == (batch, 1, VOCAB)
    assert out.past_key_values.get_seq_length() == 8


@pytest.mark.observe_export("llama", name="llama_two_batches")
def test_one_decode_step_at_two_batch_sizes(llama):
    """Four calls in one test: more than the three new signatures a test stores by default."""
    for batch in (2, 3):
        out = decode(llama, prompts(batch, 6, seed=batch), steps=1)
        assert out.logits.shape == (batch, 1, VOCAB)


@pytest.mark.observe_export("llama", name="llama_generate")
def test_generate_batch_of_four_with_padding(llama):
    input_ids = prompts(4, 7, seed=1)
    attention_mask = torch.ones_like(input_ids)
    input_ids[1, :3] = PAD
    attention_mask[1, :3] = 0
    out = llama.generate(input_ids, attention_mask=attention_mask, max_new_tokens=4, do_sample=False, pad_token_id=PAD)
    assert out.shape == (4, 11)


@pytest.mark.observe_export("llama", name="llama_generate")
def test_generate_single_prompt(llama):
    out = llama.generate(prompts(1, 5, seed=2), max_new_tokens=3, do_sample=False, pad_token_id=PAD)
    assert out.shape == (1, 8)


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


@pytest.mark.observe_export("qwen2")
def test_training_loss_is_finite(qwen2):
    input_ids = prompts(2, 9, seed=3)
    out = qwen2(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), labels=input_ids)
    assert torch.isfinite(out.loss)


@pytest.mark.observe_export("qwen2")
def test_next_token_distribution_sums_to_one(qwen2):
    input_ids = prompts(3, 6, seed=4)
    logits = qwen2(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits
    torch.testing.assert_close(logits[:, -1].softmax(-1).sum(-1), torch.ones(3))


def left_padded(batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    input_ids = prompts(batch, length, seed)
    mask = torch.ones_like(input_ids)
    for row in range(1, batch):
        input_ids[row, :row] = PAD
        mask[row, :row] = 0
    return input_ids, mask


@pytest.mark.observe_export("gpt2")
def test_gpt2_batched_generation_with_left_padding(gpt2):
    input_ids, mask = left_padded(3, 8, seed=5)
    out = gpt2.generate(input_ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=PAD)
    assert out.shape == (3, 11)


@pytest.mark.observe_export("gemma")
def test_gemma_batched_generation_with_left_padding(gemma):
    input_ids, mask = left_padded(2, 6, seed=6)
    out = gemma.generate(input_ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=PAD)
    assert out.shape == (2, 9)


@pytest.mark.observe_export("opt")
def test_opt_scores_a_batch(opt):
    input_ids = prompts(2, 5, seed=4)
    out = opt(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
    assert out.logits.shape == (2, 5, VOCAB)


@pytest.mark.observe_export("opt")
def test_opt_generates_from_one_prompt(opt):
    out = opt.generate(prompts(1, 6, seed=5), max_new_tokens=4, do_sample=False, pad_token_id=PAD)
    assert out.shape == (1, 10)


@pytest.mark.observe_export("mistral")
@pytest.mark.parametrize("batch", [1, 2])
def test_mistral_generates(mistral, batch):
    input_ids = prompts(batch, 6, seed=7)
    out = mistral.generate(input_ids, max_new_tokens=3, do_sample=False, pad_token_id=PAD, eos_token_id=EOS)
    assert out.shape[0] == batch and out.shape[1] <= 9


@pytest.mark.observe_export("qwen2_moe")
def test_moe_forward(qwen2_moe):
    input_ids = prompts(2, 5, seed=8)
    assert qwen2_moe(input_ids=input_ids).logits.shape == (2, 5, VOCAB)
