"""The plugin's role in this process, chosen once at configure (as pytest-cov does):

* :class:`LocalRole`: no xdist workers; observes the tests, checks the models, concludes;
* :class:`WorkerRole`: an xdist worker; observes, checks its models, sends JSON results;
* :class:`ControllerRole`: the xdist controller; runs no test, merges the workers' results, concludes.

Each role is a plugin object registered at configure and unregistered at unconfigure; its hooks
only delegate to the observing and concluding sides and to the engine.

Ctrl-C while models are checked stops the checks at once: the models not checked are
``interrupted`` and the session's exit status becomes pytest's interrupted code.  After Ctrl-C
during the tests no model is checked at all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from ..engine.result import INTERRUPTED, ModelResult
from . import xdist
from .conclusion import Concluding, incomplete, progress_writer
from .observing import ANNOUNCED_PROPERTY, OBSERVED_PROPERTY, Observing, auto_observes
from .options import Options


def _check(
    session: pytest.Session, groups: list[Any], options: Options, progress: Callable[[str], None] | None
) -> list[ModelResult]:
    """Check the groups observed in this process (torch is imported only when there are some)."""
    if not groups:
        return []
    from ..engine.runner import check_all, interrupted

    if session.exitstatus == pytest.ExitCode.INTERRUPTED:
        return [interrupted(group) for group in groups]
    results = list(check_all(groups, options.check, options.isolate, progress, options.jobs, options.threads))
    if any(r.verdict == INTERRUPTED for r in results):
        session.exitstatus = pytest.ExitCode.INTERRUPTED
    return results


class LocalRole(Observing, Concluding):
    """The only process of the session."""

    def __init__(self, config: pytest.Config, options: Options):
        Observing.__init__(self, options)
        Concluding.__init__(self, config, options)

    @pytest.hookimpl(tryfirst=True)  # before junitxml writes its file in its own sessionfinish
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.stop_observing()
        for result in _check(session, self.groups(), self.options, progress_writer(self.config)):
            self.results[result.name] = result
        self.notes += self.auto_notes()
        self.conclude(session, observed=set(), collected={item.nodeid for item in session.items})


class WorkerRole(Observing):
    """An xdist worker: checks the models observed here and sends the results to the controller.

    A usage error of ``--export-observe`` (found here: the controller never imports torch) is
    sent to the controller, which reports it; the worker runs no test meanwhile."""

    def __init__(self, config: pytest.Config, options: Options):
        super().__init__(options)
        self.config = config
        self.usage_error: str | None = None

    def pytest_sessionstart(self) -> None:
        try:
            self.resolve_observed_classes()
        except ValueError as e:  # raised on a worker, a UsageError would be a traceback, not a usage error
            self.usage_error = str(e)

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        if self.usage_error is not None:
            items.clear()

    @pytest.hookimpl(tryfirst=True)  # before xdist's sends the collection to the controller
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        xdist.write_placement(self.config, session.items, lambda item: auto_observes(item, self.options))

    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        xdist.announce(item)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.stop_observing()
        results = _check(session, self.groups(), self.options, progress=None)
        self.config.workeroutput[xdist.OUTPUT_KEY] = {
            "results": [r.to_json() for r in results], "notes": self.auto_notes(), "usage_error": self.usage_error,
            "renamed": self.renamed(),
        }


class ControllerRole(Concluding):
    """The xdist controller: knows the observed models from the test reports, the results from
    the workers' output.  A model observed on a worker that crashed is incomplete, whatever
    another worker says of it: its observations died with the worker."""

    def __init__(self, config: pytest.Config, options: Options):
        super().__init__(config, options)
        self.observed: set[str] = set()  # group names seen in test reports
        self.observed_on: dict[str, set[str]] = {}  # group name -> workers that observed (or announced) it
        self.crashed: set[str] = set()  # workers that went down with an error
        self.checked_on: dict[str, str] = {}  # group name -> worker that sent its result
        self.collected: set[str] = set()  # the node ids the workers collected
        self.placement = xdist.placement_directory(config)
        self.usage_error: str | None = None  # a worker's: --export-observe names no class it can import

    @pytest.hookimpl(optionalhook=True, tryfirst=True)
    def pytest_xdist_make_scheduler(self, config: pytest.Config, log: Any) -> Any:
        return None if self.placement is None else xdist.make_scheduler(config, log, self.placement)

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node: Any) -> None:
        if self.placement is not None:
            xdist.configure_node(node, self.placement)

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: Any, ids: list[str]) -> None:
        self.collected.update(ids)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        worker = xdist.worker_of(report)
        for key, name in report.user_properties:
            if key == OBSERVED_PROPERTY:
                self.observed.add(name)
            if key in (OBSERVED_PROPERTY, ANNOUNCED_PROPERTY) and worker is not None:
                self.observed_on.setdefault(name, set()).add(worker)

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        if error is not None:
            self.crashed.add(node.gateway.id)
        output = getattr(node, "workeroutput", {}).get(xdist.OUTPUT_KEY)
        self._merge(output, node.gateway.id)

    def _merge(self, output: dict[str, Any] | None, worker: str) -> None:
        """Merge a worker's results; a model checked on two workers is incomplete, not guessed."""
        self.usage_error = self.usage_error or (output or {}).get("usage_error")
        for old, new in (output or {}).get("renamed", {}).items():  # a split after tests recorded the name
            if old in self.observed:
                self.observed.discard(old)
                self.observed.add(new)
            workers = self.observed_on.pop(old, None)
            if workers is not None:
                self.observed_on.setdefault(new, set()).update(workers)
        self.notes += [note for note in (output or {}).get("notes", []) if note not in self.notes]
        for data in (output or {}).get("results", []):
            result = ModelResult.from_json(data)
            first = self.checked_on.setdefault(result.name, worker)
            if first != worker:
                result = incomplete(result.name, f"observed on workers {first} and {worker}: "
                                    "the observations of one model must stay on one worker (under "
                                    "--dist load the tests whose markers name it do; a model also "
                                    "observed through watch() can be split)")
            self.results[result.name] = result

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.usage_error is not None:
            raise pytest.UsageError(self.usage_error)  # pytest prints it and exits with code 4
        for name, workers in sorted(self.observed_on.items()):
            lost = sorted(workers & self.crashed)
            if lost:
                self.results[name] = incomplete(name, f"observed on worker {', '.join(lost)}, which crashed: "
                                                      "its observations are lost")
        self.conclude(session, self.observed, self.collected)


def choose_role(config: pytest.Config, options: Options) -> LocalRole | WorkerRole | ControllerRole:
    """The role of this process in the session."""
    if xdist.is_worker(config):
        return WorkerRole(config, options)
    if xdist.is_controller(config):
        return ControllerRole(config, options)
    return LocalRole(config, options)
