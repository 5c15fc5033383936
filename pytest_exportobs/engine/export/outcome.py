"""What the export stages hand on: an :class:`ExportOutcome`, each stage timed by :class:`Stages`,
whose first exception becomes the outcome's failure."""

from __future__ import annotations

import contextlib
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ...core.vocabulary import Kind, Stage
from ...shapes.model import ShapeModel
from ..base.environment import EnvironmentProblem
from ..base.reasons import one_line_reason
from ..base.result import ExportFiles
from .domain import Refinement
from .lowering import UpperBound
from .specializations import Specialized
from .tracing import Capture, Example


@dataclass
class ExportOutcome(ExportFiles):
    """Result of the export stages, with the files they wrote; ``stage`` is the failing stage,
    or the last one done.

    ``kind`` of a failure: ``error`` (an exception) or ``specialized`` (a dynamic dim became a
    constant).  ``dims`` are read back from the file written (the program with target torch).
    """

    ok: bool
    stage: Stage
    shapes: ShapeModel  # the shape model, as far as the export refined it
    kind: Kind | None = None
    error_type: str = ""
    reason: str = ""
    traceback: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    program: Any = None
    bound: bool = False  # the exported module is a BoundConstants: its inputs are tensors only
    example: Example | None = None
    dims: dict[str, dict[str, str]] = field(default_factory=dict)
    refinements: list[Refinement] = field(default_factory=list)  # what the export established
    outputs: list[str] = field(default_factory=list)  # names of the graph's outputs
    output_elements: str = ""  # how many elements the outputs hold, by the variables (domain.output_elements)
    trace_key: str = ""  # the export cache's key of the trace ("" without a cache)
    capture: Capture | None = None  # how torch.export captured the program (None: not traced here)
    pinned: str = ""  # the variable torch pinned to a constant, when that failed the export
    # for each output of the ONNX file, the index of the traced program's output it is (empty: the same order)
    output_order: list[int] = field(default_factory=list)
    upper_bounds: dict[str, UpperBound] = field(default_factory=dict)  # of each variable (target executorch)


class StageFailed(Exception):
    """Raised inside :class:`Stages` to stop at the failing stage."""


class Stages:
    """Times named stages and turns the first exception into a failing outcome."""

    def __init__(self, outcome: ExportOutcome):
        self.outcome = outcome

    @contextlib.contextmanager
    def run(self, name: Stage) -> Iterator[None]:
        self.outcome.stage = name
        begin = time.perf_counter()
        try:
            yield
        except EnvironmentProblem:
            raise  # the machine's, not a failure of the stage
        except Exception as e:
            self.outcome.ok = False
            self.outcome.kind = Kind.SPECIALIZED if isinstance(e, Specialized) else Kind.ERROR
            self.outcome.error_type = type(e).__name__
            self.outcome.reason = str(e) if isinstance(e, Specialized) else one_line_reason(name, e)
            self.outcome.pinned = e.name if isinstance(e, Specialized) and e.retrace else ""  # a pin, not a bound
            self.outcome.traceback = "".join(traceback.format_exception(e))
            raise StageFailed(name) from e
        finally:
            self.outcome.timings[name] = self.outcome.timings.get(name, 0.0) + time.perf_counter() - begin
