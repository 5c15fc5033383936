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
    "atol=None, rtol=None, examples=None, method='forward', xfail=None): record the calls of the named "
    "fixtures' modules during this test; with --export-check they are exported and verified at the end"
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
    if is_worker(config):
        config.option.loadgroup = bool(config.workerinput.get("exportobs_pin"))
    elif getattr(config.option, "dist", "no") == "load":
        config.option.dist = "loadgroup"  # keep the observations of each model on one worker


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


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    if _session(node.config) is not None:
        node.workerinput["exportobs_pin"] = node.config.option.dist == "loadgroup"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _session(config) is None or not getattr(config.option, "loadgroup", False):
        return
    from .session import MARKER, XDIST_GROUP

    for item in items:
        if item.get_closest_marker(MARKER) or "export_observer" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group(XDIST_GROUP))


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


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    session = _session(node.config)
    if session is not None:
        output = getattr(node, "workeroutput", {}).get("exportobs")
        session.merge_worker_output(output, node.gateway.id)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    export = _session(session.config)
    if export is None:
        return
    from .session import is_worker

    if is_worker(session.config):
        export.check_local()
        session.config.workeroutput["exportobs"] = export.worker_output()
        return
    export.check_local(_progress_writer(session.config))
    from .report import log_outcomes

    gate = export.conclude()
    log_outcomes(session.config, export.results, gate)
    if gate.failed and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _progress_writer(config: pytest.Config) -> Any:
    terminal = config.pluginmanager.get_plugin("terminalreporter")
    if terminal is None:
        return None
    terminal.ensure_newline()

    def write(line: str) -> None:
        terminal.write_line(line)

    return write


def pytest_terminal_summary(terminalreporter: Any) -> None:
    export = _session(terminalreporter.config)
    if export is None or export.gate is None:
        return
    from .report import summary_rows

    terminalreporter.write_sep("=", "exportobs")
    for row in summary_rows(export.results, export.gate):
        terminalreporter.write_line(row)
    terminalreporter.write_line(export.gate.summary_line(), red=export.gate.failed, green=not export.gate.failed)
