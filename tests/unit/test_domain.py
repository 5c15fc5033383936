"""What torch.export's runtime asserts say about a dim's domain (engine.domain)."""

from __future__ import annotations

import pytest
import sympy

from pytest_exportobs.engine.domain import _asserted_divisor

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
