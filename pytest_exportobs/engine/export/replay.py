"""An export's outcome replayed from the export cache, and entries kept for the next run."""

from __future__ import annotations

from collections.abc import Callable

from ...shapes.model import ShapeModel
from .cache import ExportCache, ExportFailure, TraceEntry
from .domain import apply_refinements
from .outcome import ExportOutcome
from .tracing import Capture


def keep(outcome: ExportOutcome, cache: ExportCache, store: Callable[[], None]) -> None:
    """Store an entry for the next export; a cache that cannot be written costs that export its
    speed, not this model its verdict (a note)."""
    try:
        store()
    except OSError as e:
        note = f"the export cache {cache.directory} cannot be written ({e}): the next run exports again"
        if note not in outcome.notes:
            outcome.notes.append(note)


def failure_of(outcome: ExportOutcome) -> ExportFailure:
    """The failure of ``outcome`` as an entry keeps it (what :func:`failed_as_before` gives back)."""
    assert outcome.kind is not None
    return ExportFailure(outcome.stage, outcome.kind, outcome.error_type, outcome.reason, outcome.traceback,
                         outcome.pinned)


def failed_as_before(entry: TraceEntry, failure: ExportFailure, shapes: ShapeModel, outcome: ExportOutcome) -> None:
    """The outcome of an export that failed on an earlier run of the same trace."""
    outcome.ok = False
    outcome.stage, outcome.kind, outcome.error_type = failure.stage, failure.kind, failure.error_type
    outcome.reason, outcome.traceback, outcome.pinned = failure.reason, failure.traceback, failure.pinned
    restore(entry, shapes, outcome)
    outcome.notes = [*entry.notes, f"export cache hit: this trace failed at {failure.stage} on an earlier check with "
                                   "nothing it depends on changed since, not exported again"]


def restore(entry: TraceEntry, shapes: ShapeModel, outcome: ExportOutcome) -> None:
    """What the trace of ``entry`` established, into ``outcome``: the refinements of ``shapes``,
    the outputs' names and sizes and how torch was given the dims (a cache hit)."""
    outcome.cache_hit = True
    outcome.refinements, outcome.outputs, outcome.dims_form = entry.refinements, entry.outputs, entry.dims_form
    outcome.output_elements = entry.output_elements
    outcome.capture = Capture(strict=entry.strict, oblivious=entry.oblivious)
    outcome.shapes, _ = apply_refinements(shapes, entry.refinements)


def trace_entry(outcome: ExportOutcome, graph: str = "", failure: ExportFailure | None = None) -> TraceEntry:
    """What the trace of ``outcome`` established, as a trace entry keeps it."""
    capture = outcome.capture or Capture()
    return TraceEntry(graph, list(outcome.notes), outcome.refinements, outcome.outputs, outcome.dims_form, failure,
                      capture.strict, capture.oblivious, outcome.output_elements)
