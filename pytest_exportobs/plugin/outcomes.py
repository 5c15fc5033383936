"""Report models to pytest: one ``exportobs::<name>`` test outcome each, and a terminal summary.

A model judged by the gate gets the gate's outcome; a model whose check failed for the machine's
sake (kind ``environment``) gets a pytest ERROR (a failed setup), like a test whose fixture could
not be set up.
"""

from __future__ import annotations

from typing import Any, Literal

import pytest

from ..core.text import format_dims
from ..core.vocabulary import GateOutcome, Kind
from ..engine.base.result import ModelResult
from ..gate.judge import Gate, GateEntry

PREFIX = "exportobs::"
When = Literal["setup", "call", "teardown"]
Outcome = Literal["passed", "failed", "skipped"]
WHENS: tuple[When, ...] = ("setup", "call", "teardown")
# gate outcome -> (pytest outcome, is an expected failure)
OUTCOMES: dict[GateOutcome, tuple[Outcome, bool]] = {
    GateOutcome.PASSED: ("passed", False),
    GateOutcome.FAILED: ("failed", False),
    GateOutcome.XFAILED: ("skipped", True),
    GateOutcome.XPASSED: ("passed", True),
    GateOutcome.SKIPPED: ("skipped", False),
    GateOutcome.MISSING: ("skipped", False),
}


def log_outcomes(config: pytest.Config, results: dict[str, ModelResult], gate: Gate) -> None:
    """Send setup/call/teardown reports of every model through pytest's hooks (terminal,
    junitxml, ``-rA`` and the exit status see them like any test)."""
    verbose = config.get_verbosity() > 0
    for entry in gate.entries:
        result = results.get(entry.name)
        _log(config, entry.name, [_report(entry, result, when, verbose) for when in WHENS])
    for result in results.values():
        if result.kind == Kind.ENVIRONMENT:
            problem = (f"session problem at {result.stage}: {result.reason}\n"
                       "no verdict on the model, and its baseline entry is kept as it was")
            _log(config, result.name, [_test_report(result.name, "setup", "failed", problem),
                                       _test_report(result.name, "teardown", "passed")])


def _log(config: pytest.Config, name: str, reports: list[pytest.TestReport]) -> None:
    nodeid = f"{PREFIX}{name}"
    config.hook.pytest_runtest_logstart(nodeid=nodeid, location=_location(nodeid))
    for report in reports:
        config.hook.pytest_runtest_logreport(report=report)
    config.hook.pytest_runtest_logfinish(nodeid=nodeid, location=_location(nodeid))


def _location(nodeid: str) -> tuple[str, None, str]:
    return ("exportobs", None, nodeid)


def _test_report(name: str, when: When, outcome: Outcome, longrepr: Any = None, **fields: Any) -> pytest.TestReport:
    nodeid = f"{PREFIX}{name}"
    return pytest.TestReport(nodeid=nodeid, location=_location(nodeid), keywords={"exportobs": 1},
                             outcome=outcome, longrepr=longrepr, when=when, **fields)


def _report(entry: GateEntry, result: ModelResult | None, when: When, verbose: bool) -> pytest.TestReport:
    outcome, expected = OUTCOMES[entry.outcome] if when == "call" else ("passed", False)
    longrepr: Any = None
    if when == "call" and outcome == "failed":
        longrepr = failure_text(entry, result, verbose)
    elif when == "call" and outcome == "skipped" and not expected:
        longrepr = ("exportobs", None, f"Skipped: {entry.name}: {entry.message or (result.reason if result else '')}")
    report = _test_report(
        entry.name, when, outcome, longrepr, duration=result.elapsed if (result and when == "call") else 0.0,
        user_properties=_properties(result) if result else [],  # junitxml writes the teardown's
    )
    if when == "call" and expected:
        report.wasxfail = entry.message or "known export failure"
    if when == "call" and result is not None:
        report.sections.append(("exportobs", detail_text(result)))
    return report


