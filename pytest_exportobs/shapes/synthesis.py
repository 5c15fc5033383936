"""Build new, valid inputs at chosen dimension sizes from the recorded ones.

Used for an export example where every dynamic dimension is at least 2 (when no recorded call
has that) and for the hypothesis shape variations.  Each flat leaf gets a recipe learned from
the recorded calls: floats are random, integers stay within their observed range (token ids stay
valid), 0/1 masks keep their value set, ``arange``-like inputs (position ids, cache positions)
stay ``arange``-like from an offset that follows the variable it matched (``past_seq``).
Integer ``labels`` lined up with a padding mask may take torch's ignore index at padded positions,
as a data collator pads them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ..core.vocabulary import AxisRole
from .model import ShapeModel


@dataclass(frozen=True)
class Recipe:
    """How to fill one leaf: ``kind`` is float, int, ones, mask, arange or keep (not a tensor).
    A mask's ``pad_value`` marks padding (0, or 1 for a ``key_padding_mask``), on the ``left``
    when the recorded masks were padded there."""

    kind: str
    dtype: torch.dtype | None = None
    low: int = 0
    high: int = 0
    offset_var: str | None = None
    pad_value: int = 0
    left: bool = False
    exclude: int | None = None  # a value token ids never take (the padding token)


IGNORE_INDEX = -100  # the default ignore_index of torch's cross-entropy and NLL losses


def free_variables(shapes: ShapeModel) -> list[str]:
    """Variables a caller may size; derived ones follow their relation (or window)."""
    derived = {d.derived for d in shapes.derivations}
    return [v.name for v in shapes.variables if v.name not in derived]


def complete_sizes(shapes: ShapeModel, free: dict[str, int]) -> dict[str, int]:
    """Sizes of every variable from the free ones, each derived one from its expression
    (``height = 2*height_half``, ``total_seq = past_seq + seq``, ``past_seq_window =
    min(past_seq, 15)``), relations on derived ones included."""
    sizes = dict(free)
    pending = shapes.derivations
    while pending:
        ready = [r for r in pending if all(t in sizes for t in r.terms)]
        if not ready:
            raise ValueError(f"relations without free terms: {', '.join(map(str, pending))}")
        for relation in ready:
            sizes[relation.derived] = relation.size(sizes)
            pending.remove(relation)
    return sizes


def export_sizes(shapes: ShapeModel) -> dict[str, int]:
    """Sizes of the representative call with every free variable raised to at least 2."""
    index = shapes.aligned.complete_call()
    free = {}
    for var in shapes.variables:
        size = var.values[index]
        free[var.name] = size if size is not None and size >= 2 else max(2, var.bounds[1])
    return complete_sizes(shapes, {n: free[n] for n in free_variables(shapes)})


def example_leaves(shapes: ShapeModel) -> list[Any]:
    """Flat leaves to export with: a recorded call with every dynamic size at least 2 (torch.export
    specializes 0 and 1), else inputs synthesized from the recorded ones at :func:`export_sizes`."""
    index = shapes.safe_call()
    if index is not None:
        return shapes.call_leaves(index)
    return build_leaves(shapes, export_sizes(shapes), torch.Generator().manual_seed(0))


def recipes(shapes: ShapeModel, pad_token_id: int | None = None) -> list[Recipe]:
    """One recipe per flat leaf, learned from every call where the leaf is present.  Token ids
    never take ``pad_token_id``: padding is the masks' to say (a padding token where a mask says
    "real" makes a model pool a padded position, as GPT-2's classifier pools the last non-pad token)."""
    found = [_recipe(shapes, leaf) for leaf in range(len(shapes.aligned.leaf_names))]
    if pad_token_id is None:
        return found
    return [dataclasses.replace(r, exclude=pad_token_id) if r.kind == "int" and name.endswith("input_ids") else r
            for r, name in zip(found, shapes.aligned.leaf_names)]


