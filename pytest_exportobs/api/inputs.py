"""Dynamic shapes from explicit sets of inputs (no observation needed): the peers' ``ModelInputs``,
``all_dynamic_shape_from_inputs`` and onnx-diagnostic's ``use_dyn_not_str``.

Transformers caches among the inputs need no ``register_flattening_functions()`` block: these
functions register them while they flatten.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils import _pytree

from ..core.trees import flattening_context, spec_children, spec_structure
from ..observe.alignment import AlignedCalls, align_calls
from ..shapes.model import ShapeModel
from .dim_names import map_axes

Call = tuple[tuple[Any, ...], dict[str, Any]]
DynamicShapes = tuple[tuple[Any, ...], dict[str, Any]]


class ModelInputs:
    """Several sets of inputs of ``model.<method_name>``: each a tuple of positional arguments,
    a dict of keyword arguments, or an ``(args, kwargs)`` pair; ``inputs`` holds them as pairs.

    ``model`` may be ``None``: the arguments are then named after the inputs, keyword arguments
    in the order of the first set that has them all.
    """

    def __init__(
        self, model: torch.nn.Module | None, inputs: Sequence[Any], method_name: str = "forward", name: str = "main"
    ):
        if isinstance(inputs, (dict, str)) or not isinstance(inputs, Sequence):
            raise ValueError(f"inputs must be a list of sets of inputs, not {type(inputs).__name__}")
        self.model, self.method_name, self.name = model, method_name, name
        self.inputs: list[Call] = [_as_call(i, n) for n, i in enumerate(inputs)]
        self.signature = (
            inspect.signature(getattr(model, method_name)) if model is not None else _signature_of(self.inputs)
        )

    @property
    def true_model_name(self) -> str:
        """The model's class name."""
        return type(self.model).__name__

    @property
    def full_name(self) -> str:
        method = "" if self.method_name == "forward" else f".{self.method_name}"
        return f"{self.name}:{self.true_model_name}{method}"

    @property
    def module_name_type(self) -> str:
        method = "" if self.method_name == "forward" else f".{self.method_name}"
        return f"type({self.name})={self.true_model_name}{method}"

    def guess_dynamic_shapes(self, auto: bool | str = False) -> DynamicShapes:
        """``(args_ds, kwargs_ds)``: ``Dim.DYNAMIC`` for every dimension that varies across the
        sets, ``{}`` for a tensor none of whose dimensions vary, ``((), {})`` without inputs.

        ``auto=True`` puts ``Dim.AUTO`` instead, on every dimension when there is one set;
        a string names every dynamic dimension after its place, as onnx-diagnostic does:
        ``<auto>_<i>I`` for argument i (positional ones, then keywords by name), ``_<j>t``,
        ``_<j>l``, ``_<key>d``, ``_<j>o`` for the j-th item of a tuple, list, dict or other
        class (a cache), then the axis: ``dim_0I_1o2``.
        """
        if not self.inputs:
            return (), {}
        positional = list(self.signature.parameters)[: max(len(args) for args, _ in self.inputs)]
        with flattening_context():
            aligned = align_calls(self.inputs, self.signature)
            flat = _per_leaf(aligned, ShapeModel.from_aligned(aligned).leaf_axes(), auto, positional)
            by_name = {
                slot.name: None if slot.is_constant
                else spec_structure(slot.tree_spec, iter(flat[slot.start : slot.stop]))
                for slot in aligned.slots
            }
        return tuple(by_name.get(name) for name in positional), {
            name: ds for name, ds in by_name.items() if name not in positional
        }

    def move_to_kwargs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], dynamic_shapes: DynamicShapes
    ) -> tuple[tuple[()], dict[str, Any], DynamicShapes]:
        """Move positional arguments and their dynamic shapes to keyword ones, in signature order;
        the dynamic shapes of the extra keywords of ``**kwargs`` nest under its name, as
        ``torch.export`` requires."""
        parameters = self.signature.parameters
        names = [n for n, p in parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        args_ds, kwargs_ds = dynamic_shapes
        if len(args) > len(names):
            raise ValueError(f"{len(args)} positional arguments for a signature of {len(names)}")
        new_kwargs = {**dict(zip(names, args)), **kwargs}
        new_ds = {**dict(zip(names, args_ds)), **kwargs_ds}
        order = [n for n in names if n in new_kwargs] + [n for n in new_kwargs if n not in names]
        moved_ds = {n: new_ds.get(n) for n in order if n in names}
        var_keyword = next((n for n, p in parameters.items() if p.kind is p.VAR_KEYWORD), None)
        extras = {n: new_ds.get(n) for n in order if n not in names}
        if extras:
            moved_ds[var_keyword or "kwargs"] = extras
        return (), {n: new_kwargs[n] for n in order}, ((), moved_ds)


def all_dynamic_shape_from_inputs(inputs: Any, dim_prefix: Any = "d") -> Any:
    """Every dimension of every tensor dynamic, in the structure of ``inputs`` (registered
    classes such as caches become the list of their tensors): named
    ``<prefix>_<tensor index>_<dim>`` for a string prefix, else filled with ``dim_prefix``
    (``torch.export.Dim.AUTO`` or ``Dim.DYNAMIC``)."""
    with flattening_context():
        leaves, spec = _pytree.tree_flatten(inputs)
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    per_tensor = iter(
        {d: f"{dim_prefix}_{i}_{d}" for d in range(t.ndim)} if isinstance(dim_prefix, str)
        else dict.fromkeys(range(t.ndim), dim_prefix)
        for i, t in enumerate(tensors)
    )
    return spec_structure(spec, iter(next(per_tensor) if isinstance(t, torch.Tensor) else None for t in leaves))


all_dynamic_shapes_from_inputs = all_dynamic_shape_from_inputs


def use_dyn_not_str(dynamic_shapes: Any, default_value: Any = None) -> Any:
    """``dynamic_shapes`` with every string dim (``{0: "batch"}``, which ``torch.onnx.export``
    takes as axis names) replaced by ``Dim.DYNAMIC`` (or ``default_value``), which
    ``torch.export.export`` takes."""
    value = torch.export.Dim.DYNAMIC if default_value is None else default_value
    return map_axes(dynamic_shapes, lambda axes: {d: value if isinstance(v, str) else v for d, v in axes.items()})


def _per_leaf(
    aligned: AlignedCalls, axes: list[dict[int, str]], auto: bool | str, positional: list[str]
) -> list[dict[int, Any]]:
    """The dynamic shape of every flat leaf, as ``guess_dynamic_shapes(auto)`` renders it."""
    if isinstance(auto, str):
        return _place_names(aligned, axes, auto, positional)
    if auto and aligned.n_calls == 1:
        return [dict.fromkeys(range(t.dim()), torch.export.Dim.AUTO) if isinstance(t, torch.Tensor) else {}
                for t in aligned.calls[0]]
    return [dict.fromkeys(a, torch.export.Dim.AUTO if auto else torch.export.Dim.DYNAMIC) for a in axes]


def _place_names(
    aligned: AlignedCalls, axes: list[dict[int, str]], prefix: str, positional: list[str]
) -> list[dict[int, str]]:
    """onnx-diagnostic's names of the dynamic axes of every flat leaf (see ``guess_dynamic_shapes``)."""
    slots = [s for s in aligned.slots if not s.is_constant]
    by_position = [s for s in slots if s.name in positional]
    keywords = sorted((s for s in slots if s.name not in positional), key=lambda s: s.name)
    places: dict[int, str] = {}
    for group in (by_position, keywords):
        for i, slot in enumerate(group):
            for offset, place in enumerate(_leaf_places(slot.tree_spec, f"{prefix}_{i}I")):
                places[slot.start + offset] = place
    return [{d: f"{places[leaf]}{d}" for d in leaf_axes} for leaf, leaf_axes in enumerate(axes)]


def _leaf_places(spec: _pytree.TreeSpec, place: str) -> list[str]:
    """The place of every leaf under ``spec``, suffixed as onnx-diagnostic suffixes them."""
    if spec.is_leaf():
        return [place]
    kind = {tuple: "t", list: "l", dict: "d"}.get(spec.type, "o")
    return [
        leaf_place
        for j, child in enumerate(spec_children(spec))
        for leaf_place in _leaf_places(child, f"{place}_{spec.context[j] if kind == 'd' else j}{kind}")
    ]


def _as_call(inputs: Any, index: int) -> Call:
    if isinstance(inputs, dict):
        return (), inputs
    if isinstance(inputs, tuple) and len(inputs) == 2 and isinstance(inputs[0], tuple) and isinstance(inputs[1], dict):
        return inputs
    if isinstance(inputs, tuple):
        return inputs, {}
    raise ValueError(f"inputs[{index}] must be a tuple, a dict or an (args, kwargs) pair, got {type(inputs).__name__}")


def _signature_of(calls: list[Call]) -> inspect.Signature:
    """A signature taking the given calls: positional ``arg_<i>``, then the keywords in the order
    of the first call that has them all (else in order of appearance), every one optional."""
    n_args = max((len(args) for args, _ in calls), default=0)
    every = list(dict.fromkeys(k for _, kwargs in calls for k in kwargs))
    keywords = next((list(kwargs) for _, kwargs in calls if set(kwargs) == set(every)), every)
    P = inspect.Parameter
    return inspect.Signature(
        [P(f"arg_{i}", P.POSITIONAL_ONLY, default=None) for i in range(n_args)]
        + [P(name, P.KEYWORD_ONLY, default=None) for name in keywords]
    )
