"""The verdict on one model: a JSON-native dataclass the engine produces for the gate and the plugin.

Pure Python (no torch): the xdist controller and the gate read it without importing torch.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ...core.text import format_dims
from ...core.vocabulary import DimSource, Kind, Runtime, Stage, Target, Verdict


@dataclass(kw_only=True)
class ExportFiles:
    """What one export wrote and how: the export stage's outcome and the graph's result hold it."""

    onnx_path: str = ""
    program_path: str = ""  # the ExportedProgram (.pt2) with --export-target torch
    pte_path: str = ""  # the ExecuTorch program (.pte) with --export-target executorch
    delegation: dict[str, Any] = field(default_factory=dict)  # of the .pte: see export.lowering.Delegation
    dims_form: str = ""  # how torch was given the dims: ShapesSpec (torch >= 2.14, relations checked) or Dim
    cache_hit: bool = False
    opset: int | None = None
    op_counts: dict[str, int] = field(default_factory=dict)

    def hold_files(self, export: ExportFiles) -> None:
        """Hold what ``export`` wrote."""
        for name in EXPORT_FILES:
            setattr(self, name, getattr(export, name))


EXPORT_FILES = tuple(f.name for f in dataclasses.fields(ExportFiles))


@dataclass
class GraphResult(ExportFiles):
    """One exported graph of a model and the recorded calls verified on it: the unit of a check.

    ``calls`` are indices among the model's recorded calls, ``inputs`` the graph's inputs (leaf
    names, in order), ``constants`` the arguments it binds (``logits_to_keep=1`` from generate());
    ``dims`` are read back from the file written; ``dim_sources`` says why each dim is dynamic
    (``observed``, ``role``, ``guess``, ``declared``, ``forced``).
    """

    name: str
    verdict: Verdict = Verdict.FAILED
    stage: Stage = Stage.TORCH_EXPORT
    kind: Kind | None = None
    reason: str = ""
    calls: list[int] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)
    constants: dict[str, Any] = field(default_factory=dict)  # arguments bound in the graph
    dims: dict[str, dict[str, str]] = field(default_factory=dict)
    relations: list[str] = field(default_factory=list)
    dim_sources: dict[str, DimSource] = field(default_factory=dict)
    bounds: dict[str, list[int]] = field(default_factory=dict)
    max_abs: float | None = None
    max_rel: float | None = None
    runtime: Runtime | str = ""  # what ran the graph to verify it
    discrepancies: list[dict[str, Any]] = field(default_factory=list)
    variations: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    traceback: str = ""
    repro_path: str = ""
    localization: dict[str, Any] = field(default_factory=dict)  # of a mismatch: see localize.Localization
    upper_bounds: dict[str, dict[str, Any]] = field(default_factory=dict)  # ExecuTorch's: {"max": 26, "from": ...}

    @property
    def passed(self) -> bool:
        return self.verdict == Verdict.PASSED

    def renumber(self, ids: list[int]) -> None:
        """Number the calls as the model does, from ``ids[i]``: the number of this check's call ``i``."""
        self.calls = [ids[c] for c in self.calls]
        self.discrepancies = [d | {"index": ids[d["index"]]} for d in self.discrepancies]


VARIATION_COUNTS = ("tried", "valid", "invalid", "failed")