def rows_repeated(shapes: ShapeModel, index: int, sizes: dict[str, int]) -> list[Any] | None:
    """Call ``index``'s flat leaves with the rows of each batch variable in ``sizes`` repeated
    (cyclically) to its size: each row a valid input as the tests made it, where synthesized
    values may break what ties inputs together (image tokens in the ids for the pixel values).
    ``None`` when a variable of ``sizes`` is no batch."""
    batches = {v.name: v for v in shapes.variables if v.role == AxisRole.BATCH}
    if not sizes or not set(sizes) <= batches.keys():
        return None
    leaves = list(shapes.call_leaves(index))
    for name, rows in sizes.items():
        for leaf, dim in batches[name].axes:
            value = leaves[leaf]
            if isinstance(value, torch.Tensor) and value.shape[dim] > 0:
                leaves[leaf] = value.index_select(dim, torch.arange(rows) % value.shape[dim])
    return leaves


def build_leaves(
    shapes: ShapeModel, sizes: dict[str, int], generator: torch.Generator, leaf_recipes: list[Recipe] | None = None
) -> list[Any]:
    """Flat leaves of a new call where each variable has the given size."""
    template = shapes.call_leaves(shapes.aligned.complete_call())
    leaf_recipes = leaf_recipes or recipes(shapes)
    leaves: list[Any] = []
    for value, recipe, shape in zip(template, leaf_recipes, leaf_shapes(shapes, sizes)):
        if recipe.kind == "keep":
            leaves.append(value)
        else:
            assert shape is not None, "a leaf to fill holds no tensor in the representative call"
            leaves.append(_fill(recipe, list(shape), sizes, generator))
    return leaves


def ignore_padded_labels(shapes: ShapeModel, leaves: list[Any], leaf_recipes: list[Recipe]) -> list[Any] | None:
    """``leaves`` with each integer ``labels`` leaf set to :data:`IGNORE_INDEX` where a padding
    mask of its shape marks padding, as a data collator pads labels (a loss then never reads the
    outputs of padded positions, which attention leaves arbitrary); ``None`` when no label lines up
    with a padded mask."""
    masks = [(leaf, r) for leaf, r in zip(leaves, leaf_recipes) if r.kind == "mask" and leaf.ndim >= 2]
    ignored = list(leaves)
    for i, (name, recipe) in enumerate(zip(shapes.aligned.leaf_names, leaf_recipes)):
        if recipe.kind != "int" or not name.split(".")[-1].endswith("labels"):
            continue
        padding = [m == r.pad_value for m, r in masks if m.shape == leaves[i].shape]
        if padding and bool(padding[0].any()):
            ignored[i] = leaves[i].masked_fill(padding[0], IGNORE_INDEX)
    return None if all(a is b for a, b in zip(ignored, leaves)) else ignored


def leaf_shapes(shapes: ShapeModel, sizes: dict[str, int]) -> list[tuple[int, ...] | None]:
    """Shape of every flat leaf of the representative call resized to ``sizes`` (``None``: no tensor)."""
    template = shapes.call_leaves(shapes.aligned.complete_call())
    return [
        tuple(sizes[axes[d]] if d in axes else s for d, s in enumerate(value.shape))
        if isinstance(value, torch.Tensor) else None
        for value, axes in zip(template, shapes.leaf_axes())
    ]


def _fill(recipe: Recipe, shape: list[int], sizes: dict[str, int], generator: torch.Generator) -> torch.Tensor:
    if recipe.kind == "float":
        return torch.randn(shape, generator=generator).to(recipe.dtype)
    if recipe.kind == "int":
        values = torch.randint(recipe.low, recipe.high + 1, shape, generator=generator, dtype=recipe.dtype)
        if recipe.exclude is not None and recipe.low < recipe.high:
            other = recipe.exclude + 1 if recipe.exclude < recipe.high else recipe.low
            values[values == recipe.exclude] = other
        return values
    if recipe.kind == "ones":
        return torch.ones(shape, dtype=recipe.dtype)
    if recipe.kind == "mask":
        return _padding_mask(recipe, shape, generator)
    offset = sizes[recipe.offset_var] if recipe.offset_var else recipe.low
    length = shape[-1] if shape else 1
    return (torch.arange(length) + offset).expand(shape).to(recipe.dtype).clone()


