"""What an absent input means, when its name says: the value to pass in its place.

transformers models treat an absent ``attention_mask`` as ones, absent ``token_type_ids`` as
zeros, absent ``position_ids`` as positions following the cache, and an absent self-attention
cache as an empty one.  A call lacking such an input can then run on a graph that takes it.
Any other absent input has no known meaning: such calls need a graph of their own.
"""

from __future__ import annotations

import torch

from ..core.vocabulary import StandIn
from ..observe.alignment import AlignedCalls, Slot
from .axis_roles import cache_kind

ONES = ("attention_mask", "decoder_attention_mask", "encoder_attention_mask", "pixel_mask")
ZEROS = ("token_type_ids",)
POSITIONS = ("position_ids", "decoder_position_ids", "cache_position")


def stand_in_kind(aligned: AlignedCalls, slot: Slot) -> StandIn | None:
    """What an absent ``slot`` means (a self-attention cache: ``empty``), else ``None``."""
    if slot.name in ONES:
        return StandIn.ONES
    if slot.name in ZEROS:
        return StandIn.ZEROS
    if slot.name in POSITIONS:
        return StandIn.POSITIONS
    if slot.leaf_names and all(cache_kind(aligned, leaf) == "self" for leaf in range(slot.start, slot.stop)):
        return StandIn.EMPTY
    return None


def stand_in(kind: StandIn, reference: torch.Tensor, shape: list[int], past: int) -> torch.Tensor:
    """The value of an absent input of ``kind`` at ``shape`` (``past``: the cache length)."""
    if kind == StandIn.ONES:
        return torch.ones(shape, dtype=reference.dtype, device=reference.device)
    if kind == StandIn.POSITIONS:
        positions = torch.arange(past, past + (shape[-1] if shape else 1), device=reference.device)
        return positions.to(reference.dtype).expand(shape).clone()
    return torch.zeros(shape, dtype=reference.dtype, device=reference.device)
