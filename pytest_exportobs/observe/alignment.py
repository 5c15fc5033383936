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
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree

from ..core.string_type import string_type
from ..core.trees import spec_paths, spec_structure
from .binding import (
    CONSTANT_TYPES,
    UnsupportedInput,
    bind_all,
    is_absent,
    is_opaque,
    missing_by_name,
    per_call_constants,
    uniform_constant,
)

SEQUENCE_AXIS_BY_RANK = {1: 0, 2: 1, 3: 1, 4: 2}


@dataclass(frozen=True)
class Slot:
    """One argument of the aligned calls.

    ``start``/``stop`` delimit its leaves in the flat list of a call; a constant slot has no
    leaf and holds ``constant``, an ``opaque`` one (see :func:`~.binding.is_opaque`) the first
    value the calls passed, whatever the others passed.  ``var_keyword`` marks an extra keyword
    collected by ``**kwargs``; ``var_positional`` the ``*args`` tuple.
    """

    name: str
    spec: _pytree.TreeSpec | None
    leaf_names: tuple[str, ...]
    start: int
    constant: Any = None
    is_constant: bool = False
    var_positional: bool = False
    var_keyword: bool = False
    opaque: bool = False

    @property
    def stop(self) -> int:
        return self.start + len(self.leaf_names)

    @property
    def tree_spec(self) -> _pytree.TreeSpec:
        """The pytree spec of a tensor argument (a constant one has none)."""
        assert self.spec is not None, f"the constant argument {self.name!r} has no pytree spec"
        return self.spec


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
    # with mixed constants: per call, the constant arguments that differ from their default
    call_constants: list[dict[str, Any]] | None = None

    @property
    def n_calls(self) -> int:
        return len(self.calls)

    @property
    def leaf_names(self) -> list[str]:
        return [name for slot in self.slots for name in slot.leaf_names]

    def leaf_slot(self, leaf: int) -> Slot:
        """The slot a flat leaf belongs to."""
        return next(s for s in self.slots if s.start <= leaf < s.stop)

    def present_slots(self, index: int) -> frozenset[str]:
        """The tensor arguments call ``index`` passed."""
        call = self.calls[index]
        return frozenset(
            s.name for s in self.slots
            if not s.is_constant and any(call[leaf] is not None for leaf in range(s.start, s.stop))
        )

    def subset(
        self, calls: Sequence[int], slots: Collection[str], strict: bool = True
    ) -> tuple[AlignedCalls, list[int]]:
        """The given calls on the tensor arguments named in ``slots``, with the constant arguments
        of the first call (with ``strict``, all must share them), and for each leaf of the
        result the leaf it is here."""
        constants = self.call_constants[calls[0]] if self.call_constants is not None else None
        if strict and self.call_constants is not None and any(self.call_constants[i] != constants for i in calls):
            raise ValueError("calls of one subset must share their constant arguments")
        kept_slots: list[Slot] = []
        origin: list[int] = []
        start = 0
        for slot in self.slots:
            if slot.is_constant:
                if constants is None or slot.opaque:
                    kept_slots.append(slot)
                elif slot.name in constants:
                    kept_slots.append(dataclasses.replace(slot, constant=constants[slot.name]))
            elif slot.name in slots:
                kept_slots.append(dataclasses.replace(slot, start=start))
                origin.extend(range(slot.start, slot.stop))
                start += len(slot.leaf_names)
        names = [s.name for s in self.slots]
        subset = AlignedCalls(
            kept_slots, [[self.calls[i][leaf] for leaf in origin] for i in calls],
            self.positional and [s.name for s in kept_slots] == names[: len(kept_slots)], self.kwargs_name,
            {new: self.missing_dims[old] for new, old in enumerate(origin) if old in self.missing_dims},
            [self.kept[i] for i in calls], list(self.notes),
        )
        return subset, origin

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

    def opaque_arguments(self) -> dict[str, Any]:
        """The arguments bound as the tests passed them (see :func:`~.binding.is_opaque`), by name."""
        return {s.name: s.constant for s in self.slots if s.opaque}

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

        With ``constants`` false (the signature of the engine's ``BoundConstants``), constant
        arguments are left out and extra keywords are not nested under ``**kwargs``.
        """
        values: dict[str, Any] = {}
        for slot in self.slots:
            if slot.is_constant:
                if constants:
                    values[slot.name] = None
            else:
                values[slot.name] = spec_structure(slot.tree_spec, iter(per_leaf[slot.start : slot.stop]))
        if self.positional:
            return tuple(values.values())
        extra = {s.name: values.pop(s.name) for s in self.slots if s.var_keyword and constants and s.name in values}
        if extra:
            assert self.kwargs_name is not None  # extra keywords come from a **kwargs parameter
            values[self.kwargs_name] = extra
        return values

    def _slot_value(self, slot: Slot, leaves: Sequence[Any]) -> Any:
        if slot.is_constant:
            return slot.constant
        return _pytree.tree_unflatten(list(leaves[slot.start : slot.stop]), slot.tree_spec)


def align_calls(
    calls: Sequence[tuple[tuple[Any, ...], dict[str, Any]]],
    signature: inspect.Signature,
    value_if_missing: dict[str | int, Any] | None = None,
    mixed_constants: bool = False,
) -> AlignedCalls:
    """Bind every call to ``signature`` and line the calls up on flat leaves.

    Raises ``ValueError`` naming the argument and the calls when an argument changes structure
    or rank between calls, or when an absent input has no way to be stood in for.  Calls made
    with different constant arguments (``generate()`` passes ``use_cache=True``, a test does not)
    cannot share one graph: that is an error too, unless ``mixed_constants`` records each call's
    constants in ``call_constants`` (the engine then exports one graph per configuration).
    """
    if not calls:
        raise ValueError("no call was recorded")
    params = signature.parameters
    kwargs_name = next((n for n, p in params.items() if p.kind is p.VAR_KEYWORD), None)
    missing = missing_by_name(value_if_missing or {}, list(params))
    slots_values = bind_all(calls, signature)
    positional = not any(kw for _, kw in calls) and not any(s.var_positional for s in slots_values)
    slots: list[Slot] = []
    flat_calls: list[list[Any]] = [[] for _ in calls]
    call_constants: list[dict[str, Any]] = [{} for _ in calls]
    for sv in slots_values:
        values = [missing.get(sv.name) if is_absent(v) else v for v in sv.values]
        if all(is_absent(v) for v in values):
            continue
        if all(is_absent(v) or is_opaque(v) for v in values):
            passed = next(v for v in values if not is_absent(v))
            slots.append(Slot(sv.name, None, (), 0, passed, True, sv.var_positional, sv.var_keyword, opaque=True))
            positional = False
            continue
        if any(isinstance(v, CONSTANT_TYPES) for v in values):
            if mixed_constants:
                constant = per_call_constants(sv, values, call_constants)
            else:
                constant = uniform_constant(sv, values)
            if constant is not None:
                slots.append(Slot(sv.name, None, (), 0, constant[0], True, sv.var_positional, sv.var_keyword))
                positional = False
            continue
        label = f"Positional argument {list(params).index(sv.name)}" if positional else f"Named argument {sv.name!r}"
        spec, leaves_per_call, reference = _flatten_slot(sv.name, label, values)
        start = len(flat_calls[0])
        slots.append(
            Slot(sv.name, spec, _leaf_names(sv.name, reference), start, None, False, sv.var_positional, sv.var_keyword)
        )
        for flat, leaves in zip(flat_calls, leaves_per_call):
            flat.extend(leaves)
    if [s.name for s in slots] != list(params)[: len(slots)]:
        positional = False  # a skipped argument would shift the positions
    aligned = AlignedCalls(slots, flat_calls, positional, kwargs_name, kept=list(range(len(calls))),
                           call_constants=call_constants if mixed_constants else None)
    _check_ranks(aligned)
    aligned.missing_dims = _missing_dims(aligned, strict=not mixed_constants)
    return aligned


def _flatten_slot(name: str, label: str, values: list[Any]) -> tuple[_pytree.TreeSpec, list[list[Any]], Any]:
    """The common pytree spec of a slot, each call's leaves (``None`` where absent) and the
    value with most leaves; ``label`` names the argument in errors as torch's InputObserver does."""
    flats = [None if is_absent(v) else _pytree.tree_flatten(v) for v in values]
    for flat in flats:
        unsupported = next((leaf for leaf in (flat[0] if flat else []) if not _exportable(leaf)), None)
        if unsupported is not None:
            raise UnsupportedInput(name, unsupported)
    # align_calls skips an argument absent from every call: some value is present
    reference, (_, spec) = max(
        ((i, flat) for i, flat in enumerate(flats) if flat is not None), key=lambda item: item[1][1].num_leaves
    )
    for i, flat in enumerate(flats):
        if flat is not None and flat[1] != spec:
            count = (
                f"{label} has {flat[1].num_leaves} tensors but previously got {spec.num_leaves} tensors"
                if flat[1].num_leaves != spec.num_leaves else f"{label} changes structure between calls"
            )
            raise ValueError(
                f"{count}: call {reference} gives {string_type(values[reference], with_shape=True)}, "
                f"call {i} gives {string_type(values[i], with_shape=True)}"
            )
    leaves = [[None] * spec.num_leaves if flat is None else flat[0] for flat in flats]
    return spec, leaves, values[reference]


def _exportable(leaf: Any) -> bool:
    return leaf is None or isinstance(leaf, (torch.Tensor, *CONSTANT_TYPES))


def _leaf_names(name: str, value: Any) -> tuple[str, ...]:
    """Readable names of a slot's leaves: ``x``, ``past_key_values.key_0``, ``inputs.0.a``; from
    the pytree spec when a class is registered without key paths (transformers 4.57's model
    outputs)."""
    try:
        paths = [".".join(_key_name(k) for k in path) for path, _ in _pytree.tree_flatten_with_path(value)[0]]
    except ValueError:  # "Did not find a flatten_with_keys_fn"
        paths = spec_paths(_pytree.tree_flatten(value)[1])
    return tuple(f"{name}.{path}" if path else name for path in paths)


def _key_name(key: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _check_ranks(aligned: AlignedCalls) -> None:
    shapes = aligned.shapes()
    for leaf, name in enumerate(aligned.leaf_names):
        by_rank: dict[int, list[int]] = {}
        for i, call in enumerate(shapes):
            if (shape := call[leaf]) is not None:
                by_rank.setdefault(len(shape), []).append(i)
        if len(by_rank) > 1:
            ordered = sorted(by_rank.items(), key=lambda item: -len(item[1]))
            shown = "; ".join(f"rank {r} in call{'s' * (len(c) > 1)} {_spans(c)}" for r, c in ordered)
            raise ValueError(f"input {name!r} changes rank between calls ({shown})")


def _spans(indices: list[int]) -> str:
    """``0-3, 7`` for ``[0, 1, 2, 3, 7]``."""
    spans: list[list[int]] = []
    for i in indices:
        if spans and spans[-1][-1] == i - 1:
            spans[-1][-1] = i
        else:
            spans.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _missing_dims(aligned: AlignedCalls, strict: bool = True) -> dict[int, int]:
    """For every leaf absent from some call, the dimension its empty stand-in has as 0.

    The last dimension other than the first (the batch) that varies across calls: the sequence
    of a cache or of position ids; else the sequence axis of the usual layouts: ``(batch, seq)``,
    ``(batch, seq, hidden)``, ``(batch, heads, seq, head_dim)``, ``(seq,)``.  Otherwise an error
    when ``strict``, else no empty stand-in for that leaf.
    """
    shapes = aligned.shapes()
    dims: dict[int, int] = {}
    for leaf, name in enumerate(aligned.leaf_names):
        seen = [shape for shape in (call[leaf] for call in shapes) if shape is not None]
        if len(seen) == len(shapes) or not seen:
            continue
        rank = len(seen[0])
        varying = [d for d in range(1, rank) if len({s[d] for s in seen}) > 1]
        if varying:
            dims[leaf] = varying[-1]
        elif rank in SEQUENCE_AXIS_BY_RANK:
            dims[leaf] = SEQUENCE_AXIS_BY_RANK[rank]
        elif strict:
            absent = [i for i, call in enumerate(shapes) if call[leaf] is None]
            raise ValueError(
                f"input {name!r} is absent from call(s) {absent} and was seen with the single "
                f"shape {seen[0]}: pass value_if_missing={{{name.split('.')[0]!r}: <empty tensor>}} "
                f"to say which dimension is empty"
            )
    return dims
