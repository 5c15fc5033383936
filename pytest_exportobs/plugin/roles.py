"""The plugin's role in this process, chosen once at configure (as pytest-cov does):

* :class:`LocalRole`: no xdist workers; observes the tests, checks the models, concludes;
* :class:`WorkerRole`: an xdist worker; observes, pools its observations with the other
  workers, checks the models it claims, sends JSON results;
* :class:`ControllerRole`: the xdist controller; runs no test, merges the workers' results, concludes.

Each role is a plugin object registered at configure and unregistered at unconfigure; its hooks
only delegate to the observing and concluding sides and to the engine.

Ctrl-C while models are checked stops the checks at once: the models not checked are
``interrupted`` and the session's exit status becomes pytest's interrupted code.  After Ctrl-C
during the tests no model is checked at all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest

from ..core.vocabulary import Verdict
from ..engine.result import ModelResult
from . import xdist
from .conclusion import Concluding, incomplete, progress_writer
from .observing import ANNOUNCED_PROPERTY, OBSERVED_PROPERTY, Observing
from .options import Options
from .pooling import Pool, claimed, mark_down


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
    if any(r.verdict == Verdict.INTERRUPTED for r in results):
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
    """An xdist worker: pools its observations with the other workers (:mod:`.pooling`), checks
    the models it claims and sends the results to the controller.

    A usage error of ``--export-observe`` (found here: the controller never imports torch) is
    sent to the controller, which reports it; the worker runs no test meanwhile."""

    def __init__(self, config: pytest.Config, options: Options):
        super().__init__(options)
        self.config = config
        self.pool = Pool.of(config)
        self.usage_error: str | None = None

    def pytest_sessionstart(self) -> None:
        if self.pool is not None:
            self.pool.join()
        try:
            self.resolve_observed_classes()
        except ValueError as e:  # raised on a worker, a UsageError would be a traceback, not a usage error
            self.usage_error = str(e)

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        if self.usage_error is not None:
            items.clear()

    @pytest.hookimpl(tryfirst=True)  # before xdist's sends the collection to the controller
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        xdist.write_placement(self.config, session.items)

    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        xdist.announce(item)

    def pytest_runtest_teardown(self) -> None:
        if self.pool is not None and self._store is not None:
            self.pool.save(self._store)  # what a crash of this worker would otherwise lose

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.stop_observing()
        notes = self.auto_notes()
        groups: Iterable[Any] = self.groups()
        if self.pool is not None:
            self.pool.offer(self._store)
            notes += self.pool.wait()
            order = {item.nodeid: index for index, item in enumerate(session.items)}
            groups = self.pool.claims(self._store, lambda nodeid: order.get(nodeid, len(order)))
        results = [result for batch in _batches(groups, self.options.jobs)
                   for result in _check(session, batch, self.options, progress=None)]
        renamed = {self.config.workerinput["workerid"]: self.renamed()}  # type: ignore[attr-defined]  # set by xdist
        if self.pool is not None:
            notes += self.pool.notes
            renamed.update(self.pool.renames())
        self.config.workeroutput[xdist.OUTPUT_KEY] = {  # type: ignore[attr-defined]  # set by xdist on workers
            "results": [r.to_json() for r in results], "notes": notes, "usage_error": self.usage_error,
            "renamed": renamed,
        }


def _batches(groups: Iterable[Any], size: int) -> Iterator[list[Any]]:
    """``groups`` in lists of ``size`` (``--export-jobs`` checks at once), taken as they come."""
    batch: list[Any] = []
    for group in groups:
        batch.append(group)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


class ControllerRole(Concluding):
    """The xdist controller: knows the observed models from the test reports, the results from
    the workers' output.  A worker saves its calls after each test: a model is incomplete when a
    worker crashed before saving any call of it, or while checking it."""

    def __init__(self, config: pytest.Config, options: Options):
        super().__init__(config, options)
        self.reported: set[tuple[str, str]] = set()  # (worker, group name) from OBSERVED properties
        self.announced: set[tuple[str, str]] = set()  # ... from OBSERVED and ANNOUNCED properties
        self.renamed: dict[str, dict[str, str]] = {}  # worker -> its names tests recorded -> final names
        self.crashed: set[str] = set()  # workers that went down with an error
        self.checked_on: dict[str, str] = {}  # group name -> worker that sent its result
        self.collected: set[str] = set()  # the node ids the workers collected
        self.shared = xdist.shared_directory(config)
        self.usage_error: str | None = None  # a worker's: --export-observe names no class it can import

    @pytest.hookimpl(optionalhook=True, tryfirst=True)
    def pytest_xdist_make_scheduler(self, config: pytest.Config, log: Any) -> Any:
        return xdist.make_scheduler(config, log, self.shared) if xdist.schedules(config) else None

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node: Any) -> None:
        xdist.configure_node(self.config, node, self.shared)

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: Any, ids: list[str]) -> None:
        self.collected.update(ids)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        worker = xdist.worker_of(report) or ""
        for key, name in report.user_properties:
            if key == OBSERVED_PROPERTY:
                self.reported.add((worker, str(name)))  # a group name: user_properties' values are objects
            if key in (OBSERVED_PROPERTY, ANNOUNCED_PROPERTY):
                self.announced.add((worker, str(name)))

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        worker = node.gateway.id
        mark_down(xdist.pool_directory(self.shared), worker)
        if error is not None:
            self.crashed.add(worker)
        output = getattr(node, "workeroutput", {}).get(xdist.OUTPUT_KEY)
        self._merge(output or {}, worker)

    def _merge(self, output: dict[str, Any], worker: str) -> None:
        """Merge a worker's results; a model checked on two workers is incomplete, not guessed."""
        self.usage_error = self.usage_error or output.get("usage_error")
        for observer, renamed in output.get("renamed", {}).items():  # its own, and those of crashed workers
            self.renamed.setdefault(observer, {}).update(renamed)
        self.notes += [note for note in output.get("notes", []) if note not in self.notes]
        for data in output.get("results", []):
            result = ModelResult.from_json(data)
            first = self.checked_on.setdefault(result.name, worker)
            if first != worker:
                result = incomplete(result.name, f"checked on workers {first} and {worker}: the pooled "
                                    "observations of one model are checked once (workers on other "
                                    "hosts share no directory)")
            self.results[result.name] = result

    def _final(self, worker: str, name: str) -> str:
        """The name of the group a test on ``worker`` recorded as ``name`` (a split or the pool renames)."""
        return self.renamed.get(worker, {}).get(name, name)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.usage_error is not None:
            raise pytest.UsageError(self.usage_error)  # pytest prints it and exits with code 4
        for name, worker in claimed(xdist.pool_directory(self.shared)).items():
            if worker in self.crashed and name not in self.results:
                self.results[name] = incomplete(name, f"worker {worker} crashed while checking it (a native "
                                                      "crash: --export-isolate makes it the model's failure)")
        lost: dict[str, set[str]] = {}
        for worker, name in self.announced:
            if worker in self.crashed and self._final(worker, name) not in self.results:
                lost.setdefault(self._final(worker, name), set()).add(worker)
        for name, workers in sorted(lost.items()):
            self.results[name] = incomplete(name, f"observed on worker {', '.join(sorted(workers))}, which "
                                                  "crashed before saving any call of it")
        observed = {self._final(worker, name) for worker, name in self.reported}
        self.conclude(session, observed, self.collected)


def choose_role(config: pytest.Config, options: Options) -> LocalRole | WorkerRole | ControllerRole:
    """The role of this process in the session."""
    if xdist.is_worker(config):
        return WorkerRole(config, options)
    if xdist.is_controller(config):
        return ControllerRole(config, options)
    return LocalRole(config, options)
