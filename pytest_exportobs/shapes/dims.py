"""The vocabulary of shape inference: axes, dimension variables and the relations between them."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.vocabulary import AxisRole, DimSource

Axis = tuple[int, int]  # (flat leaf index, dimension)


@dataclass(frozen=True)
class Relation:
    """``derived = scale * sum(terms) + constant`` in every call (``scale`` with one term only:
    ``height = 2*height_k``, what torch proves for a side that a stride-2 layer halves)."""

    derived: str
    terms: tuple[str, ...]
    constant: int = 0
    scale: int = 1

    def __str__(self) -> str:
        rhs = " + ".join(self.terms)
        if self.scale != 1:
            rhs = f"{self.scale}*{rhs}"
        if self.constant:
            rhs += f" {'+' if self.constant > 0 else '-'} {abs(self.constant)}"
        return f"{self.derived} = {rhs}"

    def size(self, sizes: dict[str, int]) -> int:
        """The derived size given the sizes of the terms."""
        return self.scale * sum(sizes[t] for t in self.terms) + self.constant


@dataclass(frozen=True)
class Window:
    """``derived = min(term, limit)`` in the model's own states: a sliding window's cache length
    follows the full layers' until the window holds ``limit`` entries.  Sizes only; the graph
    takes the two as dims of their own."""

    derived: str
    term: str
    limit: int

    def __str__(self) -> str:
        return f"{self.derived} = min({self.term}, {self.limit})"

    @property
    def terms(self) -> tuple[str, ...]:
        return (self.term,)

    def size(self, sizes: dict[str, int]) -> int:
        """The derived size given the term's."""
        return min(sizes[self.term], self.limit)


@dataclass
class Variable:
    """A dimension variable: its axes, the size it had in each call (``None``: unknown), why it
    is dynamic and the role of its axes, if any."""

    name: str
    axes: list[Axis]
    values: list[int | None]
    stood_in: list[bool] = field(default_factory=list)  # the size is only an empty stand-in's 0
    source: DimSource = DimSource.OBSERVED
    role: AxisRole | None = None

    @property
    def known(self) -> list[int]:
        return [v for v in self.values if v is not None]

    @property
    def bounds(self) -> tuple[int, int]:
        return min(self.known), max(self.known)

    @property
    def demanded(self) -> bool:
        """Whether a deployment needs it dynamic (anything but a guess from a generic input)."""
        return self.source != DimSource.GUESS

    def recorded_bounds(self) -> tuple[int, int]:
        """Bounds over the sizes real inputs had (a stand-in's 0 left out)."""
        real = [v for v, stood_in in zip(self.values, self.stood_in) if v is not None and not stood_in]
        return (min(real), max(real)) if real else self.bounds
