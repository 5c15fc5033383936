"""A GRU tagger over token ids."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.observe_export("tagger")
def test_one_tag_per_token(tagger):
    tokens = torch.randint(0, 500, (4, 12))
    assert tagger(tokens).argmax(-1).shape == (4, 12)