def _padding_mask(recipe: Recipe, shape: list[int], generator: torch.Generator) -> torch.Tensor:
    """A mask as a tokenizer pads a batch: each row (of a batch, or of a batch of choices) a run
    of real tokens (at least one) and padding on one side; masks of another rank are random with a
    real last position."""
    if len(shape) not in (2, 3):
        real = torch.randint(0, 2, shape, generator=generator).bool()
        if real.ndim:
            real[..., -1] = True
    else:
        length = shape[-1]
        tokens = torch.randint(1, max(length, 1) + 1, (*shape[:-1], 1), generator=generator)  # real tokens per row
        positions = torch.arange(length)
        real = positions >= length - tokens if recipe.left else positions < tokens
    return (real if recipe.pad_value == 0 else ~real).to(recipe.dtype)


def _recipe(shapes: ShapeModel, leaf: int) -> Recipe:
    present = [(i, call[leaf]) for i, call in enumerate(shapes.aligned.calls) if call[leaf] is not None]
    tensors = [(i, t) for i, t in present if isinstance(t, torch.Tensor)]
    if not tensors:
        return Recipe("keep")
    dtype = tensors[0][1].dtype
    if dtype.is_floating_point or dtype.is_complex:
        return Recipe("float", dtype)
    values = [t for _, t in tensors if t.numel()]
    if not values:
        return Recipe("ones", dtype)
    low = min(int(t.min()) for t in values)
    high = max(int(t.max()) for t in values)
    if dtype == torch.bool or (low >= 0 and high <= 1):
        return _mask_recipe(shapes.aligned.leaf_names[leaf], [t for _, t in tensors], dtype)
    offsets = [o for _, t in tensors if (o := _arange_offset(t)) is not None]
    if len(offsets) == len(tensors):
        # Rows of length 1 (decode steps) are arange-like only when they follow a variable.
        var = _matching_variable(shapes, [i for i, _ in tensors], offsets)
        if var is not None or any(t.shape[-1] > 1 for _, t in tensors):
            return Recipe("arange", dtype, low=offsets[0] if var is None else 0, offset_var=var)
    return Recipe("int", dtype, low, high)


def _mask_recipe(name: str, masks: list[torch.Tensor], dtype: torch.dtype) -> Recipe:
    """``ones`` for masks that were never padded, else a tokenizer-like ``mask`` recipe."""
    pad_value = 1 if "padding_mask" in name else 0  # torch's key_padding_mask: True is padding
    padded = [(m.reshape(-1, m.shape[-1]) == pad_value) for m in masks if m.ndim and m.numel()]
    if not any(bool(p.any()) for p in padded):  # never padded: no padding either
        return Recipe("ones", dtype) if pad_value == 0 else Recipe("int", dtype, 0, 0)
    left = any(bool((p[:, 0] & ~p[:, -1]).any()) for p in padded)
    return Recipe("mask", dtype, pad_value=pad_value, left=left)


def _arange_offset(t: torch.Tensor) -> int | None:
    """``c`` when every row of ``t`` is ``c, c+1, ...``, else ``None``."""
    if t.ndim == 0 or t.numel() == 0:
        return None
    start = t[..., :1]
    if not torch.equal(t, start + torch.arange(t.shape[-1], dtype=t.dtype)) or start.unique().numel() != 1:
        return None
    return int(start.flatten()[0])


def _matching_variable(shapes: ShapeModel, calls: list[int], offsets: list[int]) -> str | None:
    """The variable whose size equals the arange offset in every call, when offsets vary."""
    if len(set(offsets)) < 2:
        return None
    for var in shapes.variables:
        if all(var.values[i] == o for i, o in zip(calls, offsets)):
            return var.name
    return None
