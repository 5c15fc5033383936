"""The concluding side of a session: results in, baseline gate, one outcome per model, reports,
terminal summary.  Runs in the only process, or on the xdist controller."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from ..core.versions import package_versions
from ..engine.result import INCOMPLETE, ModelResult
from ..gate.baseline import Baseline, BaselineError
from ..gate.judge import Gate, gate
from .options import Options
from .outcomes import log_outcomes, summary_rows


class Concluding:
    """Collects results, judges them once and reports them (hooks of the concluding process)."""

    def __init__(self, config: pytest.Config, options: Options):
        self.config = config
        self.options = options
        self.results: dict[str, ModelResult] = {}
        self.gate: Gate | None = None
        self.problems: list[str] = []  # files that could not be written
        self.baseline = self._load_baseline()

    def conclude(self, session: pytest.Session, observed: set[str]) -> None:
        """Mark models observed but never checked as incomplete, judge, report, set the exit status."""
        for name in sorted(observed - set(self.results)):
            self.results[name] = incomplete(name, "the process that observed it ended without a result "
                                                  "(crashed worker?)")
        results = [self.results[n] for n in sorted(self.results)]
        options = self.options
        if options.baseline_update and options.baseline is not None:
            # The new baseline is what this session is judged by: failures become known ones.
            self.baseline = Baseline.from_results(results)
            self._write(f"baseline {options.baseline}", lambda: self.baseline.write(options.baseline))
        self.gate = gate(self.baseline, results, options.strict)
        if options.report is not None:
            from ..gate.reports import write_reports

            self._write(f"report {options.report}",
                        lambda: write_reports(options.report, results, self.gate, package_versions()))
        log_outcomes(self.config, self.results, self.gate)
        if (self.gate.failed or self.problems) and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.gate is None:
            return
        if not self.gate.entries:
            terminalreporter.write_line("exportobs: no model was observed (mark tests with @pytest.mark.observe_export)")
            return
        terminalreporter.write_sep("=", "exportobs")
        for row in summary_rows(self.results, self.gate):
            terminalreporter.write_line(row)
        terminalreporter.write_line(self.gate.summary_line(), red=self.gate.failed, green=not self.gate.failed)
        for problem in self.problems:
            terminalreporter.write_line(problem, red=True)

    def _write(self, what: str, write: Callable[[], Any]) -> None:
        try:
            write()
        except OSError as e:
            self.problems.append(f"exportobs: could not write the {what}: {e}")

    def _load_baseline(self) -> Baseline | None:
        path = self.options.baseline
        if path is None:
            if self.options.baseline_update:
                raise pytest.UsageError("--export-baseline-update needs --export-baseline PATH (or ini export_baseline)")
            return None
        if self.options.baseline_update:
            return None  # replaced at the end; an unreadable old file is no reason to stop
        if not path.exists():
            raise pytest.UsageError(f"export baseline {path} does not exist: create it with --export-baseline-update")
        try:
            return Baseline.load(path)
        except BaselineError as e:
            raise pytest.UsageError(str(e)) from None


def incomplete(name: str, reason: str) -> ModelResult:
    """The result of a model whose check never reported (the process observing it died, ...)."""
    return ModelResult(name=name, verdict=INCOMPLETE, stage="observe", kind="incomplete", reason=reason)


def progress_writer(config: pytest.Config) -> Callable[[str], None] | None:
    """A function writing one progress line to the terminal (``None`` without a terminal)."""
    terminal = config.pluginmanager.get_plugin("terminalreporter")
    if terminal is None:
        return None
    terminal.ensure_newline()
    return terminal.write_line
