"""Forget some inputs of recorded calls (``InputObserver.remove_inputs``)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from ..observe.recorder import Observation


def without_inputs(
    observations: Sequence[Observation], signature: inspect.Signature, input_names: Sequence[str | int]
) -> tuple[int, inspect.Signature]:
    """Remove the named (or positioned) inputs from every observation, in place; return how many
    values were removed and the signature without those parameters.

    Positional values after a removed one are passed by name; the extra keywords of
    ``**kwargs`` can be removed by name too. Unknown names remove nothing.
    """
    parameters = list(signature.parameters.values())
    names = set()
    for item in input_names:
        name = parameters[item].name if isinstance(item, int) and 0 <= item < len(parameters) else item
        if isinstance(name, str) and name in signature.parameters and signature.parameters[name].kind in (
            inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD
        ):
            raise ValueError(f"Cannot remove variadic argument {name!r}: remove the values it collects by name")
        names.add(name)
    removed = 0
    for observation in observations:
        removed += _remove(observation, signature, names)
    kept = [p for p in parameters if p.name not in names]
    return removed, signature.replace(parameters=kept)


def _remove(observation: Observation, signature: inspect.Signature, names: set[Any]) -> int:
    """Remove ``names`` from one observation; return how many values it held."""
    bound = signature.bind(*observation.args, **observation.kwargs).arguments
    n_positional = len(observation.args)
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    removed, by_name = 0, False
    for position, (name, parameter) in enumerate(signature.parameters.items()):
        if name not in bound:
            continue
        value = bound[name]
        if parameter.kind is parameter.VAR_KEYWORD:
            kept = {k: v for k, v in value.items() if k not in names}
            removed += len(value) - len(kept)
            kwargs.update(kept)
        elif name in names:
            removed += 1
            by_name = by_name or position < n_positional
        elif parameter.kind is parameter.VAR_POSITIONAL:
            if by_name:
                raise ValueError(f"cannot remove an argument given before *{name}")
            args.extend(value)
        elif position < n_positional and not by_name:
            args.append(value)
        else:
            kwargs[name] = value
    observation.args, observation.kwargs = tuple(args), kwargs
    return removed
