"""Input structures: which recorded calls can share one graph signature.

Calls of one model differ in more than sizes: a 4-D mask beside 2-D ones, float labels beside
int64 ones, a ``StaticCache`` beside a ``DynamicCache``.  Each such structure is a graph signature
of its own; the engine infers shapes and plans graphs per structure family.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils import _pytree

from .binding import CONSTANT_TYPES, bind_all, is_absent, is_opaque

Call = tuple[tuple[Any, ...], dict[str, Any]]


def structure_families(calls: Sequence[Call], signature: inspect.Signature) -> list[list[int]]:
    """The calls grouped into families that can be aligned together, largest first.

    Two calls are of one family when every tensor argument both pass has the same tree structure
    (the cache class included) and the same rank and dtype leaf by leaf: a 4-D mask, float labels
    or a ``StaticCache`` beside a ``DynamicCache`` are another graph signature, never a reason to
    fail the model.  An argument a call lacks agrees with anything (it is stood in for).
    """
    keys: list[dict[str, Any]] = [{} for _ in calls]
    for sv in bind_all(calls, signature):
        for key, value in zip(keys, sv.values):
            if not is_absent(value) and not isinstance(value, CONSTANT_TYPES) and not is_opaque(value):
                key[sv.name] = _structure_key(value)
    families: list[tuple[dict[str, Any], list[int]]] = []
    for index, key in enumerate(keys):
        family = next((f for f in families if all(f[0].get(n, k) == k for n, k in key.items())), None)
        if family is None:
            families.append(({}, []))
            family = families[-1]
        family[0].update(key)
        family[1].append(index)
    return sorted((members for _, members in families), key=len, reverse=True)


def structure_difference(first: Call, other: Call, signature: inspect.Signature) -> str:
    """What sets call ``other``'s structure apart from call ``first``'s, argument by argument:
    ``attention_mask rank 4``, ``labels float32``, ``past_key_values StaticCache``."""
    parts = []
    for sv in bind_all([first, other], signature):
        a, b = sv.values
        if (is_absent(a) or is_absent(b) or isinstance(b, CONSTANT_TYPES) or is_opaque(b)
                or _structure_key(a) == _structure_key(b)):
            continue
        if isinstance(b, torch.Tensor) and isinstance(a, torch.Tensor):
            rank = [f"rank {b.dim()}"] * (a.dim() != b.dim())
            dtype = [str(b.dtype).removeprefix("torch.")] * (a.dtype != b.dtype)
            parts.append(" ".join([sv.name, *rank, *dtype]))
        else:
            parts.append(f"{sv.name} {type(b).__name__}")
    return ", ".join(parts)


def _structure_key(value: Any) -> tuple[str, tuple[Any, ...]]:
    leaves, spec = _pytree.tree_flatten(value)
    return str(spec), tuple((t.dtype, t.dim()) if isinstance(t, torch.Tensor) else type(t) for t in leaves)
