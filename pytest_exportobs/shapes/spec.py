"""The shape model as a ``torch.fx.experimental.dynamic_spec`` spec (torch >= 2.14).

Named ``Dim`` objects only name the dims: ``total_seq = past_seq + seq`` is a note beside them.
A ``ShapesSpec`` states it: the attention mask's length is the expression ``past_seq + seq`` of
the two variables, and the exported program checks every input against it.  One ``ShapeVar``
per variable (each appears bare on one of its axes at least); a sum relation is the derived
axis' expression; a multiple (``height = 2*height_half``) is an assumption.
"""

from __future__ import annotations

import functools
from typing import Any

from ..core.trees import spec_children
from .model import ShapeModel


@functools.cache
def spec_api() -> Any:
    """``torch.fx.experimental.dynamic_spec``, or ``None`` before torch 2.14 (2.13 has a first
    version of the module that torch.export does not take)."""
    import torch

    if tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 14):
        return None
    from torch.fx.experimental import dynamic_spec

    return dynamic_spec


def to_shapes_spec(shapes: ShapeModel, constants: bool = True) -> Any:
    """The ``ShapesSpec`` of the shape model's dynamic dims for the method's parameters (the
    constant arguments left out with ``constants`` false, as a bound module takes them)."""
    api = spec_api()
    sizes = _sizes(shapes, api)
    per_leaf = [
        api.TensorSpec([sizes.get(axes[dim], api.STATIC) if dim in axes else api.STATIC for dim in range(rank)])
        if rank is not None else None
        for axes, rank in zip(shapes.leaf_axes(), _ranks(shapes))
    ]
    params: dict[str, Any] = {}
    keywords: dict[str, Any] = {}
    for slot in shapes.aligned.slots:
        if slot.is_constant:
            continue
        spec = _nested(api, slot.spec, iter(per_leaf[slot.start : slot.stop]))
        if slot.var_positional:
            params["*args"] = spec
        elif slot.var_keyword and constants:
            keywords[slot.name] = spec
        else:
            params[slot.name] = spec
    if keywords:
        params["**kwargs"] = keywords
    assumptions = [
        sizes[r.derived] % r.scale == 0 for r in shapes.relations if r.scale != 1 and r.derived in sizes
    ]
    return api.ShapesSpec(params=api.ParamsSpec(params), assumptions=assumptions or None)


def _sizes(shapes: ShapeModel, api: Any) -> dict[str, Any]:
    """A ``ShapeVar`` per variable with axes; a sum relation whose terms all have axes makes its
    derived variable that expression (torch checks it)."""
    sizes = {v.name: api.ShapeVar(v.name, min=0) for v in shapes.variables if v.axes}
    for relation in shapes.relations:
        if relation.scale == 1 and relation.derived in sizes and all(t in sizes for t in relation.terms):
            sizes[relation.derived] = sum((sizes[t] for t in relation.terms), relation.constant)
    return sizes


def _ranks(shapes: ShapeModel) -> list[int | None]:
    """The rank of every flat leaf that is a tensor (``None`` for the others)."""
    return [
        shapes.aligned.reference_tensor(leaf).dim() if shapes.aligned.is_tensor_leaf(leaf) else None
        for leaf in range(len(shapes.aligned.leaf_names))
    ]


def _nested(api: Any, spec: Any, leaves: Any) -> Any:
    """The spec of one argument following its pytree: tensors, dicts, lists and tuples, and
    registered classes (a cache) whose children are named by their context."""
    if spec.is_leaf():
        return next(leaves)
    children = [_nested(api, child, leaves) for child in spec_children(spec)]
    if spec.type is dict:
        return api.DictSpec(dict(zip(spec.context, children)))
    if spec.type in (list, tuple):
        return api.SeqSpec(children)
    names = spec.context if isinstance(spec.context, (list, tuple)) else getattr(spec.context, "names", [])
    return api.ObjectSpec(dict(zip(names, children)))
