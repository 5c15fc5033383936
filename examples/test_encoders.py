"""Encoders: BERT sentence embeddings, and a T5 encoder-decoder decoding with its cache."""

from __future__ import annotations

import pytest
import torch
from transformers import EncoderDecoderCache

VOCAB, HIDDEN = 1000, 64  # as configured in conftest.py


def sentence_pair(batch: int, length: int, padding: int) -> dict[str, torch.Tensor]:
    """A padded batch of sentence pairs as a BERT tokenizer would give it."""
    input_ids = torch.randint(5, VOCAB, (batch, length))
    attention_mask = torch.ones(batch, length, dtype=torch.int64)
    token_type_ids = torch.zeros(batch, length, dtype=torch.int64)
    token_type_ids[:, length // 2:] = 1
    if padding:
        input_ids[-1, -padding:] = 0
        attention_mask[-1, -padding:] = 0
        token_type_ids[-1, -padding:] = 0
    return dict(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)


@pytest.mark.observe_export("bert")
@pytest.mark.parametrize(("batch", "length", "padding"), [(2, 8, 3), (3, 12, 0), (1, 5, 0)])
def test_bert_embeddings(bert, batch, length, padding):
    torch.manual_seed(length)
    out = bert(**sentence_pair(batch, length, padding))
    assert out.last_hidden_state.shape == (batch, length, HIDDEN)
    assert out.pooler_output.shape == (batch, HIDDEN)
    assert out.pooler_output.abs().max() <= 1  # tanh pooler


@pytest.mark.observe_export("t5")
@pytest.mark.parametrize(("batch", "source_len"), [(1, 7), (2, 11)])
def test_t5_greedy_decoding(t5, batch, source_len):
    """Three decoder steps: the first one without cache, the next ones with the
    EncoderDecoderCache of the previous step (self-attention grows, cross-attention is fixed)."""
    torch.manual_seed(source_len)
    input_ids = torch.randint(2, VOCAB, (batch, source_len))
    attention_mask = torch.ones_like(input_ids)
    decoder_input_ids = torch.full((batch, 1), t5.config.decoder_start_token_id)
    out = t5(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids)
    for step in range(2):
        assert out.logits.shape == (batch, 1, VOCAB)
        assert out.encoder_last_hidden_state.shape == (batch, source_len, HIDDEN)
        cache = out.past_key_values
        assert isinstance(cache, EncoderDecoderCache)
        assert cache.self_attention_cache.get_seq_length() == step + 1
        assert cache.cross_attention_cache.get_seq_length() == source_len
        next_token = out.logits[:, -1:].argmax(-1)
        out = t5(
            input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=next_token,
            past_key_values=cache,
        )
    assert out.logits.shape == (batch, 1, VOCAB)
