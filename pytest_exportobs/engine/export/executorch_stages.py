"""The ExecuTorch stage of an export: the traced program lowered with the upper bounds of its
dims (stage ``lower``, see :mod:`.lowering`), and the ``.pte`` the export cache holds for it."""

from __future__ import annotations

from pathlib import Path

import torch

from ...core.files import copy_atomic
from ...core.vocabulary import Stage
from ...shapes.model import ShapeModel
from ..base.environment import writing
from .cache import ExportCache, LoweredEntry
from .lowering import UpperBound, lower, symbol_maxima, upper_bounds, within_torch_bounds
from .outcome import ExportOutcome, StageFailed, Stages
from .replay import failed_as_before, failure_of, keep, restore, trace_entry


def to_executorch(
    stages: Stages, program: torch.export.ExportedProgram, module: torch.nn.Module, path: Path,
    outcome: ExportOutcome, cache: ExportCache | None, state: dict[str, torch.Tensor],
) -> None:
    """Lower the program with the upper bounds of its dims and write ``path`` (stage ``lower``);
    the lowering, or its failure, kept in the export cache."""
    assert outcome.example is not None
    traced = trace_entry(outcome)
    inputs = outcome.example.inputs
    bounds = within_torch_bounds(program, outcome.shapes, inputs, upper_bounds(outcome.shapes, module))
    outcome.upper_bounds = bounds
    maxima = symbol_maxima(program, outcome.shapes, inputs, bounds)
    key = cache.lowered_key(outcome.trace_key, state) if cache is not None and outcome.trace_key else ""
    try:
        with stages.run(Stage.LOWER):
            outcome.delegation = lower(program, maxima, path).to_json()
    except StageFailed:
        if cache is not None and key:
            failure = failure_of(outcome)
            keep(outcome, cache, lambda: cache.store_lowered(key, LoweredEntry(traced, failure=failure), None))
        raise
    outcome.pte_path = str(path)
    if cache is not None and key:
        planned = {name: bound.to_json() for name, bound in bounds.items()}
        keep(outcome, cache, lambda: cache.store_lowered(key, LoweredEntry(traced, outcome.delegation, planned), path))


def load_lowered(
    cache: ExportCache, key: str, state: dict[str, torch.Tensor], path: Path,
    shapes: ShapeModel, outcome: ExportOutcome,
) -> bool:
    """Whether the export cache serves the lowering of trace ``key`` for these weights (``outcome``
    then set as the export would have it): its ``.pte`` written to ``path``, or its failure,
    or torch.export's failure of the trace (every target's)."""
    entry = cache.load_trace(key)
    if entry is not None and entry.failure is not None and entry.failure.stage == Stage.TORCH_EXPORT:
        failed_as_before(entry, entry.failure, shapes, outcome)
        return True
    found = cache.load_lowered(cache.lowered_key(key, state))
    if found is None:
        return False
    lowered, file = found
    if lowered.failure is not None:
        failed_as_before(lowered.trace, lowered.failure, shapes, outcome)
        return True
    with writing(Stage.LOWER, f"the ExecuTorch program {path}"):
        path.parent.mkdir(parents=True, exist_ok=True)
        copy_atomic(file, path)
    restore(lowered.trace, shapes, outcome)
    outcome.notes = [*lowered.trace.notes, "export cache hit: torch.export and lowering skipped"]
    outcome.stage, outcome.pte_path, outcome.delegation = Stage.LOWER, str(path), lowered.delegation
    outcome.upper_bounds = {name: UpperBound.from_json(bound) for name, bound in lowered.upper_bounds.items()}
    outcome.dims = outcome.shapes.to_json()["dims"]
    return True
