"""Align recorded calls on one flat list of input leaves.

Calls to the same method differ: an optional input is absent at prefill and present later, an
empty cache has no tensor yet, arguments come by position or by name.  :func:`align_calls`
binds every call to the method's signature and lines the calls up on *slots* (one per
argument), each slot flattened with pytree into *leaves*; an absent value is ``None`` in every
leaf of its slot.  Downstream code (shape inference, export, verification) only sees flat leaves.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree

from ..core.strings import string_type
from ..core.trees import spec_structure

CONSTANT_TYPES = (int, float, bool, str)
SEQUENCE_AXIS_BY_RANK = {1: 0, 2: 1, 3: 1, 4: 2}


@dataclass(frozen=True)
class Slot:
    """One argument of the aligned calls.

    ``start``/``stop`` delimit its leaves in the flat list of a call; a constant slot has no
    leaf and holds ``constant``.  ``var_keyword`` marks an extra keyword collected by
    ``**kwargs``; ``var_positional`` the ``*args`` tuple.
    """

    name: str
    spec: _pytree.TreeSpec | None
    leaf_names: tuple[str, ...]
    start: int
    constant: Any = None
    is_constant: bool = False
    var_positional: bool = False
    var_keyword: bool = False

    @property
    def stop(self) -> int:
        return self.start + len(self.leaf_names)


@dataclass
class AlignedCalls:
    """Calls lined up on the same slots; ``calls[i][j]`` is leaf ``j`` of call ``i`` or ``None``."""

    slots: list[Slot]
    calls: list[list[Any]]
    positional: bool
    kwargs_name: str | None = None
    missing_dims: dict[int, int] = field(default_factory=dict)
    kept: list[int] = field(default_factory=list)  # index of each aligned call among the recorded ones
    notes: list[str] = field(default_factory=list)

    @property
    def n_calls(self) -> int:
        return len(self.calls)

    @property
    def leaf_names(self) -> list[str]:
        return [name for slot in self.slots for name in slot.leaf_names]

    def leaf_slot(self, leaf: int) -> Slot:
        """The slot a flat leaf belongs to."""
        return next(s for s in self.slots if s.start <= leaf < s.stop)

    def shapes(self) -> list[list[tuple[int, ...] | None]]:
        """Shape of every tensor leaf per call (``None`` for an absent input or a non-tensor)."""
        return [
            [tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in call]
            for call in self.calls
        ]

    def complete_call(self) -> int:
        """Index of the first call with every input present (else the one with most inputs)."""
        present = [sum(t is not None for t in call) for call in self.calls]
        return present.index(max(present))

    def is_tensor_leaf(self, leaf: int) -> bool:
        """Whether the leaf holds a tensor in some call (else a constant or ``None`` leaf)."""
        return any(isinstance(call[leaf], torch.Tensor) for call in self.calls)

    def absent_slots(self, index: int) -> list[str]:
        """Names of the inputs call ``index`` lacked (stood in for by empty tensors)."""
        return [
            s.name for s in self.slots
            if any(self.calls[index][leaf] is None and leaf in self.missing_dims for leaf in range(s.start, s.stop))
        ]

    def reference_tensor(self, leaf: int) -> torch.Tensor:
        """A recorded tensor of the leaf (its dtype, device and static sizes)."""
        return next(call[leaf] for call in self.calls if isinstance(call[leaf], torch.Tensor))

    def constants(self) -> dict[str, Any]:
        """The constant (non-tensor) arguments the calls share, by name."""
        return {s.name: s.constant for s in self.slots if s.is_constant}

    def split_arguments(
        self, leaves: Sequence[Any], constants: bool = True
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` to call the method with, rebuilt from flat leaves (without the
        constant arguments when ``constants`` is false)."""
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        for slot in self.slots:
            if slot.is_constant and not constants:
                continue
            value = self._slot_value(slot, leaves)
            if slot.var_positional:
                args.extend(value)
            elif self.positional:
                args.append(value)
            else:
                kwargs[slot.name] = value
        if any(s.var_positional for s in self.slots):
            # Arguments before *args cannot be passed by name.
            named = [s.name for s in self.slots if not s.var_positional]
            before = [n for n in named if n in kwargs and self._before_var_positional(n)]
            args = [kwargs.pop(n) for n in before] + args
        return tuple(args), kwargs

    def _before_var_positional(self, name: str) -> bool:
        names = [s.name for s in self.slots]
        star = next(i for i, s in enumerate(self.slots) if s.var_positional)
        return names.index(name) < star

    def arguments(self, leaves: Sequence[Any]) -> tuple[Any, ...] | dict[str, Any]:
        """Seed form of the arguments rebuilt from flat leaves: a tuple when every call was
        positional, else a dict in signature order."""
        args, kwargs = self.split_arguments(leaves)
        if not kwargs:
            return args
        if args:
            raise ValueError(
                "the method takes *args and keyword arguments: use "
                "AlignedCalls.split_arguments to get (args, kwargs)"
            )
        return kwargs

    def structure(self, per_leaf: Sequence[Any], constants: bool = True) -> tuple[Any, ...] | dict[str, Any]:
        """Arrange one value per flat leaf (e.g. dynamic shapes) like the arguments, with
        registered classes as lists of their flattened children, constants as ``None``.

        With ``constants`` false (the signature of :class:`~.export.BoundConstants`), constant
        arguments are left out and extra keywords are not nested under ``**kwargs``.
        """
        values: dict[str, Any] = {}
        for slot in self.slots:
            if slot.is_constant:
                if constants:
                    values[slot.name] = None
            else:
                values[slot.name] = spec_structure(slot.spec, iter(per_leaf[slot.start : slot.stop]))
        if self.positional:
            return tuple(values.values())
        extra = {s.name: values.pop(s.name) for s in self.slots if s.var_keyword and constants and s.name in values}
        if extra:
            values[self.kwargs_name] = extra
        return values

    def _slot_value(self, slot: Slot, leaves: Sequence[Any]) -> Any:
        if slot.is_constant:
            return slot.constant
        return _pytree.tree_unflatten(list(leaves[slot.start : slot.stop]), slot.spec)