def _properties(result: ModelResult) -> list[tuple[str, str]]:
    """junitxml properties: the target, the stage reached, and each graph of a model exported as several."""
    return [("exportobs_target", result.target), ("exportobs_stage", result.stage),
            *(("exportobs_graph", text) for text in graph_lines(result))]


def graph_lines(result: ModelResult) -> list[str]:
    """``[with labels] passed, calls 0 2, input_ids{0:batch,1:seq}`` per graph, when there are
    several (a single graph is the model's own line)."""
    if len(result.graphs) < 2:
        return []
    return [f"[{g.name}] {g.verdict}{f' at {g.stage}' if not g.passed else ''}, "
            f"calls {' '.join(map(str, g.calls)) or '-'}, {format_dims(g.dims)}" for g in result.graphs]


def failure_text(entry: GateEntry, result: ModelResult | None, verbose: bool) -> str:
    """What a failing model shows under FAILURES: the gate message and reason on the first line
    (the short summary shows it), then where to look; the traceback with ``-v``."""
    if result is None or not result.reason:
        return f"{entry.name}: {entry.message}"
    lines = [f"{entry.message}: {result.reason}", f"stage={result.stage} kind={result.kind or ''}"]
    if result.repro_path:
        lines.append(f"repro: {result.repro_path}")
    lines.extend(f"note: {n}" for n in result.notes)
    if result.traceback and verbose:
        lines.extend(["", result.traceback.rstrip()])
    elif result.traceback:
        lines.append("(run with -v for the traceback)")
    return "\n".join(lines)


def detail_text(result: ModelResult) -> str:
    """Dims, relations, observations and numbers of one model (shown with ``-rA``)."""
    lines = [
        f"class: {result.model_class}",
        f"dynamic dims: {result.dims_text()}",
        f"relations: {', '.join(result.relations) or 'none'}",
        f"observations: {result.n_observations} distinct of {result.n_calls} calls; "
        f"reference: {result.reference or '-'}",
        f"max |Δ|: {_number(result.max_abs)}  max rel: {_number(result.max_rel)}",
        "timings: " + ", ".join(f"{k} {v:.2f}s" for k, v in result.timings.items()),
    ]
    if result.variations:
        v = result.variations
        lines.append(f"variations: {v['tried']} tried, {v['valid']} valid, {v['failed']} failed")
    lines.extend(f"graph {text}" for text in graph_lines(result))
    lines.extend(f"note: {n}" for n in result.notes)
    for kind, path in (("onnx", result.onnx_path), ("pte", result.pte_path)):
        if path:
            lines.append(f"{kind}: {path}" + (" (cache hit)" if result.cache_hit else ""))
    return "\n".join(lines)


def summary_rows(results: dict[str, ModelResult], gate: Gate) -> list[str]:
    """The terminal summary table: model, verdict, stage, dims, observations, max |Δ|, time."""
    header = ("model", "verdict", "stage", "obs", "max|Δ|", "time", "dynamic dims")
    rows = [header]
    for entry in gate.entries:
        result = results.get(entry.name)
        if result is None:
            rows.append((entry.name, entry.outcome, "-", "-", "-", "-", entry.message))
            continue
        rows.append((
            entry.name, entry.outcome, result.stage or "-", str(result.n_observations),
            _number(result.max_abs), f"{result.elapsed:.1f}s", result.dims_text(),
        ))
        if len(result.graphs) > 1:  # one row per graph, under the model's
            rows += [(f"  [{g.name}]", g.verdict, g.stage or "-", str(len(g.calls)), _number(g.max_abs),
                      f"{sum(g.timings.values()):.1f}s", format_dims(g.dims)) for g in result.graphs]
    rows += [
        (r.name, "error", r.stage or "-", str(r.n_observations), "-", f"{r.elapsed:.1f}s", "session problem")
        for r in results.values() if r.kind == Kind.ENVIRONMENT
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    return ["  ".join([*(c.ljust(w) for c, w in zip(r, widths)), r[-1]]).rstrip() for r in rows]


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.2g}"
