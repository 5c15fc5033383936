"""What the graphs of one model share while they are checked (:class:`ModelContext`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from ..core.trees import flat_outputs
from ..core.vocabulary import Stage, Target
from ..observe.recorder import Observation
from ..observe.store import ModelGroup
from ..shapes.model import ShapeModel
from .base.eager import call_model
from .base.settings import CheckSettings
from .export.learned import LearnedDims
from .export.pipeline import Traced
from .export.tracing_patches import TracingPatches
from .verify.arbiter import Float64Copy, Float64Model
from .verify.compare import Tolerance

T = TypeVar("T")
Runner = Callable[[list[Any]], list[Any]]


@dataclass
class ModelContext:
    """What the graphs of one model share: the group, settings, recorded calls and references
    (both indexed like the model's aligned calls), and how to run quietly and report progress."""

    group: ModelGroup
    settings: CheckSettings
    target: Target
    traces: dict[str, Traced]  # the programs traced for the model's targets, by trace key
    tolerance: Tolerance
    examples: int
    patches: TracingPatches
    model_dir: Path
    observations: list[Observation]
    references: list[list[Any]]
    quiet: Callable[[Callable[[], T]], T]
    progress: Callable[[Stage, str], None]
    ids: list[int]  # per call here, its number among the model's recorded calls
    module_digest: Any = None  # the module's, before the check called it (see ExportCache.module_digest)
    learned: LearnedDims = field(default_factory=LearnedDims)  # what torch said of the model's named dims so far
    _float64: Float64Copy | None = field(default=None, init=False, repr=False)

    @property
    def module(self) -> torch.nn.Module:
        return self.group.module

    @property
    def method(self) -> str:
        return self.group.options.method

    def eager(self, shapes: ShapeModel, flat: bool = True) -> Runner:
        """Run the module's method on flat leaves of ``shapes``' calls; its outputs flat, or as
        the module returns them.  What the model raises comes as :class:`ModelRaised`."""
        method = getattr(self.module, self.method)

        def run(leaves: list[Any]) -> Any:
            args, kwargs = shapes.aligned.split_arguments(leaves)
            outputs = call_model(method, *args, **kwargs)
            return flat_outputs(outputs) if flat else outputs

        return run

    def float64(self, shapes: ShapeModel) -> Float64Model:
        """The model run in float64 on flat leaves of ``shapes``' calls, the arbiter of a mismatch
        (one copy of the model, made when a mismatch first needs it)."""
        if self._float64 is None:
            self._float64 = Float64Copy(self.module)
        return Float64Model(self._float64, self.method, shapes.aligned.split_arguments)
