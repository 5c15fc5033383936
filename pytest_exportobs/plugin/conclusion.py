"""The concluding side of a session: results in, baseline gate, one outcome per model, reports,
terminal summary.  Runs in the only process, or on the xdist controller.

Three kinds of results are no verdict on a model and never enter the baseline: ``environment``
failures (the machine's problem: a pytest ERROR and a red session-problem line), ``incomplete``
checks and ``interrupted`` ones (the gate judges both as failures; after Ctrl-C the baseline is
not written at all and the session exits with pytest's interrupted code).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from ..core.paths import require_writable_directory
from ..core.versions import package_versions
from ..core.vocabulary import Kind, Stage, Verdict
from ..engine.base.result import ModelResult
from ..gate.baseline import Baseline, BaselineError, BaselineUpdate, update_baseline
from ..gate.judge import Gate, gate
from ..gate.render import summary_line
from .options import Options
from .outcomes import log_outcomes, summary_rows


class Concluding:
    """Collects results, judges them once and reports them (hooks of the concluding process)."""

    def __init__(self, config: pytest.Config, options: Options):
        self.config = config
        self.options = options
        self.results: dict[str, ModelResult] = {}
        self.gate: Gate | None = None
        self.problems: list[str] = []  # red lines: files not written, environment failures, Ctrl-C
        self.notes: list[str] = []  # what the session did besides judging (the baseline update)
        self.baseline = self._load_baseline()
        _require_export_dir(options)

    def conclude(self, session: pytest.Session, observed: set[str], collected: set[str]) -> None:
        """Mark models observed but never checked as incomplete, judge (a baseline model is
        missing only when one of its tests was ``collected``), report, set the exit status."""
        for name in sorted(observed - set(self.results)):
            self.results[name] = incomplete(name, "the process that observed it ended without a result "
                                                  "(crashed worker?)")
        targets = self.options.check.targets  # from here on, one result per model and target
        self.results = {r.name: r for n in sorted(self.results) for r in self.results[n].per_target(targets)}
        results = list(self.results.values())
        interrupted = session.exitstatus == pytest.ExitCode.INTERRUPTED
        self.gate = self._judge(results, collected, record=self.options.baseline_update and not interrupted)
        self.problems += [f"exportobs: session problem, no verdict on {r.name} (at {r.stage}): {r.reason}"
                          for r in results if r.kind == Kind.ENVIRONMENT]
        if interrupted:
            self.problems.append(_interrupted_line(results, self.options))
        report = self.options.report
        if report is not None:
            from ..gate.reports import write_reports

            self._write(f"report {report}", lambda: write_reports(report, results, self.gate, package_versions()))
        log_outcomes(self.config, self.results, self.gate)
        if (self.gate.failed or self.problems) and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def _judge(self, results: list[ModelResult], collected: set[str], record: bool) -> Gate:
        """The gate over the verdicts (environment failures are none); with ``record``, the
        verdicts are written into the baseline first and the session is judged by them."""
        environment = {r.name for r in results if r.kind == Kind.ENVIRONMENT}
        judged = [r for r in results if r.name not in environment]
        baseline = self.baseline.without(environment) if self.baseline else None
        if record:
            recorded = [r for r in judged if r.verdict not in (Verdict.INCOMPLETE, Verdict.INTERRUPTED)]
            baseline = Baseline.from_results(recorded)  # failures become known ones
            self._write(f"baseline {self.options.baseline}", lambda: self._update_baseline(recorded))
        return gate(baseline, judged, self.options.strict, collected)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.gate is None:
            return
        if not self.gate.entries and not self.results:
            terminalreporter.write_line(
                "exportobs: no model was observed (mark tests with @pytest.mark.observe_export)")
            return
        terminalreporter.write_sep("=", "exportobs")
        for row in summary_rows(self.results, self.gate):
            terminalreporter.write_line(row)
        terminalreporter.write_line(summary_line(self.gate), red=self.gate.failed, green=not self.gate.failed)
        for note in self.notes:
            terminalreporter.write_line(note)
        for problem in self.problems:
            terminalreporter.write_line(problem, red=True)

    def _update_baseline(self, recorded: list[ModelResult]) -> None:
        path = self.options.baseline
        assert path is not None  # _load_baseline rejects --export-baseline-update without a baseline
        update = update_baseline(path, recorded, self.results.keys(), self.options.baseline_prune)
        self.notes.append(_update_line(path, update))

    def _write(self, what: str, write: Callable[[], Any]) -> None:
        try:
            write()
        except OSError as e:
            self.problems.append(f"exportobs: could not write the {what}: {e}")

    def _load_baseline(self) -> Baseline | None:
        path = self.options.baseline
        if path is None:
            if self.options.baseline_update:
                raise pytest.UsageError(
                    "--export-baseline-update needs --export-baseline PATH (or ini export_baseline)")
            return None
        if self.options.baseline_update:
            return None  # merged into at the end
        if not path.exists():
            raise pytest.UsageError(f"export baseline {path} does not exist: create it with --export-baseline-update")
        try:
            return Baseline.load(path)
        except BaselineError as e:
            raise pytest.UsageError(str(e)) from None


def _require_export_dir(options: Options) -> None:
    """A usage error, before any test runs, when ``--export-dir`` cannot hold the check's files."""
    path = options.check.export_dir
    try:
        require_writable_directory(path)
    except OSError as e:
        raise pytest.UsageError(f"--export-dir {path} cannot be used: {e.strerror or e}") from None


def _interrupted_line(results: list[ModelResult], options: Options) -> str:
    unchecked = [r.name for r in results if r.verdict == Verdict.INTERRUPTED]
    line = f"exportobs: interrupted: {len(results) - len(unchecked)} of {len(results)} models checked"
    if unchecked:
        line += f"; not checked: {', '.join(unchecked)}"
    return line + ("; the baseline was not updated" if options.baseline_update else "")


def _update_line(path: Any, update: BaselineUpdate) -> str:
    line = f"exportobs: baseline {path} updated: {len(update.written)} written"
    if update.kept:
        line += (f", {len(update.kept)} kept (not checked in this session: {', '.join(update.kept)}; "
                 "--export-baseline-prune removes them)")
    if update.pruned:
        line += f", {len(update.pruned)} pruned ({', '.join(update.pruned)})"
    if update.unreadable:
        line += f"; the old file was unreadable and is replaced ({update.unreadable})"
    return line


def incomplete(name: str, reason: str) -> ModelResult:
    """The result of a model whose check never reported (the process observing it died, ...)."""
    return ModelResult(name=name, verdict=Verdict.INCOMPLETE, stage=Stage.OBSERVE, kind=Kind.INCOMPLETE, reason=reason)


def progress_writer(config: pytest.Config) -> Callable[[str], None] | None:
    """A function writing one progress line to the terminal (``None`` without a terminal).
    Each line is flushed: a CI log reads the terminal through a pipe, which buffers."""
    terminal = config.pluginmanager.get_plugin("terminalreporter")
    if terminal is None:
        return None
    terminal.ensure_newline()

    def write(line: str) -> None:
        terminal.write_line(line)
        terminal.flush()

    return write
