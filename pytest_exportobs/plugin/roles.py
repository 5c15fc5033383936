"""The plugin's role in this process, chosen once at configure (as pytest-cov does):

* :class:`LocalRole`: no xdist workers; observes the tests, checks the models, concludes;
* :class:`WorkerRole`: an xdist worker; observes, pools its observations with the other
  workers, checks the models it claims, sends JSON results;
* :class:`ControllerRole`: the xdist controller; runs no test, writes the observations of
  workers on other hosts into the pool, checks what no worker claimed (theirs, when every
  worker is remote), merges the workers' results, concludes.

Each role is a plugin object registered at configure and unregistered at unconfigure; its hooks
only delegate to the observing and concluding sides and to the engine.

Ctrl-C while models are checked stops the checks at once: the models not checked are
``interrupted`` and the session's exit status becomes pytest's interrupted code.  After Ctrl-C
during the tests no model is checked at all.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest

from ..core.vocabulary import Verdict
from ..engine.base.result import ModelResult
from . import xdist
from .conclusion import Concluding, incomplete, progress_writer
from .observing import ANNOUNCED_PROPERTY, OBSERVED_PROPERTY, Observing
from .options import Options
from .pooling import Pool, claimed, mark_down, write_saves
from .relay import Relay, import_paths, taken_relays, write_offer


def _check(
    session: pytest.Session, groups: list[Any], options: Options, progress: Callable[[str], None] | None
) -> list[ModelResult]:
    """Check the groups observed in this process (torch is imported only when there are some)."""
    if not groups:
        return []
    from ..engine.children import interrupted
    from ..engine.runner import check_all

    if session.exitstatus == pytest.ExitCode.INTERRUPTED:
        return [interrupted(group) for group in groups]
    results = list(check_all(groups, options.check, options.isolate, progress, options.jobs, options.threads))
    if any(r.verdict == Verdict.INTERRUPTED for r in results):
        session.exitstatus = pytest.ExitCode.INTERRUPTED
    return results


class LocalRole(Observing, Concluding):
    """The only process of the session; with ``--export-overlap auto`` it checks the models whose
    calls have settled while the tests run, on the core they leave (:mod:`..engine.early`)."""

    def __init__(self, config: pytest.Config, options: Options):
        Observing.__init__(self, options)
        Concluding.__init__(self, config, options)
        self.early: Any = None  # the EarlyChecks, once a model is observed (torch is imported then)

    def pytest_runtest_logfinish(self) -> None:
        super().pytest_runtest_logfinish()
        if self._store is not None and self.options.overlap:
            if self.early is None:
                from ..engine.early import EarlyChecks

                self.early = EarlyChecks(self.options.check)
            self.early.after_test(self._store.groups.values())

    def pytest_unconfigure(self) -> None:
        if self.early is not None:  # a session ended before its finish (an internal error)
            self.early.stop()

    @pytest.hookimpl(tryfirst=True)  # before junitxml writes its file in its own sessionfinish
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.early is not None:
            self.early.stop()
            if self.early.checked:
                self.notes.append(f"exportobs: the checks of {self.early.checked} model(s) began while the tests "
                                  "ran (--export-overlap), for the export cache")
        self.stop_observing()
        for result in _check(session, self.groups(), self.options, progress_writer(self.config)):
            self.results[result.name] = result
        self.notes += self.auto_notes()
        self.conclude(session, observed=set(), collected={item.nodeid for item in session.items})


class WorkerRole(Observing):
    """An xdist worker: pools its observations with the other workers (:mod:`.pooling`), checks
    the models it claims and sends the results to the controller.  A worker that does not see
    the controller's directory (another host) sends its observations instead and checks none.

    A usage error of ``--export-observe`` (found here: the controller never imports torch) is
    sent to the controller, which reports it; the worker runs no test meanwhile."""

    def __init__(self, config: pytest.Config, options: Options):
        super().__init__(options)
        self.config = config
        self.pool = Pool.of(config)
        self.relay = None if self.pool is not None else Relay.of(config)
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
        if self.pool is not None:
            xdist.write_placement(self.config, session.items)

    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        xdist.announce(item)

    def pytest_runtest_teardown(self, item: pytest.Item) -> None:
        """Save what a crash of this worker would otherwise lose (remote: on the teardown report)."""
        if self._store is None:
            return
        if self.pool is not None:
            self.pool.save(self._store)
        elif self.relay is not None:
            self.relay.save(self._store, item.user_properties)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.stop_observing()
        output: dict[str, Any] = {"notes": self.auto_notes(), "usage_error": self.usage_error}
        groups: Iterable[Any] = self.groups()
        if self.pool is not None:
            self.pool.offer(self._store)
            output["notes"] += self.pool.wait()
            groups = self.pool.claims(self._store, _positions(item.nodeid for item in session.items))
        elif self.relay is not None:
            output["relay"] = self.relay.offer(self._store)
            groups = []  # checked where the pool is
        output["results"] = [result.to_json() for batch in _batches(groups, self.options.jobs)
                             for result in _check(session, batch, self.options, progress=None)]
        output["renamed"] = {self.config.workerinput["workerid"]: self.renamed()}  # type: ignore[attr-defined]  # set by xdist
        if self.pool is not None:
            output["renamed"].update(self.pool.renames())
        side = self.pool or self.relay
        if side is not None:
            output["notes"] += side.notes
        self.config.workeroutput[xdist.OUTPUT_KEY] = output  # type: ignore[attr-defined]  # set by xdist on workers


def _positions(nodeids: Iterable[str]) -> Callable[[str], int]:
    """The position of a test's node id in the collection (after all: an id not collected)."""
    order = {nodeid: index for index, nodeid in enumerate(nodeids)}
    return lambda nodeid: order.get(nodeid, len(order))


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
    the workers' output.  A worker saves its calls after each test (a remote one through the
    controller): a model is incomplete when a worker crashed before saving any call of it, or
    while checking it.  Torch is imported here only to check what remote workers left unclaimed."""

    def __init__(self, config: pytest.Config, options: Options):
        super().__init__(config, options)
        self.reported: set[tuple[str, str]] = set()  # (worker, group name) from OBSERVED properties
        self.announced: set[tuple[str, str]] = set()  # ... from OBSERVED and ANNOUNCED properties
        self.renamed: dict[str, dict[str, str]] = {}  # worker -> its names tests recorded -> final names
        self.crashed: set[str] = set()  # workers that went down with an error
        self.checked_on: dict[str, str] = {}  # group name -> worker that sent its result
        self.collected: list[str] = []  # the node ids the workers collected, in order
        self.remote: set[str] = set()  # workers that sent their observations (they do not see the pool)
        self.roots: list[str] = []  # where remote workers import the test modules from, in the rootdir
        self.shared = xdist.SharedDirectory(config)
        self.usage_error: str | None = None  # a worker's: --export-observe names no class it can import

    @pytest.hookimpl(optionalhook=True, tryfirst=True)
    def pytest_xdist_make_scheduler(self, config: pytest.Config, log: Any) -> Any:
        return xdist.make_scheduler(config, log, self.shared.path) if xdist.schedules(config) else None

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node: Any) -> None:
        xdist.configure_node(self.config, node, self.shared)

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: Any, ids: list[str]) -> None:
        self.collected = self.collected or list(ids)  # every worker collects the same

    @pytest.hookimpl(tryfirst=True)  # the remote saves are taken off the report before junitxml reads it
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        worker = xdist.worker_of(report) or ""
        saves = taken_relays(report)
        if saves:
            self._remember_remote(worker, saves)
            write_saves(self.shared.pool, worker, saves)
        for key, name in report.user_properties:
            if key == OBSERVED_PROPERTY:
                self.reported.add((worker, str(name)))  # a group name: user_properties' values are objects
            if key in (OBSERVED_PROPERTY, ANNOUNCED_PROPERTY):
                self.announced.add((worker, str(name)))

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        worker = node.gateway.id
        output = getattr(node, "workeroutput", {}).get(xdist.OUTPUT_KEY) or {}
        if "relay" in output:
            self._remember_remote(worker, output["relay"]["saves"])
            write_offer(self.shared.pool, worker, output["relay"])
        mark_down(self.shared.pool, worker)  # after its manifest: the workers waiting read both
        if error is not None:
            self.crashed.add(worker)
        self._merge(output, worker)

    def _remember_remote(self, worker: str, saves: list[dict[str, Any]]) -> None:
        """``worker`` sends its saves (it does not see the pool); where they say it imports its
        test modules from."""
        self.remote.add(worker)
        for save in saves:
            self.roots += [root for root in save.get("roots", []) if root not in self.roots]

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
                                    "observations of one model are checked once")
            self.results[result.name] = result

    def _final(self, worker: str, name: str) -> str:
        """The name of the group a test on ``worker`` recorded as ``name`` (a split or the pool renames)."""
        return self.renamed.get(worker, {}).get(name, name)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.usage_error is not None:
            raise pytest.UsageError(self.usage_error)  # pytest prints it and exits with code 4
        if self.remote:
            self._check_unclaimed(session)
        for name, worker in claimed(self.shared.pool).items():
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
        self.conclude(session, observed, set(self.collected))

    def _check_unclaimed(self, session: pytest.Session) -> None:
        """Check the models no worker claimed (those only remote workers observed, when no
        worker sees the pool), rebuilt from what they sent; name the remote workers' models as
        the pool does."""
        sys.path[:0] = [path for path in import_paths(self.config, self.roots) if path not in sys.path]
        pool = Pool(self.shared.pool, "controller")
        groups = pool.claims(None, _positions(self.collected))
        for batch in _batches(groups, self.options.jobs):
            for result in _check(session, batch, self.options, progress_writer(self.config)):
                self.results[result.name] = result
                self.checked_on[result.name] = pool.worker
        for worker, renamed in pool.renames(sorted(self.remote)).items():
            self.renamed.setdefault(worker, {}).update(renamed)


def choose_role(config: pytest.Config, options: Options) -> LocalRole | WorkerRole | ControllerRole:
    """The role of this process in the session."""
    if xdist.is_worker(config):
        return WorkerRole(config, options)
    if xdist.is_controller(config):
        return ControllerRole(config, options)
    return LocalRole(config, options)
