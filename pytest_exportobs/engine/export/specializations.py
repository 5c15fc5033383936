"""Where torch.export turned a size into a constant: the user's source line behind each guard, and
the failure that names it (:class:`Specialized`).

torch's "Constraints violated" message names the dimension and the constant, not the code that
forced it.  While tracing, torch logs each guard it adds and each symbol it replaces (logger
``torch.fx.experimental.symbolic_shapes``, level INFO); the records are emitted synchronously
where the guard is added, so the innermost frame of user code on the live stack is the line
responsible.  :class:`SpecializationLog` keeps, for every symbol replaced by an integer, that
line and the input size the symbol stood for.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ...compat.torch_text import SHAPES_LOGGER, guard_added, symbol_created, symbol_replaced
from ...core.vocabulary import DimSource
from ...shapes.model import ShapeModel
from ..base.frames import user_location


@dataclass(frozen=True)
class Specialization:
    """A symbol torch replaced by ``value``: the size it stands for (``L['x'].size()[0]``) and
    the user code whose guard forced it (``file:line: code``, empty when none was seen)."""

    symbol: str
    value: int
    source: str
    location: str


class SpecializationLog(logging.Handler):
    """A logging handler collecting :class:`Specialization` records (use :func:`logged_specializations`)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.sources: dict[str, str] = {}  # symbol -> the size it was created for
        self.guards: dict[str, list[tuple[str, str]]] = {}  # symbol -> (guard, user line), in order
        self.found: list[Specialization] = []

    def emit(self, record: logging.LogRecord) -> None:
        if created := symbol_created(record):
            symbol, size = created
            self.sources[symbol] = size
        elif guard := guard_added(record):
            location = user_location()
            if location:
                for symbol in self.sources:
                    if _mentions(guard, symbol):
                        self.guards.setdefault(symbol, []).append((guard, location))
        elif replaced := symbol_replaced(record):
            symbol, value = replaced
            last = self.guards.get(symbol, [("", "")])[-1][1]
            self.found.append(Specialization(symbol, value, self.sources.get(symbol, ""), last or user_location()))

    def bound_location(self, symbol: str) -> str:
        """The user line of the first inequality guard on ``symbol`` (what bounded it)."""
        return next((line for guard, line in self.guards.get(symbol, []) if "<" in guard or ">" in guard), "")

    def location_of(self, value: int, input_names: list[str]) -> str:
        """The model's line that made a size of one of ``input_names`` the constant ``value``: of
        the replacement torch made, else of a guard pinning one of their sizes to it, else of the
        first equality guard on one of their sizes."""
        matching = [s for s in self.found if s.value == value and s.location]
        named = [s for s in matching if any(f"['{name}']" in s.source for name in input_names)]
        if named or matching:
            return (named or matching)[0].location
        guards = [
            (guard, line) for symbol, guards in self.guards.items()
            if any(f"['{name}']" in self.sources.get(symbol, "") for name in input_names) for guard, line in guards
        ]
        pinned = [line for guard, line in guards if _mentions(guard, str(value))]
        # torch's solver may pin a size no guard names (EfficientViT-M's windows of a fixed grid):
        # the first equality on it is the line that tied it to the others
        equalities = [line for guard, line in guards if guard.startswith("Eq(")]
        return (pinned or equalities or [""])[0]


@contextmanager
def logged_specializations() -> Iterator[SpecializationLog]:
    """Collect specializations while the block traces.  The logger's INFO records go to the
    log alone (not to torch's console handler, nor pytest's): its handlers, level and
    propagation are restored after."""
    logger = logging.getLogger(SHAPES_LOGGER)
    log = SpecializationLog()
    saved = logger.handlers, logger.level, logger.propagate
    logger.handlers, logger.propagate = [log], False
    logger.setLevel(min(logging.INFO, logger.getEffectiveLevel()))
    try:
        yield log
    finally:
        logger.handlers, logger.propagate = saved[0], saved[2]
        logger.setLevel(saved[1])


def _mentions(expression: str, symbol: str) -> bool:
    """Whether ``symbol`` (``s12``) occurs in ``expression`` as a whole name (not ``s123``)."""
    start = expression.find(symbol)
    while start >= 0:
        end = start + len(symbol)
        before = expression[start - 1] if start else " "
        after = expression[end] if end < len(expression) else " "
        if not (before.isalnum() or before == "_") and not (after.isalnum() or after == "_"):
            return True
        start = expression.find(symbol, end)
    return False


class Specialized(Exception):
    """torch.export made a dynamic dim a constant, or bounded it below sizes eager accepts."""

    def __init__(self, shapes: ShapeModel, name: str, what: str, location: str, retrace: bool = True):
        var = next(v for v in shapes.variables if v.name == name)
        axes = ", ".join(f"{shapes.aligned.leaf_names[leaf]}.{dim}" for leaf, dim in var.axes)
        where = f" at {location}" if location else ""
        super().__init__(f"{name} ({axes}, {_why(var.source)}) {what} by torch.export{where}")
        self.name, self.what, self.location = name, what, location
        self.shapes = shapes  # the model as refined when torch pinned the dim (guessed dims made static)
        self.retrace = retrace  # whether tracing at another size may keep the dim (a pin may; a bound not)

    def pins_as(self, other: Specialized | None) -> bool:
        """Whether this pin is ``other``'s at another size: the same dim, at the same known line."""
        return other is not None and bool(self.location) and (self.name, self.location) == (other.name, other.location)


def _why(source: DimSource) -> str:
    return {
        DimSource.OBSERVED: "the tests vary it", DimSource.ROLE: "a deployment varies it",
        DimSource.DECLARED: "declared dynamic", DimSource.FORCED: "set_batch_dimension_for",
    }.get(source, source)
