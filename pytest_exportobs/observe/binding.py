"""Bind recorded calls to a method's signature: the values each argument took, call by call.

Constant arguments (ints, floats, bools, strings) are told apart from tensors and nests: a graph
takes them as they are, not as inputs.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree

from ..core.string_type import string_type

CONSTANT_TYPES = (int, float, bool, str)


class UnsupportedInput(TypeError):
    """An argument torch.export cannot take (a numpy array, an object of an unregistered class)."""

    def __init__(self, name: str, value: Any):
        super().__init__(
            f"argument {name!r} holds a {type(value).__module__}.{type(value).__qualname__}: torch.export takes "
            "tensors, numbers, strings and pytrees of them; convert it where the model is called "
            "(torch.from_numpy for a numpy array) or register its class with torch.utils._pytree"
        )


@dataclass
class SlotValues:
    """The values one argument took over the calls (``None`` when absent)."""

    name: str
    values: list[Any]
    default: Any = inspect.Parameter.empty
    var_positional: bool = False
    var_keyword: bool = False


def per_call_constants(
    sv: SlotValues, values: list[Any], call_constants: list[dict[str, Any]]
) -> tuple[Any] | None:
    """Record in ``call_constants`` the value each call gives a constant argument when it is not
    the default; ``(first such value,)``, or ``None`` when every call leaves the default."""
    if any(isinstance(v, torch.Tensor) for v in values):
        uniform_constant(sv, values)  # raises: a tensor in some calls, a constant in others
    given = [(i, v) for i, v in enumerate(values) if v is not None and not _is_default(sv, v)]
    for i, value in given:
        call_constants[i][sv.name] = value
    return (given[0][1],) if given else None


def _is_default(sv: SlotValues, value: Any) -> bool:
    return sv.default is not inspect.Parameter.empty and value == sv.default


def missing_by_name(value_if_missing: dict[str | int, Any], names: list[str]) -> dict[str, Any]:
    return {(names[k] if isinstance(k, int) else k): v for k, v in value_if_missing.items()}


def bind_all(calls: Sequence[tuple[tuple, dict]], signature: inspect.Signature) -> list[SlotValues]:
    """One :class:`SlotValues` per argument name, in signature order, extra keywords last."""
    params = signature.parameters
    by_name: dict[str, SlotValues] = {}
    for name, p in params.items():
        if p.kind is p.VAR_KEYWORD:
            continue
        by_name[name] = SlotValues(name, [], p.default, var_positional=p.kind is p.VAR_POSITIONAL)
    for i, (args, kwargs) in enumerate(calls):
        try:
            bound = signature.bind(*args, **kwargs).arguments
        except TypeError as e:
            raise ValueError(f"call {i} does not match the signature {signature}: {e}") from e
        extra = {}
        for name, p in params.items():
            if p.kind is p.VAR_KEYWORD:
                extra = bound.get(name, {})
            elif name in bound:
                by_name[name].values.append(bound[name] if not by_name[name].var_positional else tuple(bound[name]))
        for name, value in extra.items():
            by_name.setdefault(name, SlotValues(name, [None] * i, var_keyword=True)).values.append(value)
        for sv in by_name.values():
            sv.values.extend([None] * (i + 1 - len(sv.values)))
    return list(by_name.values())


def is_opaque(value: Any) -> bool:
    """Whether an argument is no graph input: neither a tensor, a constant, array data (a numpy
    array, anything exposing ``__array__`` or ``__dlpack__``: data to convert) nor a pytree
    holding one, but an object only Python uses (a ``torch.Generator``, a callback, a logger).  It
    is bound as the tests passed it."""
    if value is None or isinstance(value, (torch.Tensor, *CONSTANT_TYPES)):
        return False
    leaves = _pytree.tree_leaves(value)
    return bool(leaves) and not any(isinstance(leaf, (torch.Tensor, *CONSTANT_TYPES, type(None)))
                                    or hasattr(leaf, "__array__") or hasattr(leaf, "__dlpack__") for leaf in leaves)


def value_text(value: Any) -> str:
    """What a key or a report reads of a non-tensor value: a constant's ``repr``, an opaque
    object's type (its ``repr`` holds an address, another in every run)."""
    return f"<{type(value).__module__}.{type(value).__qualname__}>" if is_opaque(value) else repr(value)


def is_absent(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, (torch.Tensor, *CONSTANT_TYPES)):
        return False
    return _pytree.tree_flatten(value)[1].num_leaves == 0


def uniform_constant(sv: SlotValues, values: list[Any]) -> tuple[Any] | None:
    """``(value,)`` of a constant argument, ``None`` when it equals the default."""
    seen = {repr(sv.default if v is None else v): (i, v) for i, v in enumerate(values)}
    if len(seen) > 1 or any(isinstance(v, torch.Tensor) for v in values):
        shown = ", ".join(
            f"call {i}: default {sv.default!r}" if v is None else f"call {i}: {string_type(v)}={v!r}"
            for i, v in seen.values()
        )
        raise ValueError(f"Two calls were made with different constant values for argument {sv.name!r}: {shown}")
    value = next(v for v in values if v is not None)
    return None if _is_default(sv, value) else (value,)
