"""The gate's text, written in one place: the terminal's gate line, the JSON and Markdown reports
(the Markdown suits a CI step summary), and the pieces the compare and merge commands print.
The judge (:mod:`.judge`) decides; this module only renders what it decided."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable
from typing import Any

from ..core.vocabulary import GateOutcome, Verdict
from ..engine.base.result import ModelResult
from .judge import UPDATE_HINT, Gate, GateEntry, Versions

REPORT_SCHEMA_VERSION = 1
# Outcomes counted in an ok summary line besides passed; {s} is the plural mark.
_COUNTED = {GateOutcome.XFAILED: "known failure{s}", GateOutcome.XPASSED: "fixed", GateOutcome.SKIPPED: "skipped",
            GateOutcome.MISSING: "missing"}
_COLUMNS = ("model", "outcome", "stage", "dynamic dims", "obs", "max abs Δ", "verified by", "time")
_CHANGE_COLUMNS = ("model", "before", "now", "versions changed")


# -- the gate: its line, its versions, its JSON ----------------------------------------------


def summary_line(gate: Gate) -> str:
    """``exportobs gate: ok (3 passed, 1 known failure, 0 regressions)`` or what failed."""
    if gate.failed:
        failures = [e for e in gate.entries if e.outcome == GateOutcome.FAILED and not e.regression]
        parts = [listed(gate.regressions, "regression{s}"), listed(failures, "failure{s}")]
        line = ", ".join(part for part in parts if part)
    else:
        line = f"ok ({_counts(gate)})"
    fixed = [e.name for e in gate.entries if e.outcome == GateOutcome.XPASSED]
    if fixed:
        line += f"; fixed: {', '.join(fixed)} — {UPDATE_HINT} {'it' if len(fixed) == 1 else 'them'}"
    if gate.uncollected:
        line += f"; {_count(len(gate.uncollected), 'baseline model{s}')} not collected here"
    return f"exportobs gate: {line}"


def _counts(gate: Gate) -> str:
    count = Counter(e.outcome for e in gate.entries)
    parts = [f"{count[GateOutcome.PASSED]} passed"]
    parts += [_count(count[outcome], label) for outcome, label in _COUNTED.items() if count[outcome]]
    parts.append("0 regressions" if gate.has_baseline else "no baseline")
    return ", ".join(parts)


def _count(n: int, label: str) -> str:
    """``_count(2, "regression{s}") == "2 regressions"``."""
    return f"{n} {label.format(s='' if n == 1 else 's')}"


def listed(entries: list[GateEntry], label: str) -> str:
    """``2 regressions (lm: …; vit: …)``, or "" without entries."""
    if not entries:
        return ""
    return f"{_count(len(entries), label)} ({'; '.join(f'{e.name}: {e.message}' for e in entries)})"


def versions_text(versions: Versions) -> str:
    """``torch 2.13.0 → 2.15.0, transformers 4.57.6 → 5.23.0``, or ``none``."""
    return ", ".join(f"{p} {old} → {new}" for p, (old, new) in versions.items()) or "none"


def gate_json(gate: Gate) -> dict[str, Any]:
    return {
        "failed": gate.failed, "summary": summary_line(gate),
        "entries": [dataclasses.asdict(e) for e in gate.entries],
        "versions": {package: list(pair) for package, pair in gate.versions.items()},
        "changes": [dataclasses.asdict(c) for c in gate.changes],
        "uncollected": list(gate.uncollected),
    }


# -- the report: JSON and Markdown -----------------------------------------------------------


def report_json(results: list[ModelResult], gate: Gate | None, env: dict[str, str]) -> dict[str, Any]:
    return {
        "schema_version": REPORT_SCHEMA_VERSION,
        "env": env,
        "gate": gate_json(gate) if gate is not None else None,
        "models": [r.to_json() for r in results],
    }


def report_markdown(results: list[ModelResult], gate: Gate | None, env: dict[str, str]) -> str:
    entries = {e.name: e for e in gate.entries} if gate is not None else {}
    notes = [f"- {e.name}: {note}" for e in entries.values() for note in e.notes]
    blocks = [
        "# exportobs report",
        summary_line(gate) if gate is not None else "",
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
    versions = versions_text(gate.versions)
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
