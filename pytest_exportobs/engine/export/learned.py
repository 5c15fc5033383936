"""What torch.export said of a model's named dims, carried from one of its traces to the next.

torch.export rejects named dims only after a whole trace.  It rejects a dim that the model only
takes in steps, on guards that cannot wait as runtime asserts, and suggests ``height =
2*_height`` on a new root ``_height`` (diffusers' UNets: ``8*_height`` for UNet2DModel), or a
range (UNet2DConditionModel: ``batch = Dim('batch', max=63)``); it rejects a dim on guards no
fix expresses (a backbone's ``batch != 1``), and only ``Dim.DYNAMIC`` dims are taken then.
The graphs of one model (of every family of its calls: with and without labels, a cache or
none) run the same code on the same inputs' sides, so each would be rejected the same way, a
wasted trace each.
:class:`LearnedDims` keeps these lessons for the model's next traces: a derived dim or a range
is named so up front wherever the example's sizes are of its form; a dim rejected without a
fix sends the trace to ``Dim.DYNAMIC`` at once.  torch still rejects, and suggests again,
whatever else a trace needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree

from ...compat.torch_text import affine_of_root, dim_range


@dataclass(frozen=True)
class LearnedFix:
    """A fix torch suggested for a named dim, ``name = factor*root + offset`` with the root in
    ``[minimum, maximum]`` (a range: the dim itself), and its lines as torch wrote them."""

    name: str
    lines: tuple[str, ...]  # ("_height = Dim('_height', min=1, max=oo)", "height = 2*_height")
    factor: int = 1
    offset: int = 0
    minimum: int = 0
    maximum: float = math.inf

    def holds(self, size: int) -> bool:
        """Whether an axis of ``size`` is of this form."""
        root, rest = divmod(size - self.offset, self.factor)
        return rest == 0 and self.minimum <= root <= self.maximum


@dataclass
class LearnedDims:
    """What torch said of one model's named dims in its traces so far."""

    fixes: dict[str, LearnedFix] = field(default_factory=dict)  # derived dims and ranges, by dim name
    unfixed: set[str] = field(default_factory=set)  # dims rejected on guards no fix expresses

    def learn(self, fixes: list[tuple[str, str]]) -> None:
        """Keep the derived dims (``height = 2*_height`` with its root's ``_height =
        Dim('_height', min=1, max=oo)``) and the ranges (``batch = Dim('batch', max=63)``) among
        torch's suggested ``fixes``."""
        roots = dict(fixes)
        for name, fix in fixes:
            form = affine_of_root(fix)
            if form is not None and (limits := dim_range(roots.get(form[1], ""))) is not None:
                lines = (f"{form[1]} = {roots[form[1]]}", f"{name} = {fix}")
                self.fixes[name] = LearnedFix(name, lines, form[0], form[2], *limits)
            elif not name.startswith("_") and (limits := dim_range(fix)) is not None:
                self.fixes[name] = LearnedFix(name, (f"{name} = {fix}",), 1, 0, *limits)

    def refine(self, named: Any, sizes: dict[str, list[int]]) -> tuple[Any, list[LearnedFix]]:
        """``named`` (torch.export's dynamic shapes of named dims) with the fixes known for its
        dims, each where every axis of the dim (``sizes``, by name) is of the fix's form."""
        present = names(named)
        taken = [fix for name, fix in self.fixes.items()
                 if name in present and sizes.get(name) and all(fix.holds(size) for size in sizes[name])]
        if not taken:
            return named, []
        lines = "\n".join(line for fix in taken for line in fix.lines)
        return torch.export.dynamic_shapes.refine_dynamic_shapes_from_suggested_fixes(
            f"Suggested fixes:\n{lines}", named), taken


def names(named: Any) -> set[str]:
    """The names of the plain named dims in torch.export's dynamic shapes ``named``."""
    return {leaf.__name__ for leaf in _pytree.tree_leaves(named)
            if isinstance(leaf, torch.export.Dim) and leaf.__name__.isidentifier()}
