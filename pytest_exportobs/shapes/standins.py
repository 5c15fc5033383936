"""What an absent input means, when its name says: the value to pass in its place.

transformers models treat an absent ``attention_mask`` as ones, absent ``token_type_ids`` as
zeros, absent ``position_ids`` as positions following the cache, and an absent self-attention
cache as an empty one.  A call lacking such an input can then run on a graph that takes it.
Any other absent input has no known meaning: such calls need a graph of their own.
"""

from __future__ import annotations

import torch

from ..observe.alignment import AlignedCalls, Slot
from .roles import cache_kind

ONES = ("attention_mask", "decoder_attention_mask", "encoder_attention_mask", "pixel_mask")
ZEROS = ("token_type_ids",)
POSITIONS = ("position_ids", "decoder_position_ids", "cache_position")


def stand_in_kind(aligned: AlignedCalls, slot: Slot) -> str | None:
    """``ones``, ``zeros``, ``positions`` or ``empty`` (a self-attention cache), else ``None``."""
    if slot.name in ONES:
        return "ones"
    if slot.name in ZEROS:
        return "zeros"
    if slot.name in POSITIONS:
        return "positions"
    if slot.leaf_names and all(cache_kind(aligned, leaf) == "self" for leaf in range(slot.start, slot.stop)):
        return "empty"
    return None


def stand_in(kind: str, reference: torch.Tensor, shape: list[int], past: int) -> torch.Tensor:
    """The value of an absent input of ``kind`` at ``shape`` (``past``: the cache length)."""
    if kind == "ones":
        return torch.ones(shape, dtype=reference.dtype, device=reference.device)
    if kind == "positions":
        positions = torch.arange(past, past + (shape[-1] if shape else 1), device=reference.device)
        return positions.to(reference.dtype).expand(shape).clone()
    return torch.zeros(shape, dtype=reference.dtype, device=reference.device)
