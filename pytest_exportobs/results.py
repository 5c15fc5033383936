"""The verdict on one model: a JSON-native dataclass shared by the engine, reports and baseline."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

PASSED, FAILED, SKIPPED, INCOMPLETE = "passed", "failed", "skipped", "incomplete"

# Stages in the order a check goes through them; a failure names the stage it stopped at.
STAGES = (
    "observe", "infer", "torch.export", "decompose", "onnx-translate", "onnx-checker",
    "ort-load", "verify", "variations",
)


def first_line(text: str, limit: int = 300) -> str:
    """The first non-blank line of a message, cut to ``limit`` characters."""
    return next((line.strip() for line in text.splitlines() if line.strip()), "")[:limit]


def error_line(error: BaseException) -> str:
    """``Type: first line of the message``: how a failure reads in a one-line reason."""
    return f"{type(error).__name__}: {first_line(str(error))}"


def format_dims(dims: dict[str, dict[Any, str]]) -> str:
    """``input_ids{0:batch,1:seq}`` for every input with a dynamic dimension, else ``static``."""
    parts = [f"{name}{{{','.join(f'{d}:{v}' for d, v in axes.items())}}}" for name, axes in dims.items() if axes]
    return " ".join(parts) or "static"


@dataclass
class ModelResult:
    """Everything known about one model's export check; every field is JSON-native.

    ``verdict`` is ``passed``/``failed``/``skipped``/``incomplete``; on failure ``stage`` is the
    stage that failed, ``kind`` is ``error`` (an exception), ``mismatch`` (numbers beyond
    tolerance), ``outputs`` (output count or shape differs), ``variation`` (a generated shape
    fails) or ``incomplete`` (the process checking it died).
    """

    name: str
    verdict: str
    stage: str = ""
    kind: str = ""
    reason: str = ""
    traceback: str = ""
    output: str = ""
    dims: dict[str, dict[str, str]] = field(default_factory=dict)
    relations: list[str] = field(default_factory=list)
    bounds: dict[str, list[int]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    n_observations: int = 0
    n_calls: int = 0
    sources: list[str] = field(default_factory=list)
    model_class: str = ""
    reference: str = ""
    max_abs: float | None = None
    max_rel: float | None = None
    atol: float | None = None
    rtol: float | None = None
    discrepancies: list[dict[str, Any]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    cache_hit: bool = False
    onnx_path: str = ""
    repro_path: str = ""
    opset: int | None = None
    op_counts: dict[str, int] = field(default_factory=dict)
    variations: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    expected_failure: str = ""  # the marker's xfail reason

    @property
    def passed(self) -> bool:
        return self.verdict == PASSED

    @property
    def elapsed(self) -> float:
        return sum(self.timings.values())

    def dims_text(self) -> str:
        return format_dims(self.dims)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelResult:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})
