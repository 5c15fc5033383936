"""Infer dimension variables and relations from the sizes of aligned calls.

A dimension whose size varies across calls is dynamic (or the first one of an input named in
``set_batch_dimension_for``); dynamic dimensions equal in every call are one *variable*; a
variable equal in every call to the sum of others plus a constant is *derived*.
"""

from __future__ import annotations

import itertools

import torch

from ..observe.alignment import AlignedCalls
from .dims import Axis, Relation, Variable


def infer_variables(aligned: AlignedCalls, forced: set[Axis]) -> list[Variable]:
    """The unnamed variables of the dynamic axes (varying ones and ``forced`` ones)."""
    sizes = _axis_sizes(aligned)
    dynamic = [
        axis for axis, values in sizes.items()
        if axis in forced or len(set(_present(aligned, axis, values))) > 1
    ]
    groups = _group_equal(dynamic, sizes, forced)
    return [Variable("", group, _merged(sizes, group), _stood_in(aligned, group)) for group in groups]


def forced_batch_axes(aligned: AlignedCalls, selector: bool | set[int | str] | None) -> set[Axis]:
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
            ranks = {len(s[leaf]) for s in shapes if s[leaf] is not None}
            if ranks and ranks.pop() > 0:
                axes.add((leaf, 0))
    return axes


def _axis_sizes(aligned: AlignedCalls) -> dict[Axis, list[int | None]]:
    """Size of every tensor axis in every call; an absent input counts 0 on its empty dimension."""
    shapes = aligned.shapes()
    sizes: dict[Axis, list[int | None]] = {}
    for leaf in range(len(aligned.leaf_names)):
        rank = next((len(s[leaf]) for s in shapes if s[leaf] is not None), 0)
        for dim in range(rank):
            sizes[(leaf, dim)] = [
                s[leaf][dim] if s[leaf] is not None
                else (0 if aligned.missing_dims.get(leaf) == dim else None)
                for s in shapes
            ]
    return sizes


def _present(aligned: AlignedCalls, axis: Axis, values: list[int | None]) -> list[int]:
    """Sizes of an axis in the calls where its input was present (seed semantics)."""
    return [v for v, call in zip(values, aligned.calls) if call[axis[0]] is not None]


def _group_equal(dynamic: list[Axis], sizes: dict[Axis, list[int | None]], forced: set[Axis]) -> list[list[Axis]]:
    """Axes equal in every call where both are known, and seen varying together (or both forced)."""
    groups: list[list[Axis]] = []
    for axis in dynamic:
        for group in groups:
            if _same_variable(sizes[group[0]], sizes[axis], group[0] in forced and axis in forced):
                group.append(axis)
                break
        else:
            groups.append([axis])
    return groups


def _same_variable(a: list[int | None], b: list[int | None], both_forced: bool) -> bool:
    common = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    if not common or any(x != y for x, y in common):
        return False
    return both_forced or len({x for x, _ in common}) > 1


def _stood_in(aligned: AlignedCalls, group: list[Axis]) -> list[bool]:
    """Per call, whether no input holding the variable was present (its size is a stand-in's)."""
    return [all(call[leaf] is None for leaf, _ in group) for call in aligned.calls]


def _merged(sizes: dict[Axis, list[int | None]], group: list[Axis]) -> list[int | None]:
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
    rows = [
        (variables[target].values[c], [variables[t].values[c] for t in terms])
        for c in range(len(variables[target].values))
    ]
    rows = [(v, ts) for v, ts in rows if v is not None and None not in ts]
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
