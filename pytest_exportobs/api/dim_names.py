"""String names of dynamic dimensions in the forms yobx's ``InputObserver`` takes.

``infer_dynamic_shapes(dim_names=...)`` renders these two on top of the dynamic shapes the
shape model infers:

* ``{input name or position: {axis: name}}``: every dynamic axis of that input gets the given
  name, any other dynamic axis ``<input>_dim_<axis>``;
* ``"llm"``: the names our shape model gives (``batch``, ``seq``, ...) spelled as LLM runtimes
  and yobx spell them (``batch_size``, ``sequence_length``, ...).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeGuard

import torch

from ..core.vocabulary import AxisRole

LLM = "llm"
LLM_DIM_NAMES: dict[str, str] = {  # our role names -> the names of ONNX Runtime GenAI and yobx
    AxisRole.BATCH: "batch_size",
    AxisRole.SEQ: "sequence_length",
    AxisRole.PAST_SEQ: "past_sequence_length",
    AxisRole.TOTAL_SEQ: "total_sequence_length",
    AxisRole.ENCODER_SEQ: "encoder_sequence_length",
}

Axes = dict[int, Any]


def is_per_input(dim_names: Any) -> TypeGuard[Mapping[str | int, Mapping[int, str]]]:
    """Whether ``dim_names`` is yobx's ``{input: {axis: name}}`` form."""
    return isinstance(dim_names, Mapping) and any(isinstance(v, Mapping) for v in dim_names.values())


def map_axes(shapes: Any, change: Callable[[Axes], Axes]) -> Any:
    """``shapes`` with every ``{axis: dim}`` dict replaced by ``change(axes)``."""
    if isinstance(shapes, dict) and all(isinstance(k, int) for k in shapes):
        return change(shapes)
    if isinstance(shapes, dict):
        return {k: map_axes(v, change) for k, v in shapes.items()}
    if isinstance(shapes, (list, tuple)):
        return type(shapes)(map_axes(v, change) for v in shapes)
    return shapes


def llm_names(named_shapes: Any) -> Any:
    """Named dynamic shapes with every ``torch.export.Dim`` replaced by its name, spelled as
    :data:`LLM_DIM_NAMES` spells it."""

    def spelled(axes: Axes) -> Axes:
        return {
            axis: LLM_DIM_NAMES.get(dim.__name__, dim.__name__) if isinstance(dim, torch.export.Dim) else dim
            for axis, dim in axes.items()
        }

    return map_axes(named_shapes, spelled)


def names_per_input(
    shapes: tuple[Any, ...] | dict[str, Any],
    dim_names: Mapping[str | int, Mapping[int, str]],
    parameters: list[str],
    kwargs_name: str | None,
) -> tuple[Any, ...] | dict[str, Any]:
    """Dynamic shapes with a string name on every dynamic axis: the one ``dim_names`` gives its
    input (by name or position) for that axis, else ``<input>_dim_<axis>``."""
    by_name = {(_parameter(parameters, k) if isinstance(k, int) else k): v for k, v in dim_names.items()}

    def named(name: str, tree: Any) -> Any:
        wanted = by_name.get(name, {})
        return map_axes(tree, lambda axes: {axis: wanted.get(axis, f"{name}_dim_{axis}") for axis in axes})

    if isinstance(shapes, tuple):
        return tuple(named(name, tree) for name, tree in zip(parameters, shapes))
    return {
        key: {k: named(k, v) for k, v in tree.items()} if key == kwargs_name and isinstance(tree, dict)
        else named(key, tree)
        for key, tree in shapes.items()
    }


def _parameter(parameters: list[str], position: int) -> str:
    if not 0 <= position < len(parameters):
        raise ValueError(f"dim_names: no argument at position {position} of {tuple(parameters)}")
    return parameters[position]
