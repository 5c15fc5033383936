"""What torch.export's runtime asserts say about a dim's domain (engine.domain)."""

from __future__ import annotations

import json

import pytest
import sympy

from pytest_exportobs.core.vocabulary import RefinementKind
from pytest_exportobs.engine.domain import Refinement, _asserted_divisor

s, b = sympy.Symbol("s76", integer=True, positive=True), sympy.Symbol("s6", integer=True, positive=True)
floor = sympy.floor


@pytest.mark.parametrize(("asserts", "divisor"), [
    # a stride-2 layer whose output is added to its input (a UNet's skip connection)
    ([sympy.Eq(s, 2 * floor((s - 1) / 2) + 2)], 2),
    # two of them, and a lower bound
    ([sympy.Eq(sympy.Mod(s, 4), 0), s >= 16], 4),
    # a lower bound alone
    ([s >= 60], None),
    # wav2vec2's feature encoder (strides 5, 2, 2): a few lengths excluded, any other allowed
    ([sympy.Ne(b * (floor(s / 5) - 1), 1), b * (floor(s / 20) - 1) >= 0, sympy.Ne(floor(s / 20), 2)], None),
    # nothing on this dim alone
    ([sympy.Ne(b * s, 1)], None),
], ids=["skip-connection", "two-strides-and-a-bound", "lower-bound", "wav2vec2", "other-dims"])
def test_only_a_periodic_assert_restricts_a_dim_to_multiples(asserts: list[sympy.Basic], divisor: int | None) -> None:
    assert _asserted_divisor(s, asserts) == divisor


def test_a_refinement_is_kept_in_the_export_cache_as_a_plain_list() -> None:
    merge = Refinement(RefinementKind.MERGE, "y_dim0", "x_dim0")
    assert json.dumps(merge.to_json()) == '["merge", "y_dim0", "x_dim0"]'
    assert Refinement.from_json(json.loads(json.dumps(merge.to_json()))) == merge
    assert Refinement.from_json(["scale", "height", 2]) == Refinement(RefinementKind.SCALE, "height", 2)
    split = Refinement(RefinementKind.SPLIT, "past_seq", 4095, ((2, 2), (3, 2)))
    assert json.dumps(split.to_json()) == '["split", "past_seq", 4095, [[2, 2], [3, 2]]]'
    assert Refinement.from_json(json.loads(json.dumps(split.to_json()))) == split
    with pytest.raises(ValueError):
        Refinement.from_json(["halve", "height", 2])  # a cache entry of another vocabulary: not read
