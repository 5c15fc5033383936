"""Pytree helpers shared by the layers: copies, flat outputs, spec traversal, cache registration."""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch
from torch.utils import _pytree


def flattening_context() -> contextlib.AbstractContextManager:
    """Pytree registration of transformers caches, only when transformers is already imported.

    A model holding transformers caches implies transformers was imported; other models do not
    pay for importing it.
    """
    if "transformers" not in sys.modules:
        return contextlib.nullcontext()
    from .cache_pytrees import cache_registration

    return cache_registration()


def on_meta_device(value: Any) -> bool:
    """Whether a module's parameters or buffers, or a recorded call's inputs (an object with
    ``args`` and ``kwargs``), hold a tensor on the meta device (shapes, no values)."""
    if isinstance(value, torch.nn.Module):
        tensors: list[Any] = [*value.parameters(), *value.buffers()]
    else:
        with flattening_context():
            tensors = _pytree.tree_leaves((value.args, value.kwargs))
    return any(isinstance(t, torch.Tensor) and t.is_meta for t in tensors)


def detached_clone(tree: Any) -> Any:
    """Deep copy of every tensor of a pytree, detached from autograd."""
    return _pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), tree)


def flat_outputs(outputs: Any) -> list[torch.Tensor | None]:
    """The leaves of a model's outputs, tensors detached, anything else ``None``."""
    return [t.detach() if isinstance(t, torch.Tensor) else None for t in _pytree.tree_leaves(outputs)]


def spec_children(spec: _pytree.TreeSpec) -> list[_pytree.TreeSpec]:
    """The child specs (``children()`` replaces the deprecated ``children_specs`` in torch 2.10)."""
    return list(spec.children()) if hasattr(spec, "children") else list(spec.children_specs)


def spec_structure(spec: _pytree.TreeSpec, leaves: Any) -> Any:
    """Rebuild ``spec`` with ``leaves``, custom classes becoming the list of their children."""
    if spec.is_leaf():
        return next(leaves)
    children = [spec_structure(child, leaves) for child in spec_children(spec)]
    if spec.type is dict:
        return dict(zip(spec.context, children))
    if spec.type is tuple:
        return tuple(children)
    if spec.type is type(None):
        return None
    return list(children)


def spec_paths(spec: _pytree.TreeSpec, prefix: str = "") -> list[str]:
    """Dotted names of the leaves of ``spec`` (``logits``, ``past_key_values.key_0``): mapping
    keys, a registered class's context names, else positions."""
    if spec.is_leaf():
        return [prefix]
    children = spec_children(spec)
    context = spec.context
    named = isinstance(context, (list, tuple)) and len(context) == len(children)
    if named and all(isinstance(c, str) for c in context):
        keys = list(context)
    else:
        keys = [str(i) for i in range(len(children))]
    return [
        path for key, child in zip(keys, children) for path in spec_paths(child, f"{prefix}.{key}" if prefix else key)
    ]
