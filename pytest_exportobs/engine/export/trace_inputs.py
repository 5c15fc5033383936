"""The inputs an export traces: a recorded call, else inputs made from the recorded ones.

:func:`example_to_trace` picks the first example (:func:`planned_example` the one it picks
when eager accepts it, without running eager); :func:`other_examples` the ones traced again when
torch pins a dim at the size the first one happens to have.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from ...core.trees import detached_clone
from ...core.vocabulary import AxisRole
from ...shapes.model import ShapeModel
from ...shapes.synthesis import example_leaves, free_variables, rows_repeated
from ..base.eager import ModelRaised, call_model
from .probe import SizeProbe, leaves_at
from .tracing import Example

MAX_RETRACES = 2  # recorded calls of other sizes traced when torch pins a dim at the example's size


def example_to_trace(call: Any, shapes: ShapeModel, constants: bool, notes: list[str]) -> Example:
    """The example to trace: a recorded call with every dynamic size >= 2, else synthesized
    inputs, else the richest recorded call with its batch of one repeated to two rows
    (synthesized inputs may break what ties inputs' values together: image tokens in the ids for
    the pixel values), both checked by running the module eagerly, else the richest recorded
    call (traced size-oblivious, a dynamic size of 0 or 1 stays dynamic)."""
    index = shapes.safe_call()
    if index is not None:
        return Example.of(shapes, shapes.call_leaves(index), constants)
    index, candidates = _made_examples(shapes)
    for what, make in candidates:
        candidate = make()  # the second only when eager rejects the first
        if candidate is None:
            continue
        args, kwargs = detached_clone(shapes.aligned.split_arguments(candidate))  # the call grows caches in place
        try:
            with torch.no_grad():
                call_model(call, *args, **kwargs)
        except ModelRaised as e:
            notes.append(f"{what} rejected by eager as an example ({type(e.error).__name__})")
            continue
        notes.append(f"no recorded call has every dynamic size >= 2: exported on {what}")
        return Example.of(shapes, candidate, constants)
    return Example.of(shapes, shapes.call_leaves(index), constants)


def planned_example(shapes: ShapeModel, constants: bool) -> Example:
    """The example :func:`example_to_trace` takes when eager accepts the first inputs it makes,
    found without running eager: the one an earlier trace took, which the export cache knows."""
    index = shapes.safe_call()
    if index is not None:
        return Example.of(shapes, shapes.call_leaves(index), constants)
    index, candidates = _made_examples(shapes)
    made = next((leaves for _, make in candidates if (leaves := make()) is not None), None)
    return Example.of(shapes, made if made is not None else shapes.call_leaves(index), constants)


def _made_examples(shapes: ShapeModel) -> tuple[int, list[tuple[str, Callable[[], list[Any] | None]]]]:
    """The richest recorded call, and the inputs made when no recorded call is fit to trace, in
    the order they are tried: what each is, and how it is made (``None``: it cannot be)."""
    index = shapes.aligned.complete_call()
    ones = {v.name: 2 for v in shapes.variables if v.role == AxisRole.BATCH and v.values[index] == 1}
    return index, [
        ("synthesized inputs", lambda: example_leaves(shapes)),
        (f"call {index} with its batch of one repeated to two rows", lambda: rows_repeated(shapes, index, ones)),
    ]


def other_examples(
    shapes: ShapeModel, example: Example, name: str, probe: SizeProbe | None,
) -> Iterator[tuple[str, list[Any]]]:
    """Examples where variable ``name`` has another size than in ``example``: recorded calls fit
    to trace (every input present, dynamic sizes >= 2), then inputs synthesized at a size one step
    of its largest power-of-two divisor above (32 -> 48), when eager accepts them."""
    var = next((v for v in shapes.variables if v.name == name), None)
    if var is None:
        return
    traced = max(example.leaves[leaf].shape[dim] for leaf, dim in var.axes
                 if isinstance(example.leaves[leaf], torch.Tensor))
    calls = [i for i in range(shapes.aligned.n_calls) if None not in shapes.aligned.calls[i]
             and not shapes.small_variables(i) and var.values[i] != traced]
    for index in calls[:MAX_RETRACES]:
        yield f"call {index}", shapes.call_leaves(index)
    size = traced + min(16, traced & -traced)
    if name in free_variables(shapes) and probe is not None and probe.accepts(name, size):
        yield f"inputs synthesized at {name}={size}", leaves_at(shapes, {name: size})
