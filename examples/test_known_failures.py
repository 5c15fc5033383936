"""A model that works in eager mode but cannot be exported: its branch depends on input values.

The export check reports it as a known failure (xfail) because export-baseline.json says so; if the
model became exportable, the baseline would report it fixed.
"""

from __future__ import annotations

import pytest
import torch


@pytest.mark.observe_export("gated_scorer")
@pytest.mark.parametrize("batch", [2, 5])
def test_gated_scorer_uses_both_heads(gated_scorer, batch):
    positive = gated_scorer(torch.ones(batch, 8))
    negative = gated_scorer(-torch.ones(batch, 8))
    assert positive.shape == negative.shape == (batch, 1)
    h = torch.relu(gated_scorer.proj(torch.ones(batch, 8)))
    torch.testing.assert_close(positive, gated_scorer.positive(h))
