"""The role of an input axis, from the input's name, its place in a cache and its layout.

A role names what an axis means (``batch``, ``seq``, ``past_seq``...).  Demanded roles make an
axis dynamic even when the tests never varied it: a deployed model meets other batch sizes,
sequence, cache and encoder lengths.  Other roles only keep axes apart (an image's height and
width) or are guesses on inputs with generic names (``x`` of shape ``(batch, seq, hidden)``),
whose dims a failed export may keep static instead of failing the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils import _pytree

from ..core.trees import spec_children
from ..core.vocabulary import AxisRole, StrEnum
from ..observe.alignment import AlignedCalls
from .dims import Axis

DEMANDED = (AxisRole.BATCH, AxisRole.SEQ, AxisRole.PAST_SEQ, AxisRole.TOTAL_SEQ, AxisRole.ENCODER_SEQ, AxisRole.FRAMES)
# an image's sides and a signal's length: taken in steps (a patch, a downsampling), explored near their sizes
SPATIAL = (AxisRole.HEIGHT, AxisRole.WIDTH, AxisRole.LENGTH)
CACHE_SLOTS = ("past_key_values", "cache", "past", "past_key_value", "cache_params")
# caches whose length is their fixed allocation (max_cache_len), not the past sequence
STATIC_CACHES = ("StaticCache", "HybridCache", "SlidingWindowCache", "HybridChunkedCache", "OffloadedStaticCache")
ENCODER_DECODER_SLOTS = (
    "decoder_input_ids", "decoder_inputs_embeds", "decoder_attention_mask", "encoder_outputs",
    "encoder_hidden_states",
)


class Spelling(StrEnum):
    """An axis whose role depends on the call (see :func:`_known_roles`)."""

    TEXT = "text"  # seq in a decoder, encoder_seq in an encoder-decoder
    MASK = "mask"  # the text's, or total_seq when the mask covers a cache
    DECODER_MASK = "decoder_mask"  # seq, or total_seq when it covers a cache


# name -> {axis: role}
KNOWN_INPUTS: dict[str, dict[int, AxisRole | Spelling]] = {
    "input_ids": {0: AxisRole.BATCH, 1: Spelling.TEXT},
    "inputs_embeds": {0: AxisRole.BATCH, 1: Spelling.TEXT},
    "token_type_ids": {0: AxisRole.BATCH, 1: Spelling.TEXT},
    "position_ids": {0: AxisRole.BATCH, 1: AxisRole.SEQ},
    "attention_mask": {0: AxisRole.BATCH, 1: Spelling.MASK},
    "labels": {0: AxisRole.BATCH, 1: AxisRole.SEQ},
    "decoder_input_ids": {0: AxisRole.BATCH, 1: AxisRole.SEQ},
    "decoder_inputs_embeds": {0: AxisRole.BATCH, 1: AxisRole.SEQ},
    "decoder_position_ids": {0: AxisRole.BATCH, 1: AxisRole.SEQ},
    "decoder_attention_mask": {0: AxisRole.BATCH, 1: Spelling.DECODER_MASK},
    "encoder_outputs": {0: AxisRole.BATCH, 1: AxisRole.ENCODER_SEQ},
    "encoder_hidden_states": {0: AxisRole.BATCH, 1: AxisRole.ENCODER_SEQ},
    "encoder_attention_mask": {0: AxisRole.BATCH, 1: AxisRole.ENCODER_SEQ},
    "cache_position": {0: AxisRole.SEQ},
    "pixel_values": {0: AxisRole.BATCH, 2: AxisRole.HEIGHT, 3: AxisRole.WIDTH},
    "pixel_mask": {0: AxisRole.BATCH, 1: AxisRole.HEIGHT, 2: AxisRole.WIDTH},
    "input_features": {0: AxisRole.BATCH, 2: AxisRole.FRAMES},
    "input_values": {0: AxisRole.BATCH, 1: AxisRole.FRAMES},
}
# inputs whose layout depends on their rank: a 4-D mask is (batch, heads, query, key), multiple-choice
# token ids are (batch, choices, seq), a multimodal rotary model's positions (sections, batch, seq)
KNOWN_BY_RANK: dict[tuple[str, int], dict[int, AxisRole | Spelling]] = {
    ("position_ids", 3): {1: AxisRole.BATCH, 2: AxisRole.SEQ},
    ("attention_mask", 4): {0: AxisRole.BATCH, 2: Spelling.TEXT, 3: Spelling.MASK},
    ("decoder_attention_mask", 4): {0: AxisRole.BATCH, 2: AxisRole.SEQ, 3: Spelling.DECODER_MASK},
    ("input_ids", 3): {0: AxisRole.BATCH, 2: Spelling.TEXT},
    ("token_type_ids", 3): {0: AxisRole.BATCH, 2: Spelling.TEXT},
    ("attention_mask", 3): {0: AxisRole.BATCH, 2: Spelling.MASK},
}


@dataclass(frozen=True)
class Role:
    """What an axis means; ``demanded``: dynamic by default."""

    name: AxisRole
    demanded: bool = True


def axis_roles(aligned: AlignedCalls, generic: bool = True, channels: frozenset[int] = frozenset()) -> dict[Axis, Role]:
    """The role of every axis that has one; ``generic`` adds the guesses on inputs with other
    names than transformers' (see :func:`_generic_roles`; ``channels``: the channels the model
    declares it takes its input in)."""
    encoder_decoder = _is_encoder_decoder(aligned)
    # a mask longer than the new tokens covers past ones too (a cache, or tokens the call repeats)
    covers_past = _mask_covers_past(aligned) or any(
        cache_kind(aligned, leaf) == "self" for leaf in range(len(aligned.leaf_names))
    )
    roles: dict[Axis, Role] = {}
    for leaf in range(len(aligned.leaf_names)):
        roles.update(_known_roles(aligned, leaf, encoder_decoder, covers_past))
    if generic:
        roles.update(_generic_roles(aligned, roles, channels))
    return roles


def _known_roles(aligned: AlignedCalls, leaf: int, encoder_decoder: bool, covers_past: bool) -> dict[Axis, Role]:
    rank = _rank(aligned, leaf)
    cache = cache_kind(aligned, leaf)
    if cache is not None:
        length = {"self": AxisRole.PAST_SEQ, "cross": AxisRole.ENCODER_SEQ, "static": None}[cache]
        axes = {0: AxisRole.BATCH, _length_axis(aligned.leaf_names[leaf], rank): length}
        return {(leaf, dim): Role(name) for dim, name in axes.items() if name and dim is not None}
    slot_of = aligned.leaf_slot(leaf)
    slot = slot_of.name
    if leaf != slot_of.start:
        return {}  # a nest's other leaves (encoder_outputs.hidden_states, .attentions) have layouts of their own
    text = AxisRole.ENCODER_SEQ if encoder_decoder else AxisRole.SEQ
    spelled = {
        Spelling.TEXT: text,
        Spelling.MASK: text if encoder_decoder else (AxisRole.TOTAL_SEQ if covers_past else AxisRole.SEQ),
        Spelling.DECODER_MASK: AxisRole.TOTAL_SEQ if covers_past else AxisRole.SEQ,
    }
    known = KNOWN_BY_RANK.get((slot, rank)) or KNOWN_INPUTS.get(slot, {})
    return {
        (leaf, dim): Role(spelled[name] if isinstance(name, Spelling) else name,
                          name not in (AxisRole.HEIGHT, AxisRole.WIDTH))
        for dim, name in known.items() if dim < rank
    }


def _length_axis(name: str, rank: int) -> int | None:
    """The sequence axis of a cache tensor: keys and values ``(batch, heads, seq, head_dim)``, an
    indexer's keys ``(batch, seq, dim)``; a linear-attention layer's states have none."""
    last = name.rsplit(".", 1)[-1]
    if last.startswith("indexer_key_") and rank == 3:
        return 1
    if not last.startswith(("conv_state_", "recurrent_state_", "indexer_")) and rank == 4:
        return 2
    return None


def _mask_covers_past(aligned: AlignedCalls) -> bool:
    """Whether ``attention_mask`` is longer than ``input_ids`` in some call."""
    names = aligned.leaf_names
    if "attention_mask" not in names or "input_ids" not in names:
        return False
    mask, ids = names.index("attention_mask"), names.index("input_ids")
    return any(
        isinstance(call[mask], torch.Tensor) and isinstance(call[ids], torch.Tensor)
        and call[mask].dim() == call[ids].dim() == 2 and call[mask].shape[1] != call[ids].shape[1]
        for call in aligned.calls
    )


def _generic_roles(aligned: AlignedCalls, known: dict[Axis, Role], channels: frozenset[int]) -> dict[Axis, Role]:
    """Guesses for inputs with other names: dim 0 is the batch when it agrees with the batch of
    the other inputs (1-D targets such as ``start_positions`` included); token ids and masks
    ``(batch, seq)``; features ``(batch, seq, hidden)`` (a soft guess), or a signal ``(batch,
    channels, length)`` when its second axis holds ``channels`` (what the model declares it takes);
    images ``(batch, channels, height, width)``."""
    generic = [
        leaf for leaf in range(len(aligned.leaf_names))
        if aligned.is_tensor_leaf(leaf) and not any(axis[0] == leaf for axis in known) and _rank(aligned, leaf) >= 1
    ]
    batch = _batch_sizes(aligned, [axis for axis, role in known.items() if role.name == AxisRole.BATCH] or
                         [(leaf, 0) for leaf in generic if _rank(aligned, leaf) >= 2][:1])
    roles: dict[Axis, Role] = {}
    for leaf in generic:
        if batch is None or not _agrees(aligned, (leaf, 0), batch):
            continue
        rank, dtype = _rank(aligned, leaf), aligned.reference_tensor(leaf).dtype
        if rank == 1 and dtype.is_floating_point and len(set(batch) - {None}) < 2:
            continue  # a float vector of the batch's size in every call may be a coincidence; a target is not
        roles[(leaf, 0)] = Role(AxisRole.BATCH)
        if rank == 2 and not dtype.is_floating_point:
            roles[(leaf, 1)] = Role(AxisRole.SEQ)
        elif rank == 3 and dtype.is_floating_point and _sizes(aligned, (leaf, 1)) <= channels:
            roles[(leaf, 2)] = Role(AxisRole.LENGTH, demanded=False)
        elif rank == 3 and dtype.is_floating_point:
            roles[(leaf, 1)] = Role(AxisRole.SEQ, demanded=False)
        elif rank == 4 and dtype.is_floating_point:
            roles[(leaf, 2)], roles[(leaf, 3)] = Role(AxisRole.HEIGHT, False), Role(AxisRole.WIDTH, False)
    return roles


def _batch_sizes(aligned: AlignedCalls, axes: list[Axis]) -> list[int | None] | None:
    """The batch size of every call (``None`` where no batch axis is present), if the axes agree."""
    sizes: list[int | None] = []
    for call in aligned.calls:
        seen = {call[leaf].shape[dim] for leaf, dim in axes if isinstance(call[leaf], torch.Tensor)}
        if len(seen) > 1:
            return None
        sizes.append(seen.pop() if seen else None)
    return sizes if any(s is not None for s in sizes) else None


def _agrees(aligned: AlignedCalls, axis: Axis, batch: list[int | None]) -> bool:
    leaf, dim = axis
    common = [
        (call[leaf].shape[dim], size) for call, size in zip(aligned.calls, batch)
        if isinstance(call[leaf], torch.Tensor) and size is not None
    ]
    return bool(common) and all(a == b for a, b in common)


def _sizes(aligned: AlignedCalls, axis: Axis) -> set[int]:
    """The sizes an axis has over the calls."""
    leaf, dim = axis
    return {call[leaf].shape[dim] for call in aligned.calls if isinstance(call[leaf], torch.Tensor)}


def _rank(aligned: AlignedCalls, leaf: int) -> int:
    return aligned.reference_tensor(leaf).dim() if aligned.is_tensor_leaf(leaf) else 0


def cache_kind(aligned: AlignedCalls, leaf: int) -> str | None:
    """``self``, ``cross`` or ``static`` for a tensor inside a cache argument, else ``None``."""
    slot = aligned.leaf_slot(leaf)
    name = aligned.leaf_names[leaf]
    types = _spec_types(slot.spec)
    if name == slot.name or not (slot.name in CACHE_SLOTS or any("Cache" in t for t in types)):
        return None
    if "cross" in name:
        return "cross"
    return "static" if set(STATIC_CACHES) & set(types) else "self"


def _spec_types(spec: _pytree.TreeSpec | None) -> list[str]:
    """Names of the container classes of a pytree spec (``DynamicCache``, ``dict``...)."""
    if spec is None or spec.is_leaf():
        return []
    return [spec.type.__name__, *(name for child in spec_children(spec) for name in _spec_types(child))]


def _is_encoder_decoder(aligned: AlignedCalls) -> bool:
    return any(slot.name in ENCODER_DECODER_SLOTS for slot in aligned.slots) or any(
        "cross" in name for name in aligned.leaf_names
    )
