"""JSON and Markdown reports of a session's export checks (the Markdown suits a CI step summary)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..core.files import json_text, write_atomic
from ..engine.result import FAILED, INCOMPLETE, ModelResult
from .judge import Gate, GateEntry

REPORT_SCHEMA_VERSION = 1
_COLUMNS = ("model", "outcome", "stage", "dynamic dims", "obs", "max abs Δ", "time")


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
    lines = [_row(_COLUMNS), _row(["---"] * len(_COLUMNS))] + [_row(rows[name]) for name in sorted(rows)]
    return "\n".join(lines)


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
        f"{result.elapsed:.1f} s",
    ]


def _row(cells: Iterable[str]) -> str:
    """A table row; pipes are escaped (even inside code spans) and newlines flattened."""
    return "| " + " | ".join(cell.replace("|", "\\|").replace("\n", " ") for cell in cells) + " |"


def _section(result: ModelResult, entry: GateEntry | None) -> str:
    """What went wrong with a failing model: gate message, stage, repro script, reason ("" if none)."""
    outcome = _outcome(result, entry)
    if outcome != FAILED and result.verdict not in (FAILED, INCOMPLETE):
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
    ]
    return "\n\n".join(block for block in blocks if block)
