"""The vocabulary of shape inference: axes, dimension variables and the relations between them."""

from __future__ import annotations

from dataclasses import dataclass, field

Axis = tuple[int, int]  # (flat leaf index, dimension)


@dataclass(frozen=True)
class Relation:
    """``derived = sum(terms) + constant`` in every observed call."""

    derived: str
    terms: tuple[str, ...]
    constant: int = 0

    def __str__(self) -> str:
        rhs = " + ".join(self.terms)
        if self.constant:
            rhs += f" {'+' if self.constant > 0 else '-'} {abs(self.constant)}"
        return f"{self.derived} = {rhs}"


@dataclass
class Variable:
    """A dimension variable: its axes, the size it had in each call (``None``: unknown)."""

    name: str
    axes: list[Axis]
    values: list[int | None]
    stood_in: list[bool] = field(default_factory=list)  # the size is only an empty stand-in's 0

    @property
    def known(self) -> list[int]:
        return [v for v in self.values if v is not None]

    @property
    def bounds(self) -> tuple[int, int]:
        return min(self.known), max(self.known)

    def recorded_bounds(self) -> tuple[int, int]:
        """Bounds over the sizes real inputs had (a stand-in's 0 left out)."""
        real = [v for v, stood_in in zip(self.values, self.stood_in) if v is not None and not stood_in]
        return (min(real), max(real)) if real else self.bounds
