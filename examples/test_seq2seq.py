"""Encoder-decoder models under generate()."""

from __future__ import annotations

import pytest
import torch
from zoo import PAD, VOCAB


@pytest.mark.observe_export("t5")
def test_t5_translates_a_batch(t5):
    input_ids = torch.randint(3, VOCAB, (2, 11))
    out = t5.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=4, do_sample=False)
    assert out.shape[0] == 2 and out.shape[1] <= 5


@pytest.mark.observe_export("whisper")
def test_whisper_transcribes(whisper):
    features = torch.randn(1, 16, 64)  # (batch, mel bins, frames): 2 x max_source_positions frames
    out = whisper.generate(features, max_new_tokens=3, do_sample=False, pad_token_id=PAD)
    assert out.shape[0] == 1