@dataclass
class _SlotValues:
    """The values one argument took over the calls (``None`` when absent)."""

    name: str
    values: list[Any]
    default: Any = inspect.Parameter.empty
    var_positional: bool = False
    var_keyword: bool = False


def align_calls(
    calls: Sequence[tuple[tuple[Any, ...], dict[str, Any]]],
    signature: inspect.Signature,
    value_if_missing: dict[str | int, Any] | None = None,
    keep_majority: bool = False,
) -> AlignedCalls:
    """Bind every call to ``signature`` and line the calls up on flat leaves.

    Raises ``ValueError`` naming the argument and the calls when an argument changes structure
    or rank between calls, or when an absent input has no way to be stood in for.  Calls made
    with different constant arguments (``generate()`` passes ``use_cache=True``, a test does not)
    cannot share one graph: that is an error too, unless ``keep_majority`` keeps the calls of
    the most frequent configuration and says which were left out in ``notes``.
    """
    if not calls:
        raise ValueError("no call was recorded")
    params = signature.parameters
    kwargs_name = next((n for n, p in params.items() if p.kind is p.VAR_KEYWORD), None)
    missing = _missing_by_name(value_if_missing or {}, list(params))
    slots_values = _bind_all(calls, signature)
    kept, notes = list(range(len(calls))), []
    if keep_majority:
        kept, notes = _majority_configuration(slots_values)
        calls = [calls[i] for i in kept]
        slots_values = [dataclasses.replace(sv, values=[sv.values[i] for i in kept]) for sv in slots_values]
    positional = not any(kw for _, kw in calls) and not any(s.var_positional for s in slots_values)
    slots: list[Slot] = []
    flat_calls: list[list[Any]] = [[] for _ in calls]
    for sv in slots_values:
        values = [missing.get(sv.name) if _is_absent(v) else v for v in sv.values]
        if all(_is_absent(v) for v in values):
            continue
        if any(isinstance(v, CONSTANT_TYPES) for v in values):
            constant = _constant(sv, values)
            if constant is not None:
                slots.append(Slot(sv.name, None, (), 0, constant[0], True, sv.var_positional, sv.var_keyword))
                positional = False
            continue
        spec, leaves_per_call, reference = _flatten_slot(sv.name, values)
        start = len(flat_calls[0])
        slots.append(
            Slot(sv.name, spec, _leaf_names(sv.name, reference), start, None, False, sv.var_positional, sv.var_keyword)
        )
        for flat, leaves in zip(flat_calls, leaves_per_call):
            flat.extend(leaves)
    if [s.name for s in slots] != list(params)[: len(slots)]:
        positional = False  # a skipped argument would shift the positions
    aligned = AlignedCalls(slots, flat_calls, positional, kwargs_name, kept=kept, notes=notes)
    _check_ranks(aligned)
    aligned.missing_dims = _missing_dims(aligned)
    return aligned


def _majority_configuration(slots_values: list[_SlotValues]) -> tuple[list[int], list[str]]:
    """The calls sharing the most frequent constant arguments (the first seen on a tie), and a
    note naming what the others passed."""
    constant = [sv for sv in slots_values if any(isinstance(v, CONSTANT_TYPES) for v in sv.values)]
    n_calls = len(slots_values[0].values) if slots_values else 0

    def configuration(i: int) -> tuple[str, ...]:
        return tuple(f"{sv.name}={_shown(sv, sv.values[i])}" for sv in constant)

    counts = Counter(configuration(i) for i in range(n_calls))
    best = max(counts, key=lambda c: (counts[c], -[configuration(i) for i in range(n_calls)].index(c)))
    kept = [i for i in range(n_calls) if configuration(i) == best]
    if len(kept) == n_calls:
        return kept, []
    others = sorted({c for i in range(n_calls) if (c := configuration(i)) != best})
    return kept, [
        f"{n_calls - len(kept)} of {n_calls} calls left out: their constant arguments "
        f"({'; '.join(', '.join(c) for c in others)}) differ from the kept calls' ({', '.join(best)})"
    ]


