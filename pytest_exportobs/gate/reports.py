"""JSON and Markdown reports of a session's export checks (the Markdown suits a CI step summary),
and the reading of a JSON report back."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.files import json_text, write_atomic
from ..core.vocabulary import Verdict
from ..engine.base.result import ModelResult
from .baseline import CHECKS, Checks, dict_of, is_a, list_of, load_json, require, require_version, validated_model
from .judge import Gate, GateEntry

REPORT_SCHEMA_VERSION = 1
_COLUMNS = ("model", "outcome", "stage", "dynamic dims", "obs", "max abs Δ", "verified by", "time")
_CHANGE_COLUMNS = ("model", "before", "now", "versions changed")
# The fields of a reported model that are read back (what the gate judges), with their checks.
_RESULT_CHECKS: Checks = {
    **CHECKS,
    "env": (dict_of(is_a(str)), "an object of strings"),
    "reason": (is_a(str), "a string"),
    "expected_failure": (is_a(str), "a string"),
    "graphs": (list_of(is_a(dict)), "a list of objects"),
}


@dataclass
class Report:
    """The models of a JSON report, as far as the gate needs them (verdict, stage, dims, versions…)."""

    results: list[ModelResult]

    @classmethod
    def from_json(cls, data: Any) -> Report:
        """Validate a decoded report; raises BaselineError describing the first problem."""
        require_version(data, REPORT_SCHEMA_VERSION, "report")
        require(data.get("models"), list_of(is_a(dict)), "models", "a list of objects")
        results = []
        for index, item in enumerate(data["models"]):
            require(item.get("name"), is_a(str), f"models[{index}].name", "a string")
            validated_model(item["name"], item, _RESULT_CHECKS)
            results.append(ModelResult.from_json(item))
        return cls(results)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Report:
        """Read a JSON report; any problem (missing, unreadable, invalid) raises BaselineError."""
        return load_json(path, cls.from_json)


def write_reports(
    path: str | os.PathLike[str], results: Iterable[ModelResult], gate: Gate | None, env: dict[str, str]
) -> list[Path]:
    """Write the JSON report at ``path`` and the Markdown report beside it; return both paths."""
    path = Path(path)
    results = sorted(results, key=lambda r: r.name)
    return [
        write_atomic(path, json_text(_report_json(results, gate, env))),
        write_atomic(path.with_suffix(".md"), _markdown(results, gate, env)),
    ]


def _report_json(results: list[ModelResult], gate: Gate | None, env: dict[str, str]) -> dict[str, Any]:
    return {
        "schema_version": REPORT_SCHEMA_VERSION,
        "env": env,
        "gate": gate.to_json() if gate is not None else None,
        "models": [r.to_json() for r in results],
    }


def _markdown(results: list[ModelResult], gate: Gate | None, env: dict[str, str]) -> str:
    entries = {e.name: e for e in gate.entries} if gate is not None else {}
    notes = [f"- {e.name}: {note}" for e in entries.values() for note in e.notes]
    blocks = [
        "# exportobs report",
        gate.summary_line() if gate is not None else "",
        _table(results, entries),
        _changes(gate) if gate is not None and gate.changes else "",
        "\n".join(["## Notes", "", *notes]) if notes else "",
        *(_section(r, entries.get(r.name)) for r in results),
        "Environment: " + ", ".join(f"{key} {value}" for key, value in sorted(env.items())) if env else "",
    ]
    return "\n\n".join(block for block in blocks if block) + "\n"


def _table(results: list[ModelResult], entries: dict[str, GateEntry]) -> str:
    """One row per model, including baseline entries that were not observed."""
    rows = {r.name: _cells(r, entries.get(r.name)) for r in results}
    for name, entry in entries.items():
        rows.setdefault(name, [name, entry.outcome] + [""] * (len(_COLUMNS) - 2))
    return markdown_table(_COLUMNS, [rows[name] for name in sorted(rows)])


def _changes(gate: Gate) -> str:
    """The models whose verdict, failing stage or dims differ from the baseline."""
    versions = gate.versions_text()
    rows = [[c.name, c.before, c.now, versions] for c in gate.changes]
    return "## Changed since baseline\n\n" + markdown_table(_CHANGE_COLUMNS, rows)


def _outcome(result: ModelResult, entry: GateEntry | None) -> str:
    """The gate's outcome when there is a gate, else the model's own verdict."""
    return entry.outcome if entry is not None else result.verdict


def _cells(result: ModelResult, entry: GateEntry | None) -> list[str]:
    return [
        result.name,
        _outcome(result, entry),
        result.stage,
        f"`{result.dims_text()}`",
        str(result.n_observations),
        f"{result.max_abs:.1e}" if result.max_abs is not None else "",
        ", ".join(result.runtimes),
        f"{result.elapsed:.1f} s",
    ]


def markdown_table(columns: Iterable[str], rows: Iterable[Iterable[str]]) -> str:
    """A Markdown table; pipes in cells are escaped (even inside code spans), newlines flattened."""
    columns = list(columns)
    return "\n".join(_row(cells) for cells in [columns, ["---"] * len(columns), *rows])


def _row(cells: Iterable[str]) -> str:
    return "| " + " | ".join(cell.replace("|", "\\|").replace("\n", " ") for cell in cells) + " |"


def _localization_table(localization: dict[str, Any]) -> str:
    """The nodes introducing the largest errors of a mismatch, each on torch's own inputs."""
    nodes = localization.get("largest") or []
    if not nodes:
        return ""
    rows = [(("**beyond**" if n["beyond"] else "within"), " ".join(n["onnx_ops"]), f"`{n['onnx_node']}`",
             f"`{n['torch_op']}`", f"`{n['line']}`" if n["line"] else "", _magnitude(n["introduced"]),
             _magnitude(n["accumulated"])) for n in nodes]
    columns = ("tolerance", "ONNX ops", "node", "torch op", "source line", "max Δ introduced", "max Δ accumulated")
    return ("Largest errors a node introduces on torch's own inputs (`python repro.py --localize` prints them "
            "again):\n\n" + markdown_table(columns, rows))


def _magnitude(value: float | None) -> str:
    return "inf" if value is None else f"{value:.3g}"  # JSON holds an infinite difference as null


def _section(result: ModelResult, entry: GateEntry | None) -> str:
    """What went wrong with a failing model: gate message, stage, repro script, reason ("" if none)."""
    outcome = _outcome(result, entry)
    if outcome != Verdict.FAILED and result.verdict not in (Verdict.FAILED, Verdict.INCOMPLETE):
        return ""
    facts = []
    if result.stage:
        facts.append(f"- stage: `{result.stage}`" + (f" ({result.kind})" if result.kind else ""))
    if result.repro_path:
        facts.append(f"- repro: `{result.repro_path}`")
    blocks = [
        f"## {result.name}: {outcome}",
        entry.message if entry is not None else "",
        "\n".join(facts),
        f"```text\n{result.reason}\n```" if result.reason else "",
        _localization_table(result.localization),
    ]
    return "\n\n".join(block for block in blocks if block)
