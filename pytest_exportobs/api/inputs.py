"""Dynamic shapes from explicit sets of inputs (no observation needed): the seed's ``ModelInputs``."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils import _pytree

from ..core.trees import spec_structure
from ..observe.alignment import align_calls
from ..shapes.model import ShapeModel

Call = tuple[tuple[Any, ...], dict[str, Any]]


class ModelInputs:
    """Several sets of inputs of ``model.forward``: each a tuple of positional arguments, a dict
    of keyword arguments, or an ``(args, kwargs)`` pair."""

    def __init__(self, model: torch.nn.Module, inputs: Sequence[Any], method_name: str = "forward"):
        if not inputs:
            raise ValueError("ModelInputs needs at least one set of inputs")
        self.model = model
        self.signature = inspect.signature(getattr(model, method_name))
        self.calls = [_as_call(i, n) for n, i in enumerate(inputs)]

    def guess_dynamic_shapes(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args_ds, kwargs_ds)``: ``Dim.DYNAMIC`` for every dimension that varies across the sets."""
        aligned = align_calls(self.calls, self.signature)
        shapes = ShapeModel.from_aligned(aligned)
        flat = [dict.fromkeys(axes, torch.export.Dim.DYNAMIC) for axes in shapes.leaf_axes()]
        by_name = {
            slot.name: None if slot.is_constant else spec_structure(slot.spec, iter(flat[slot.start : slot.stop]))
            for slot in aligned.slots
        }
        n_args = max(len(args) for args, _ in self.calls)
        positional = list(self.signature.parameters)[:n_args]
        args_ds = tuple(by_name.get(name) for name in positional)
        kwargs_ds = {name: ds for name, ds in by_name.items() if name not in positional}
        return args_ds, kwargs_ds

    def move_to_kwargs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], dynamic_shapes: tuple[tuple[Any, ...], dict[str, Any]]
    ) -> tuple[tuple[()], dict[str, Any], tuple[tuple[()], dict[str, Any]]]:
        """Move positional arguments and their dynamic shapes to keyword ones, in signature order."""
        names = list(self.signature.parameters)
        args_ds, kwargs_ds = dynamic_shapes
        if len(args) > len(names):
            raise ValueError(f"{len(args)} positional arguments for a signature of {len(names)}")
        new_kwargs = {**dict(zip(names, args)), **kwargs}
        new_ds = {**dict(zip(names, args_ds)), **kwargs_ds}
        order = [n for n in names if n in new_kwargs] + [n for n in new_kwargs if n not in names]
        return (), {n: new_kwargs[n] for n in order}, ((), {n: new_ds.get(n) for n in order})


def all_dynamic_shape_from_inputs(inputs: Any, dim_prefix: str = "d") -> Any:
    """Every dimension of every tensor dynamic, named ``<prefix>_<tensor index>_<dim>``, in the
    structure of ``inputs`` (registered classes such as caches become the list of their tensors)."""
    leaves, spec = _pytree.tree_flatten(inputs)
    names = [
        {d: f"{dim_prefix}_{i}_{d}" for d in range(t.ndim)} if isinstance(t, torch.Tensor) else None
        for i, t in enumerate(leaves)
    ]
    return spec_structure(spec, iter(names))


all_dynamic_shapes_from_inputs = all_dynamic_shape_from_inputs


def _as_call(inputs: Any, index: int) -> Call:
    if isinstance(inputs, dict):
        return (), inputs
    if isinstance(inputs, tuple) and len(inputs) == 2 and isinstance(inputs[0], tuple) and isinstance(inputs[1], dict):
        return inputs
    if isinstance(inputs, tuple):
        return inputs, {}
    raise TypeError(f"inputs[{index}] must be a tuple, a dict or an (args, kwargs) pair, got {type(inputs).__name__}")
