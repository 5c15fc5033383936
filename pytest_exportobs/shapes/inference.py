"""Infer dimension variables and relations from the sizes of aligned calls.

An axis is dynamic when its size varies across calls, when the first axis of an input named in
``set_batch_dimension_for``, when declared so, or (with roles on) when its role demands it (see
:mod:`.axis_roles`).  Dynamic axes of equal sizes in every call are one *variable* when they also
vary together, share a role, or belong to an input present in some calls only; a variable equal
in every call to the sum of others plus a constant is *derived*.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection
from dataclasses import dataclass

import torch

from ..core.vocabulary import AxisRole, DimSource
from ..observe.alignment import AlignedCalls
from .axis_roles import Role, axis_roles, cache_kind
from .dims import Axis, Relation, Variable

Sizes = dict[Axis, list[int | None]]


@dataclass(frozen=True)
class DimPolicy:
    """Which axes are dynamic besides the ones the calls vary: ``roles`` adds the axes whose
    role demands it (batch, sequence, cache and encoder lengths) and guesses on generic inputs;
    ``dynamic`` and ``static`` name axes (``input:axis``, e.g. ``pixel_values:2``) to add or pin;
    ``channels``: the channels the model declares it takes its input in (a generic ``(batch, 14,
    length)`` input of a model taking 14 channels is a signal, not ``(batch, seq, hidden)``)."""

    roles: bool = False
    dynamic: frozenset[str] = frozenset()
    static: frozenset[str] = frozenset()
    channels: frozenset[int] = frozenset()


AS_OBSERVED = DimPolicy()  # dynamic: what the calls vary (the peers' API)


def infer_variables(aligned: AlignedCalls, forced: set[Axis], policy: DimPolicy = AS_OBSERVED) -> list[Variable]:
    """The unnamed variables of the dynamic axes."""
    # absent inputs count 0 on their empty dimension (a prefill's past); with roles only caches
    # do, a mask or labels absent from a call says nothing of its size there
    empty = {leaf for leaf in aligned.missing_dims if not policy.roles or cache_kind(aligned, leaf) == "self"}
    sizes = _axis_sizes(aligned, empty)
    roles = axis_roles(aligned, channels=policy.channels) if policy.roles else {}
    declared, pinned = _named_axes(aligned, policy.dynamic), _named_axes(aligned, policy.static)
    sources: dict[Axis, DimSource] = {}
    for axis, values in sizes.items():
        role = roles.get(axis)
        reasons = {
            DimSource.DECLARED: axis in declared, DimSource.FORCED: axis in forced,
            DimSource.OBSERVED: len(set(_present(aligned, axis, values))) > 1,
            DimSource.ROLE: role is not None and role.demanded, DimSource.GUESS: role is not None and not role.demanded,
        }
        source = next((name for name in DimSource if reasons[name]), None)
        if source is not None and axis not in pinned:
            sources[axis] = source
    groups = _group(aligned, list(sources), sizes, roles, forced, join_partial=policy.roles)
    return [
        Variable(
            "", group, _merged(sizes, group), _stood_in(aligned, group),
            source=min((sources[a] for a in group), key=list(DimSource).index),
            role=next((roles[a].name for a in group if a in roles), None),
        )
        for group in groups
    ]


def _named_axes(aligned: AlignedCalls, keys: frozenset[str]) -> set[Axis]:
    """The axes named ``leaf:axis`` or ``input:axis`` (every leaf of that argument)."""
    axes: set[Axis] = set()
    for key in keys:
        name, _, dim = key.rpartition(":")
        leaves = _leaves_named(aligned, name)
        if not leaves or not dim.isdigit():
            raise ValueError(f"dims {key!r}: expected 'input:axis' with an input among {aligned.leaf_names}")
        axes.update((leaf, int(dim)) for leaf in leaves)
    return axes


def taken(aligned: AlignedCalls, keys: Collection[str]) -> frozenset[str]:
    """The axes among ``keys`` (``input:axis``) of an input these calls pass (a session-wide
    setting names inputs some models do not take)."""
    return frozenset(key for key in keys if _leaves_named(aligned, key.rpartition(":")[0]))


def _leaves_named(aligned: AlignedCalls, name: str) -> list[int]:
    """The leaves of the argument (or the leaf) called ``name``."""
    return [leaf for leaf, leaf_name in enumerate(aligned.leaf_names)
            if name in (leaf_name, aligned.leaf_slot(leaf).name)]


def forced_batch_axes(aligned: AlignedCalls, selector: bool | Collection[int | str] | None) -> set[Axis]:
    if not selector:
        return set()
    names = [s.name for s in aligned.slots]
    selected: set[str] = set()
    if selector is True:
        selected = set(names)
    else:
        for key in selector:
            if isinstance(key, int):
                if not 0 <= key < len(names):
                    raise ValueError(f"set_batch_dimension_for: no input at position {key}; inputs are {names}")
                selected.add(names[key])
            elif key in names:
                selected.add(key)
            else:
                raise ValueError(f"set_batch_dimension_for: no input named {key!r}; inputs are {names}")
    shapes = aligned.shapes()
    axes: set[Axis] = set()
    for slot in aligned.slots:
        if slot.name not in selected:
            continue
        for leaf in range(slot.start, slot.stop):
            ranks = {len(shape) for shape in (s[leaf] for s in shapes) if shape is not None}
            if ranks and ranks.pop() > 0:
                axes.add((leaf, 0))
    return axes


def _axis_sizes(aligned: AlignedCalls, empty: set[int]) -> Sizes:
    """Size of every tensor axis in every call; an absent input among ``empty`` counts 0 on its
    empty dimension, any other absent input is unknown."""
    shapes = aligned.shapes()
    sizes: Sizes = {}
    for leaf in range(len(aligned.leaf_names)):
        rank = next((len(shape) for shape in (s[leaf] for s in shapes) if shape is not None), 0)
        for dim in range(rank):
            sizes[(leaf, dim)] = [
                shape[dim] if shape is not None
                else (0 if leaf in empty and aligned.missing_dims.get(leaf) == dim else None)
                for shape in (s[leaf] for s in shapes)
            ]
    return sizes


def _present(aligned: AlignedCalls, axis: Axis, values: list[int | None]) -> list[int | None]:
    """Sizes of an axis in the calls where its input was present (the peers' semantics)."""
    return [v for v, call in zip(values, aligned.calls) if call[axis[0]] is not None]


def _group(
    aligned: AlignedCalls, axes: list[Axis], sizes: Sizes, roles: dict[Axis, Role], forced: set[Axis],
    join_partial: bool,
) -> list[list[Axis]]:
    """Axes of one variable: equal in every call where both are known, never of two roles, and
    varying together, of one role or both forced.  With ``join_partial``, an axis of an input
    present in some calls only then joins the variable it equals where present (preferring the
    same dimension)."""
    groups: list[list[Axis]] = []
    partial = [a for a in axes if join_partial and _is_partial(aligned, a) and a not in roles]
    for axis in [a for a in axes if a not in partial]:
        group = next((g for g in groups if _same_variable(g, axis, sizes, roles, forced)), None)
        if group is None:
            groups.append([axis])
        else:
            group.append(axis)
    for axis in partial:
        equal = [g for g in groups if _equal_where_present(aligned, sizes, g, axis)]
        equal.sort(key=lambda g: (g[0][1] != axis[1], axes.index(g[0])))
        if equal:
            equal[0].append(axis)
        else:
            groups.append([axis])
    return groups


def _same_variable(group: list[Axis], axis: Axis, sizes: Sizes, roles: dict[Axis, Role], forced: set[Axis]) -> bool:
    """Equal wherever both are known, and: of one role (alternative inputs never passed together,
    ``input_ids`` and ``inputs_embeds``, share their role's variable), or varying together, or
    both forced."""
    common = [(x, y) for x, y in zip(_merged(sizes, group), sizes[axis]) if x is not None and y is not None]
    if any(x != y for x, y in common):
        return False
    group_role = next((roles[a].name for a in group if a in roles), None)
    role = roles[axis].name if axis in roles else None
    if group_role and role:
        return group_role == role
    return len({x for x, _ in common}) > 1 or (bool(common) and axis in forced and all(a in forced for a in group))


def _is_partial(aligned: AlignedCalls, axis: Axis) -> bool:
    """Whether the axis's input is absent from some call."""
    return any(call[axis[0]] is None for call in aligned.calls)


def _equal_where_present(aligned: AlignedCalls, sizes: Sizes, group: list[Axis], axis: Axis) -> bool:
    merged = _merged(sizes, group)
    pairs = [(merged[i], size) for i, size in enumerate(sizes[axis]) if aligned.calls[i][axis[0]] is not None]
    return bool(pairs) and all(x == y for x, y in pairs)


def _stood_in(aligned: AlignedCalls, group: list[Axis]) -> list[bool]:
    """Per call, whether no input holding the variable was present (its size is a stand-in's)."""
    return [all(call[leaf] is None for leaf, _ in group) for call in aligned.calls]


def _merged(sizes: Sizes, group: list[Axis]) -> list[int | None]:
    columns = zip(*(sizes[axis] for axis in group))
    return [next((v for v in column if v is not None), None) for column in columns]


def derive_relations(variables: list[Variable]) -> list[Relation]:
    """Relations ``v = u + w (+ c)`` holding in every call where all three sizes are known.

    Larger variables are tried as sums first; a derived variable is no term of another.  A
    relation must be pinned down by the calls: ``u`` and ``w`` vary independently, and with a
    constant the calls outnumber the unknowns.  ``v = u + c`` is never inferred: test suites often
    grow two sizes together, which says nothing about the model.
    """
    order = sorted(range(len(variables)), key=lambda i: -max(variables[i].known, default=0))
    derived: set[int] = set()
    relations: list[Relation] = []
    for target in order:
        bases = [i for i in range(len(variables)) if i != target and i not in derived]
        found = next(
            (
                rel for terms in itertools.combinations(bases, 2)
                if (rel := _relation(variables, target, terms)) is not None
            ),
            None,
        )
        if found:
            relations.append(found)
            derived.add(target)
    return relations


def _relation(variables: list[Variable], target: int, terms: tuple[int, ...]) -> Relation | None:
    rows = [(row[0], row[1:]) for row in _known_together(variables, (target, *terms))]
    constants = {v - sum(ts) for v, ts in rows}
    if len(constants) != 1:
        return None
    constant = constants.pop()
    columns = [[1.0] * bool(constant) + [float(t) for t in ts] for _, ts in rows]
    unknowns = len(terms) + bool(constant)
    rank = torch.linalg.matrix_rank(torch.tensor(columns, dtype=torch.float64)).item()
    if rank < unknowns or (constant and len(rows) <= unknowns):
        return None
    return Relation(str(target), tuple(str(t) for t in terms), constant)


def role_relations(variables: list[Variable]) -> list[Relation]:
    """``total_seq = past_seq + seq`` between the variables of those roles, when it holds in every
    call: what a mask covering the cache and the new tokens means, even when the calls never
    varied the two independently.  Of several variables of one role (the length of
    ``inputs_embeds`` in the calls without ``input_ids``), those known together in most calls."""
    by_role: dict[AxisRole, list[int]] = {}
    for i, v in enumerate(variables):
        if v.role:
            by_role.setdefault(v.role, []).append(i)
    lengths = (AxisRole.TOTAL_SEQ, AxisRole.PAST_SEQ, AxisRole.SEQ)
    triples = itertools.product(*(by_role.get(r, []) for r in lengths))
    rows, (total, past, seq) = max(
        ((_known_together(variables, triple), triple) for triple in triples), key=lambda found: len(found[0]),
        default=([], (0, 0, 0)),
    )
    if not rows or any(t != p + s for t, p, s in rows):
        return []
    return [Relation(str(total), (str(past), str(seq)))]


def _known_together(variables: list[Variable], triple: tuple[int, ...]) -> list[tuple[int, ...]]:
    columns = [variables[i].values for i in triple]
    return [row for row in zip(*columns) if None not in row]