def _shown(sv: _SlotValues, value: Any) -> str:
    if value is not None:
        return repr(value)
    return "absent" if sv.default is inspect.Parameter.empty else f"{sv.default!r} (default)"


def _missing_by_name(value_if_missing: dict[str | int, Any], names: list[str]) -> dict[str, Any]:
    return {(names[k] if isinstance(k, int) else k): v for k, v in value_if_missing.items()}


def _bind_all(calls: Sequence[tuple[tuple, dict]], signature: inspect.Signature) -> list[_SlotValues]:
    """One :class:`_SlotValues` per argument name, in signature order, extra keywords last."""
    params = signature.parameters
    by_name: dict[str, _SlotValues] = {}
    for name, p in params.items():
        if p.kind is p.VAR_KEYWORD:
            continue
        by_name[name] = _SlotValues(name, [], p.default, var_positional=p.kind is p.VAR_POSITIONAL)
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
            by_name.setdefault(name, _SlotValues(name, [None] * i, var_keyword=True)).values.append(value)
        for sv in by_name.values():
            sv.values.extend([None] * (i + 1 - len(sv.values)))
    return list(by_name.values())


def _is_absent(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, (torch.Tensor, *CONSTANT_TYPES)):
        return False
    return _pytree.tree_flatten(value)[1].num_leaves == 0


def _constant(sv: _SlotValues, values: list[Any]) -> tuple[Any] | None:
    """``(value,)`` of a constant argument, ``None`` when it equals the default."""
    seen = {repr(sv.default if v is None else v): (i, v) for i, v in enumerate(values)}
    if len(seen) > 1 or any(isinstance(v, torch.Tensor) for v in values):
        shown = ", ".join(
            f"call {i}: default {sv.default!r}" if v is None else f"call {i}: {string_type(v)}={v!r}"
            for i, v in seen.values()
        )
        raise ValueError(f"argument {sv.name!r} must keep one constant value across calls, got {shown}")
    value = next(v for v in values if v is not None)
    if sv.default is not inspect.Parameter.empty and value == sv.default:
        return None
    return (value,)


def _flatten_slot(name: str, values: list[Any]) -> tuple[_pytree.TreeSpec, list[list[Any]], Any]:
    """The common pytree spec of a slot, each call's leaves (``None`` where absent) and the
    value with most leaves."""
    flats = [None if _is_absent(v) else _pytree.tree_flatten(v) for v in values]
    reference = max(range(len(values)), key=lambda i: -1 if flats[i] is None else flats[i][1].num_leaves)
    spec = flats[reference][1]
    for i, flat in enumerate(flats):
        if flat is not None and flat[1] != spec:
            raise ValueError(
                f"argument {name!r} changes structure between calls: call {reference} gives "
                f"{string_type(values[reference], with_shape=True)}, call {i} gives "
                f"{string_type(values[i], with_shape=True)}"
            )
    leaves = [[None] * spec.num_leaves if flat is None else flat[0] for flat in flats]
    return spec, leaves, values[reference]


def _leaf_names(name: str, value: Any) -> tuple[str, ...]:
    """Readable names of a slot's leaves: ``x``, ``past_key_values.key_0``, ``inputs.0.a``."""
    paths, _ = _pytree.tree_flatten_with_path(value)
    return tuple(
        ".".join([name, *(_key_name(k) for k in path)]) for path, _ in paths
    )


def _key_name(key: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _check_ranks(aligned: AlignedCalls) -> None:
    for leaf, name in enumerate(aligned.leaf_names):
        ranks = {
            i: len(shape) for i, call in enumerate(aligned.shapes()) if (shape := call[leaf]) is not None
        }
        if len(set(ranks.values())) > 1:
            shown = ", ".join(f"call {i}: rank {r}" for i, r in ranks.items())
            raise ValueError(f"input {name!r} changes rank between calls ({shown})")


def _missing_dims(aligned: AlignedCalls) -> dict[int, int]:
    """For every leaf absent from some call, the dimension its empty stand-in has as 0.

    The last dimension other than the first (the batch) that varies across calls: the sequence
    of a cache or of position ids; else the sequence axis of the usual layouts: ``(batch, seq)``,
    ``(batch, seq, hidden)``, ``(batch, heads, seq, head_dim)``, ``(seq,)``.
    """
    shapes = aligned.shapes()
    dims: dict[int, int] = {}
    for leaf, name in enumerate(aligned.leaf_names):
        seen = [call[leaf] for call in shapes if call[leaf] is not None]
        if len(seen) == len(shapes) or not seen:
            continue
        rank = len(seen[0])
        varying = [d for d in range(1, rank) if len({s[d] for s in seen}) > 1]
        if varying:
            dims[leaf] = varying[-1]
        elif rank in SEQUENCE_AXIS_BY_RANK:
            dims[leaf] = SEQUENCE_AXIS_BY_RANK[rank]
        else:
            absent = [i for i, call in enumerate(shapes) if call[leaf] is None]
            raise ValueError(
                f"input {name!r} is absent from call(s) {absent} and was seen with the single "
                f"shape {seen[0]}: pass value_if_missing={{{name.split('.')[0]!r}: <empty tensor>}} "
                f"to say which dimension is empty"
            )
    return dims
