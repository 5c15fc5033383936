"""Models whose export is limited by their own code."""

from __future__ import annotations

import torch
import zoo


def test_gated_scorer(export_observer):
    model = export_observer.watch(zoo.seeded(zoo.GatedScorer), name="gated_scorer")
    assert model(torch.ones(3, 8)).shape == (3, 1)
    assert model(-torch.ones(5, 8)).shape == (5, 1)


def test_refinement_steps(export_observer):
    model = export_observer.watch(zoo.seeded(zoo.RepeatUntilCount), name="repeat_until_count")
    assert model(torch.randn(2, 8), torch.tensor(3)).shape == (2, 8)


def test_pairwise_head(export_observer):
    model = export_observer.watch(zoo.seeded(zoo.PairwiseHead), name="pairwise_head")
    assert model(torch.randn(2, 8)).shape == (2, 8)


def test_fixed_batch(export_observer):
    model = export_observer.watch(zoo.seeded(zoo.FixedBatchNorm), name="fixed_batch")
    assert model(torch.randn(4, 8)).shape == (4, 8)
