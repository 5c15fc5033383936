"""A condition on sizes (a runtime assert's, read back as sympy) decided at given sizes: on
Python integers where every function of it is exact on them, else by sympy's own evaluation
(about 50 times slower: a check decides thousands, a vision model's windows many more); a size
(how many elements the outputs hold) computed at given sizes."""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Mapping
from typing import Any

import sympy

from ...compat.torch_private import sympy_functions


def holds(condition: sympy.Basic, sizes: Mapping[str, int]) -> bool:
    """Whether ``sizes`` meet ``condition``; one that cannot be decided (a division by a size of
    0) excludes nothing.  Computed on Python integers where each function of the condition is
    exact on them (sympy's own evaluation, about 50 times slower, is the answer elsewhere)."""
    try:
        return bool(_integer_value(condition, sizes))
    except ZeroDivisionError:
        return True
    except _NotExact:
        pass
    try:
        return bool(condition.xreplace({s: sympy.Integer(sizes[str(s)]) for s in condition.free_symbols}))
    except (TypeError, ZeroDivisionError):
        return True


def integer_value(size: sympy.Basic, sizes: Mapping[str, int]) -> int | None:
    """``size`` computed on the integer ``sizes`` of its symbols; ``None`` where it has no exact
    integer value (a symbol ``sizes`` lacks, a function not exact on integers, a division by 0)."""
    try:
        return int(_integer_value(size, sizes))
    except (_NotExact, ZeroDivisionError):
        return None


class _NotExact(Exception):
    """A condition holds what :func:`_integer_value` does not compute exactly on integers."""


def _integer_value(expr: sympy.Basic, sizes: Mapping[str, int]) -> int | bool:
    """``expr`` computed on the integer ``sizes`` of its symbols, as sympy computes it; raises
    :class:`_NotExact` for a function or number that has no exact integer value here."""
    if isinstance(expr, sympy.Symbol):
        if expr.name not in sizes:
            raise _NotExact(expr.name)
        return sizes[expr.name]
    if isinstance(expr, sympy.Integer):
        return int(expr)
    if isinstance(expr, sympy.logic.boolalg.BooleanAtom):
        return bool(expr)
    operation = _exact_operations().get(type(expr))
    if operation is None:
        raise _NotExact(type(expr).__name__)
    return operation(*(_integer_value(arg, sizes) for arg in expr.args))


def _natural_power(base: int, exponent: int) -> int:
    if exponent < 0:
        raise _NotExact("a negative power")
    return base**exponent


@functools.cache
def _exact_operations() -> dict[type, Any]:
    """The functions of runtime asserts' conditions exact on integers, as Python computes them
    (sympy's and torch's modulo and floor division follow Python's signs)."""
    torch_functions = sympy_functions()
    exact: dict[str, Any] = {
        "FloorDiv": operator.floordiv, "CleanDiv": operator.floordiv, "Mod": operator.mod, "PythonMod": operator.mod,
        "Max": max, "Min": min, "PowByNatural": _natural_power,
    }
    return {
        sympy.Add: lambda *terms: sum(terms), sympy.Mul: lambda *factors: math.prod(factors),
        sympy.Pow: _natural_power, sympy.Mod: operator.mod, sympy.Max: max, sympy.Min: min,
        sympy.Eq: operator.eq, sympy.Ne: operator.ne, sympy.Lt: operator.lt, sympy.Le: operator.le,
        sympy.Gt: operator.gt, sympy.Ge: operator.ge,
        sympy.And: lambda *terms: all(terms), sympy.Or: lambda *terms: any(terms), sympy.Not: operator.not_,
        **{torch_functions[name]: operation for name, operation in exact.items() if name in torch_functions},
    }
