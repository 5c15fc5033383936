"""The verdict on one model: a JSON-native dataclass the engine produces for the gate and the plugin.

Pure Python (no torch): the xdist controller and the gate read it without importing torch.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from ..core.text import format_dims
from ..core.vocabulary import DimSource, Kind, Stage, Verdict


@dataclass
class GraphResult:
    """One exported graph of a model and the recorded calls verified on it.

    ``calls`` are indices among the model's recorded calls, ``inputs`` the graph's inputs (leaf
    names, in order), ``constants`` the arguments it binds (``logits_to_keep=1`` from generate());
    ``dims`` are read back from the file written; ``dim_sources`` says why each dim is dynamic
    (``observed``, ``role``, ``guess``, ``declared``, ``forced``).
    """

    name: str
    verdict: Verdict = Verdict.FAILED
    stage: Stage = Stage.TORCH_EXPORT
    kind: Kind | str = ""
    reason: str = ""
    calls: list[int] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)
    constants: dict[str, Any] = field(default_factory=dict)  # arguments bound in the graph
    dims: dict[str, dict[str, str]] = field(default_factory=dict)
    relations: list[str] = field(default_factory=list)
    dim_sources: dict[str, DimSource] = field(default_factory=dict)
    bounds: dict[str, list[int]] = field(default_factory=dict)
    onnx_path: str = ""
    program_path: str = ""  # the ExportedProgram (.pt2) with --export-target torch
    dims_form: str = ""  # how torch was given the dims: ShapesSpec (torch >= 2.14, relations checked) or Dim
    cache_hit: bool = False
    opset: int | None = None
    op_counts: dict[str, int] = field(default_factory=dict)
    max_abs: float | None = None
    max_rel: float | None = None
    discrepancies: list[dict[str, Any]] = field(default_factory=list)
    variations: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    traceback: str = ""
    repro_path: str = ""

    @property
    def passed(self) -> bool:
        return self.verdict == Verdict.PASSED

    def renumber(self, ids: list[int]) -> None:
        """Number the calls as the model does, from ``ids[i]``: the number of this check's call ``i``."""
        self.calls = [ids[c] for c in self.calls]
        self.discrepancies = [d | {"index": ids[d["index"]]} for d in self.discrepancies]


@dataclass
class ModelResult:
    """Everything known about one model's export check; every field is JSON-native.

    On failure ``stage`` is the stage that failed and ``kind`` says what failed (see
    :class:`~..core.vocabulary.Kind`).  A model passes when every graph in ``graphs`` passes;
    the other fields summarize them (dims and files of the first graph).
    """

    name: str
    verdict: Verdict
    stage: Stage | str = ""
    kind: Kind | str = ""
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
    dim_sources: dict[str, DimSource] = field(default_factory=dict)
    graphs: list[GraphResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.verdict == Verdict.PASSED

    @property
    def elapsed(self) -> float:
        return sum(self.timings.values())

    def dims_text(self) -> str:
        return format_dims(self.dims)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON types only (the words as text): what xdist's channel and ``json`` carry."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelResult:
        values = _known_fields(cls, data)
        values["graphs"] = [GraphResult(**_known_fields(GraphResult, g)) for g in data.get("graphs", [])]
        return cls(**values)


def _known_fields(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """The fields of ``cls`` in ``data``, the vocabulary's words as members."""
    known = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in data.items() if k in known}
    for name, words in (("verdict", Verdict), ("stage", Stage), ("kind", Kind)):
        if values.get(name) in words._value2member_map_:
            values[name] = words(values[name])
    if "dim_sources" in values:
        values["dim_sources"] = {k: DimSource(v) for k, v in values["dim_sources"].items()}
    return values
