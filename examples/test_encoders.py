"""Encoders: a single forward, padded batches, optional inputs."""

from __future__ import annotations

import pytest
import torch
from zoo import VOCAB


@pytest.mark.observe_export("roberta")
def test_roberta_hidden_states(roberta):
    input_ids = torch.randint(5, VOCAB, (2, 9))
    out = roberta(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
    assert out.last_hidden_state.shape == (2, 9, 64)


def padded_batch(lengths: list[int]) -> dict[str, torch.Tensor]:
    """Sentences of the given lengths, padded to the longest one, as a tokenizer returns them."""
    width = max(lengths)
    input_ids = torch.zeros(len(lengths), width, dtype=torch.int64)
    attention_mask = torch.zeros_like(input_ids)
    for row, length in enumerate(lengths):
        input_ids[row, :length] = torch.randint(5, VOCAB, (length,))
        attention_mask[row, :length] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": torch.zeros_like(input_ids)}


@pytest.mark.observe_export("bert")
@pytest.mark.parametrize("lengths", [[7, 12, 3], [5, 4]])
def test_bert_classifies_padded_batches(bert, lengths):
    logits = bert(**padded_batch(lengths)).logits
    assert logits.shape == (len(lengths), 3)


@pytest.mark.observe_export("text_encoder")
def test_single_sentences(text_encoder):
    assert text_encoder(torch.randint(0, 300, (2, 10))).shape == (2, 10, 32)


@pytest.mark.observe_export("text_encoder")
def test_sentence_pairs(text_encoder):
    input_ids = torch.randint(0, 300, (3, 14))
    token_type_ids = torch.zeros_like(input_ids)
    token_type_ids[:, 7:] = 1
    assert text_encoder(input_ids, token_type_ids=token_type_ids).shape == (3, 14, 32)


@pytest.mark.observe_export("pooler")
def test_pooling_shapes(pooler):
    assert pooler(torch.randn(3, 5, 16)).shape == (3, 16)
    assert pooler(torch.randn(4, 7, 16)).shape == (4, 16)


@pytest.mark.observe_export("pooler")
def test_masked_positions_are_ignored(pooler):
    x = torch.randn(2, 6, 16)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    pooled = pooler(x, mask)
    torch.testing.assert_close(pooled[0], torch.tanh(pooler.proj(x[0, :3])).mean(0))
