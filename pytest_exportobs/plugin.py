"""pytest hooks of pytest-exportobs: translate pytest events into calls of the session object.

Without ``--export-check`` (or ini ``export_check = true``) nothing here imports torch, wraps a
model or writes a file.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from .settings import Settings, add_options

MARKER_HELP = (
    "observe_export(*fixture_names, name=None, set_batch_dimension_for=None, value_if_missing=None, "
    "dim_names=None, atol=None, rtol=None, examples=None, method='forward', xfail=None, patches=(), "
    "store_n_calls=3): record the calls of the named fixtures' modules during this test; with "
    "--export-check they are exported and verified at the end"
)
session_key = pytest.StashKey["Any"]()


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER_HELP)
    settings = Settings.from_config(config)
    if not settings.enabled or config.option.collectonly:
        return
    from .session import ExportSession, is_worker

    export = config.stash[session_key] = ExportSession(config, settings)
    config.pluginmanager.register(ObservedModels(export), "exportobs-observed")
    if config.pluginmanager.hasplugin("xdist"):
        from ._xdist import XdistHooks, pin_observing_tests

        config.pluginmanager.register(XdistHooks(export), "exportobs-xdist")
        if not is_worker(config):
            pin_observing_tests(config)


class ObservedModels:
    """Remembers the models the tests observed, from their reports (workers' reports included),
    so that a model whose worker died without a result is reported incomplete, never passed."""

    def __init__(self, export: Any):
        self.export = export

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        from .session import OUTPUT_KEY

        self.export.observed.update(value for key, value in report.user_properties if key == OUTPUT_KEY)


def _session(config: pytest.Config) -> Any:
    return config.stash.get(session_key, None)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    session = _session(item.config)
    if session is None:
        return (yield)
    with session.observe_marked(item):
        return (yield)


class ExportObserver:
    """The ``export_observer`` fixture: ``watch(module, name=None, **marker_kwargs)`` observes a
    module until the end of the test and returns it (unchanged when the check is off)."""

    def __init__(self, request: pytest.FixtureRequest, stack: contextlib.ExitStack):
        self._request = request
        self._stack = stack

    def watch(self, module: Any, name: str | None = None, **kwargs: Any) -> Any:
        session = _session(self._request.config)
        if session is None:
            return module
        return session.watch(self._request, self._stack, module, name, kwargs)


@pytest.fixture
def export_observer(request: pytest.FixtureRequest) -> Iterator[ExportObserver]:
    with contextlib.ExitStack() as stack:
        yield ExportObserver(request, stack)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    export = _session(session.config)
    if export is None:
        return
    from .session import OUTPUT_KEY, is_worker

    if is_worker(session.config):
        export.check_local()
        session.config.workeroutput[OUTPUT_KEY] = export.worker_output()
        return
    export.check_local(_progress_writer(session.config))
    from .report import log_outcomes

    gate = export.conclude()
    log_outcomes(session.config, export.results, gate)
    if (gate.failed or export.problems) and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _progress_writer(config: pytest.Config) -> Any:
    terminal = config.pluginmanager.get_plugin("terminalreporter")
    if terminal is None:
        return None
    terminal.ensure_newline()
    return terminal.write_line


def pytest_terminal_summary(terminalreporter: Any) -> None:
    export = _session(terminalreporter.config)
    if export is None or export.gate is None:
        return
    if not export.gate.entries:
        terminalreporter.write_line("exportobs: no model was observed (mark tests with @pytest.mark.observe_export)")
        return
    from .report import summary_rows

    terminalreporter.write_sep("=", "exportobs")
    for row in summary_rows(export.results, export.gate):
        terminalreporter.write_line(row)
    terminalreporter.write_line(export.gate.summary_line(), red=export.gate.failed, green=not export.gate.failed)
    for problem in export.problems:
        terminalreporter.write_line(problem, red=True)
