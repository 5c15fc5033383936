"""Which recorded calls one exported graph serves.

A graph binds constant arguments and takes a fixed set of tensor arguments.  Calls are grouped by
their constants and by the tensor arguments they pass that have no meaningful stand-in (see
:mod:`..shapes.standins`): a call without ``labels`` cannot run on a graph that takes labels,
but a call without ``attention_mask`` can (ones stand in).  Each group is one graph, taking every
argument any of its calls passed.  When a stand-in does not reproduce a call after all, the
engine splits such calls off into a graph of their own (:func:`split_off`).  A size no role makes
dynamic that takes a few values, which torch pins or restricts, is a structure as a constant is:
its calls are planned again, a graph per value (:func:`by_choice`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..core.vocabulary import DimSource
from ..observe.alignment import AlignedCalls
from ..shapes.model import ShapeModel
from ..shapes.standins import stand_in_kind

# graphs exported per input structure at most (32 calls are stored per model); calls beyond are unverified
MAX_GRAPHS = 16
# a choice of structure is a small count (rotary sections, images): at most this many values, none larger
MAX_CHOICES, MAX_CHOICE_SIZE = 4, 16


@dataclass
class GraphPlan:
    """The calls (indices into the model's aligned calls) verified on one graph, the tensor
    arguments it takes, the constant arguments it binds and the variables it keeps static at the
    size its calls share (``pinned``: a choice of structure, ``why``)."""

    calls: list[int]
    slots: frozenset[str]
    constants: dict[str, Any] = field(default_factory=dict)
    name: str = ""
    pinned: dict[str, int] = field(default_factory=dict)
    why: str = ""

    def shapes(self, joint: ShapeModel) -> ShapeModel:
        """The shape model of the graph: ``joint`` on its calls and arguments, its pinned variables static."""
        shapes = joint.project(self.calls, self.slots)
        for name in self.pinned:
            shapes = shapes.without(name)
        return shapes


def plan_graphs(aligned: AlignedCalls) -> list[GraphPlan]:
    """One plan per group of calls sharing constants and arguments without stand-in, the group
    with most calls first (then the one taking most arguments)."""
    optional = stand_in_slots(aligned)
    groups: dict[tuple[str, frozenset[str]], list[int]] = {}
    for index in range(aligned.n_calls):
        key = (repr(sorted(_constants(aligned, index).items())), aligned.present_slots(index) - optional)
        groups.setdefault(key, []).append(index)
    plans = [
        GraphPlan(calls, frozenset().union(*(aligned.present_slots(i) for i in calls)), _constants(aligned, calls[0]))
        for calls in groups.values()
    ]
    plans.sort(key=lambda p: (-len(p.calls), -len(p.slots)))
    name_graphs(plans)
    return plans


def stand_in_slots(aligned: AlignedCalls) -> frozenset[str]:
    """The tensor arguments an absent value of which has a known meaning."""
    return frozenset(s.name for s in aligned.slots if not s.is_constant and stand_in_kind(aligned, s))


def can_serve(aligned: AlignedCalls, slots: frozenset[str], index: int) -> bool:
    """Whether a graph taking ``slots`` can run call ``index`` (absent arguments stood in)."""
    present = aligned.present_slots(index)
    return present <= slots and slots - present <= stand_in_slots(aligned)


def split_off(aligned: AlignedCalls, plan: GraphPlan, calls: Iterable[int]) -> list[GraphPlan]:
    """Plans for ``calls`` of ``plan`` that its stand-ins did not reproduce: one per set of
    arguments they actually passed."""
    groups: dict[frozenset[str], list[int]] = {}
    for index in calls:
        groups.setdefault(aligned.present_slots(index), []).append(index)
    return [GraphPlan(indices, slots, dict(plan.constants)) for slots, indices in groups.items()]


def choice(shapes: ShapeModel, name: str) -> bool:
    """Whether variable ``name`` is a choice of structure over the calls of ``shapes``: dynamic
    because the tests vary it, no role makes it so (not a batch, a length, a side, a cache), and
    it takes at most :data:`MAX_CHOICES` values, none past :data:`MAX_CHOICE_SIZE` (a length of
    raw audio is not a choice)."""
    var = next((v for v in shapes.variables if v.name == name), None)
    if var is None or var.role is not None or var.source != DimSource.OBSERVED:
        return False
    return 1 < len(set(var.known)) <= MAX_CHOICES and max(var.known) <= MAX_CHOICE_SIZE


def by_choice(joint: ShapeModel, plan: GraphPlan, name: str, why: str) -> list[GraphPlan]:
    """The plan's calls planned again by their size of variable ``name`` (a :func:`choice`): a
    graph per value, each keeping it static; ``why``: how torch restricts it."""
    var = next(v for v in joint.variables if v.name == name)
    groups: dict[int, list[int]] = {}
    for index in plan.calls:
        value = var.values[index]
        assert value is not None  # the tests vary it: every call of the plan has a size
        groups.setdefault(value, []).append(index)
    values = ", ".join(map(str, sorted(groups)))
    return [GraphPlan(calls, plan.slots, dict(plan.constants), ", ".join(filter(None, [plan.name, f"{name}={value}"])),
                      {**plan.pinned, name: value},
                      f"{name} is a choice of structure: the calls pass {values} and {why}; a graph per value")
            for value, calls in sorted(groups.items())]


def name_graphs(plans: list[GraphPlan]) -> None:
    """Name each plan by what sets it apart, shortest first: the inputs it takes that another
    plan lacks (``with labels``), else those it lacks (``without past_key_values``); then the
    constants it binds (``use_cache=True``) where inputs do not tell the plans apart.  A single
    plan has no name."""
    if len(plans) < 2:
        return
    every = frozenset().union(*(p.slots for p in plans))
    common = frozenset.intersection(*(p.slots for p in plans))
    keys = {k for p in plans for k in p.constants}
    varying = sorted(k for k in keys if len({repr(p.constants.get(k)) for p in plans}) > 1)
    by_inputs = [", ".join([f"with {s}" for s in sorted(p.slots - common)]
                           or [f"without {s}" for s in sorted(every - p.slots)]) for p in plans]
    for plan, inputs in zip(plans, by_inputs):
        parts = [inputs] if inputs else []
        if by_inputs.count(inputs) > 1:
            parts += [f"{k}={plan.constants[k]!r}" if k in plan.constants else f"{k} default" for k in varying]
        plan.name = ", ".join(parts) or "default arguments"
    names = [p.name for p in plans]
    for plan in plans:
        if names.count(plan.name) > 1:
            plan.name += f" (calls {', '.join(map(str, plan.calls))})"


def _constants(aligned: AlignedCalls, index: int) -> dict[str, Any]:
    return dict(aligned.call_constants[index]) if aligned.call_constants is not None else {}
