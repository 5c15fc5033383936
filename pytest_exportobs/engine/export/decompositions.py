"""Decompositions the engine supplies where torch's own cannot take the program.

torch decomposes ``cross_entropy_loss`` through its reference ``nll_loss``, which asks whether
the input is empty: a guard torch cannot decide when the number of targets depends on the data
(Gemma-3 and PaliGemma keep the logits of unpadded positions, ``logits[mask != 0]``, before the
loss), so preparing the program for ONNX fails.  :data:`UNGUARDED_CROSS_ENTROPY` decomposes it
into ``_log_softmax`` and ``nll_loss_forward``, ops ONNX translates, with no such question.
"""

from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten


def _cross_entropy(
    input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None, reduction: int = 1,
    ignore_index: Any = -100, label_smoothing: float = 0.0,
) -> torch.Tensor:
    """``cross_entropy_loss`` of class indices over the last dim of a 2-D input; torch's own
    decomposition for any other case."""
    if input.dim() != 2 or target.is_floating_point() or label_smoothing != 0.0:
        return aten.cross_entropy_loss.default.decompose(
            input, target, weight, reduction, ignore_index, label_smoothing)
    return aten.nll_loss_forward.default(aten._log_softmax.default(input, 1, False), target, weight, reduction,
                                         ignore_index)[0]


UNGUARDED_CROSS_ENTROPY = {aten.cross_entropy_loss.default: _cross_entropy}