@dataclass
class ModelResult:
    """Everything known about one model's export check; every field is JSON-native.

    The model's own facts are fields; what its graphs found is summarized by properties (dims and
    files of the first graph, the largest differences, every discrepancy), written to JSON beside
    the fields.  A model passes when every graph passes and every call ran on one (:meth:`conclude`);
    on failure ``stage`` is the stage that failed and ``kind`` says what failed (see
    :class:`~..core.vocabulary.Kind`).
    """

    name: str
    verdict: Verdict
    target: Target | str = Target.ONNX
    stage: Stage | str = ""
    kind: Kind | None = None
    reason: str = ""
    traceback: str = ""
    repro_path: str = ""
    output: str = ""
    n_observations: int = 0
    n_calls: int = 0
    sources: list[str] = field(default_factory=list)
    model_class: str = ""
    reference: str = ""
    atol: float | None = None
    rtol: float | None = None
    env: dict[str, str] = field(default_factory=dict)
    expected_failure: str = ""  # the marker's xfail reason
    inferred: dict[str, Any] = field(default_factory=dict)  # dims, relations, bounds before any graph
    model_notes: list[str] = field(default_factory=list)  # on the model as a whole; graphs hold theirs
    model_timings: dict[str, float] = field(default_factory=dict)  # stages of the model as a whole (infer)
    graphs: list[GraphResult] = field(default_factory=list)
    # the check's results for its other targets (see per_target), until the session concludes
    other_targets: list[ModelResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.verdict == Verdict.PASSED

    def per_target(self, targets: Sequence[Target]) -> list[ModelResult]:
        """One result per target, named for it (:func:`target_name`): the check's own for each,
        and for a target it gave none of (a check that ended before that target's: time up, a
        crash, Ctrl-C, nothing to check), a copy of this result."""
        found = {Target(r.target): r for r in [self, *self.other_targets]}
        results = []
        for target in targets:
            result = found.get(target) or dataclasses.replace(self, target=target, other_targets=[])
            results.append(dataclasses.replace(result, name=target_name(self.name, target), other_targets=[]))
        return results

    @property
    def dims(self) -> dict[str, dict[str, str]]:
        return self.graphs[0].dims if self.graphs else self.inferred.get("dims", {})

    @property
    def relations(self) -> list[str]:
        return self.graphs[0].relations if self.graphs else self.inferred.get("relations", [])

    @property
    def bounds(self) -> dict[str, list[int]]:
        return self.graphs[0].bounds if self.graphs else self.inferred.get("bounds", {})

    @property
    def dim_sources(self) -> dict[str, DimSource]:
        return {name: source for g in self.graphs for name, source in g.dim_sources.items()}

    @property
    def onnx_path(self) -> str:
        return self.graphs[0].onnx_path if self.graphs else ""

    @property
    def pte_path(self) -> str:
        return self.graphs[0].pte_path if self.graphs else ""

    @property
    def cache_hit(self) -> bool:
        return bool(self.graphs) and self.graphs[0].cache_hit

    @property
    def opset(self) -> int | None:
        return self.graphs[0].opset if self.graphs else None

    @property
    def op_counts(self) -> dict[str, int]:
        return self.graphs[0].op_counts if self.graphs else {}

    @property
    def max_abs(self) -> float | None:
        return max((g.max_abs for g in self.graphs if g.max_abs is not None), default=None)

    @property
    def max_rel(self) -> float | None:
        return max((g.max_rel for g in self.graphs if g.max_rel is not None), default=None)

    @property
    def runtimes(self) -> list[str]:
        """What verified the graphs (``onnxruntime``, ``onnx-reference``), each once."""
        return sorted({str(g.runtime) for g in self.graphs if g.runtime})

    @property
    def discrepancies(self) -> list[dict[str, Any]]:
        return [d for g in self.graphs for d in g.discrepancies]

    @property
    def localization(self) -> dict[str, Any]:
        """Where the mismatch of the first graph localized comes from (``{}``: none was)."""
        return next((g.localization for g in self.graphs if g.localization), {})

    @property
    def variations(self) -> dict[str, int]:
        explored = [g.variations for g in self.graphs if g.variations]
        return {k: sum(v[k] for v in explored) for k in VARIATION_COUNTS} if explored else {}

    @property
    def notes(self) -> list[str]:
        """The model's notes, then each graph's (named when there are several)."""
        several = len(self.graphs) > 1
        return [*self.model_notes,
                *(f"[{g.name}] {note}" if several and g.name else note for g in self.graphs for note in g.notes)]

    @property
    def timings(self) -> dict[str, float]:
        """Seconds per stage, the model's and its graphs' added up."""
        total: Counter[str] = Counter(self.model_timings)
        for g in self.graphs:
            total.update(g.timings)
        return dict(total)

    @property
    def elapsed(self) -> float:
        return sum(self.timings.values())

    def dims_text(self) -> str:
        return format_dims(self.dims)

    def conclude(self, graphs: list[GraphResult], unverified: str) -> None:
        """The verdict from the graphs: the first failing graph's failure, else the calls no
        graph ran (``unverified``), else skipped when a graph could not run here, else passed."""
        self.graphs = graphs
        failing = next((g for g in graphs if not g.passed and g.verdict != Verdict.SKIPPED), None)
        skipped = next((g for g in graphs if g.verdict == Verdict.SKIPPED), None)
        if failing is None and not unverified and skipped is not None:  # exported, but not run here
            failing, self.verdict = skipped, Verdict.SKIPPED
        if failing is not None:
            self.stage, self.kind = failing.stage, failing.kind
            self.traceback, self.repro_path = failing.traceback, failing.repro_path
            # a graph has a name when the model has several: the checks past a failing one may not have run
            self.reason = f"[{failing.name}] {failing.reason}" if failing.name else failing.reason
        elif unverified:
            self.stage, self.kind, self.reason = Stage.VERIFY, Kind.UNVERIFIED, unverified
        else:
            self.verdict, self.stage = Verdict.PASSED, graphs[-1].stage

    def to_json(self) -> dict[str, Any]:
        """Plain JSON types only (the words as text): what xdist's channel and ``json`` carry;
        the fields, and the summaries of the graphs under their names."""
        summaries = {name: getattr(self, name) for name in SUMMARIES}
        others = {"other_targets": [other.to_json() for other in self.other_targets]}
        return json.loads(json.dumps(dataclasses.asdict(self) | summaries | others))

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelResult:
        """The result ``to_json`` wrote; of an object without graphs (a hand-written report), its
        ``dims``, ``relations`` and ``bounds`` are what was inferred."""
        values = _known_fields(cls, data)
        values["graphs"] = [GraphResult(**_known_fields(GraphResult, g)) for g in data.get("graphs", [])]
        values["other_targets"] = [cls.from_json(other) for other in data.get("other_targets", [])]
        if not values["graphs"] and "inferred" not in values:
            values["inferred"] = {k: data[k] for k in ("dims", "relations", "bounds") if k in data}
        return cls(**values)


def target_name(name: str, target: Target | str) -> str:
    """The name of a model's outcome for ``target``: the model's own for ONNX (or its quick
    stand-in, ``torch``), ``name[executorch]`` for ExecuTorch, so that junitxml, ``-rA`` and the
    baseline keep the targets of one model apart."""
    return name if target in (Target.ONNX, Target.TORCH) else f"{name}[{target}]"


SUMMARIES = tuple(name for name, value in vars(ModelResult).items()
                  if isinstance(value, property) and name not in ("passed", "elapsed"))


def _known_fields(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """The fields of ``cls`` in ``data``, the vocabulary's words as members."""
    known = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in data.items() if k in known}
    for name, words in (("verdict", Verdict), ("stage", Stage), ("kind", Kind), ("runtime", Runtime),
                        ("target", Target)):
        if values.get(name) in words._value2member_map_:
            values[name] = words(values[name])
    if values.get("kind") == "":  # reports written before a missing kind was None
        values["kind"] = None
    if "dim_sources" in values:
        values["dim_sources"] = {k: DimSource(v) for k, v in values["dim_sources"].items()}
    return values
