"""What the plugin does during a session with ``--export-check``, apart from pytest's hooks.

Observation happens in the process that runs the tests.  At the end, the process that holds a
model's observations checks it: the only process, or under xdist the worker all observing tests
were sent to (the plugin pins them to one worker with an ``xdist_group``), which ships JSON
results to the controller.  The controller alone applies the baseline, reports and writes files.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from .baseline import Baseline, BaselineError, Gate, gate
from .results import INCOMPLETE, ModelResult
from .settings import Settings

MARKER = "observe_export"
XDIST_GROUP = "exportobs"
OUTPUT_KEY = "exportobs"


class ExportSession:
    """Observations, results and the gate of one pytest session."""

    def __init__(self, config: pytest.Config, settings: Settings):
        self.config = config
        self.settings = settings
        self.results: dict[str, ModelResult] = {}
        self.observed: set[str] = set()  # group names seen in test reports (controller side)
        self.checked_on: dict[str, str] = {}  # group name -> worker that sent its result
        self.gate: Gate | None = None
        self.problems: list[str] = []  # files that could not be written
        self.baseline = self._load_baseline() if not is_worker(config) else None
        self._store: Any = None

    # -- observation ------------------------------------------------------------------------------
    @property
    def store(self) -> Any:
        if self._store is None:
            from .store import SessionStore

            self._store = SessionStore()
        return self._store

    @contextlib.contextmanager
    def observe_marked(self, item: pytest.Item) -> Iterator[None]:
        """Observe the fixtures named by the item's ``observe_export`` markers during its call."""
        marks = list(item.iter_markers(MARKER))
        if not marks:
            yield
            return
        with contextlib.ExitStack() as stack:
            for mark in marks:
                if not mark.args:
                    pytest.fail(f"@pytest.mark.{MARKER} needs the name of at least one fixture", pytrace=False)
                options = self._options(mark.kwargs, f"@pytest.mark.{MARKER} on {item.nodeid}")
                for fixture in mark.args:
                    module = self._fixture_value(item, fixture)
                    group = self._enter(stack, module, fixture, options, item)
                    item.user_properties.append((OUTPUT_KEY, group.name))
            yield

    def watch(self, request: pytest.FixtureRequest, stack: contextlib.ExitStack, module: Any,
              name: str | None, kwargs: dict[str, Any]) -> Any:
        """``export_observer.watch``: observe ``module`` until the test's teardown."""
        options = self._options({**kwargs, "name": name}, f"export_observer.watch() in {request.node.nodeid}")
        default = type(module).__qualname__
        group = self._enter(stack, module, default, options, request.node)
        request.node.user_properties.append((OUTPUT_KEY, group.name))
        return module

    def _options(self, kwargs: dict[str, Any], where: str) -> Any:
        from .store import ObserveOptions

        try:
            return ObserveOptions.from_kwargs(kwargs, where)
        except TypeError as e:
            message = str(e)
        pytest.fail(message, pytrace=False)

    def _fixture_value(self, item: pytest.Item, fixture: str) -> Any:
        funcargs = getattr(item, "funcargs", {})
        if fixture not in funcargs:
            pytest.fail(
                f"@pytest.mark.{MARKER}({fixture!r}): the test does not use a fixture named {fixture!r} "
                f"(its fixtures: {sorted(funcargs)})", pytrace=False,
            )
        return funcargs[fixture]

    def _enter(self, stack: contextlib.ExitStack, module: Any, default: str, options: Any, item: pytest.Item) -> Any:
        try:
            return stack.enter_context(self.store.observe(module, default, options, item.nodeid))
        except (TypeError, ValueError) as e:
            message = f"exportobs: {e}"
        pytest.fail(message, pytrace=False)

    # -- finishing --------------------------------------------------------------------------------
    def check_local(self, progress: Callable[[str], None] | None = None) -> None:
        """Check every group observed in this process."""
        if self._store is None:
            return
        from .check import CheckSettings
        from .runner import check_all

        settings = CheckSettings(
            export_dir=self.settings.export_dir, target=self.settings.target, atol=self.settings.atol,
            rtol=self.settings.rtol, examples=self.settings.examples, patches=self.settings.patches,
            hypothesis_seed=self.settings.hypothesis_seed, env=environment(),
        )
        for result in check_all(self.store.groups.values(), settings, self.settings.isolate, progress):
            self.results[result.name] = result

    def worker_output(self) -> dict[str, Any]:
        """JSON-native payload a worker sends to the controller."""
        return {"results": [r.to_json() for r in self.results.values()]}

    def merge_worker_output(self, output: dict[str, Any] | None, worker: str) -> None:
        """Merge a worker's results; a model checked on two workers is incomplete, not guessed."""
        for data in (output or {}).get("results", []):
            result = ModelResult.from_json(data)
            first = self.checked_on.setdefault(result.name, worker)
            if first != worker:
                result = _incomplete(result.name, f"observed on workers {first} and {worker}: "
                                     "the observations of one model must stay on one worker "
                                     "(run with --dist load or loadgroup)")
            self.results[result.name] = result

    def conclude(self) -> Gate:
        """Mark models observed but never checked as incomplete, judge with the baseline, write files."""
        for name in sorted(self.observed - set(self.results)):
            self.results[name] = _incomplete(name, "the process that observed it ended without a result "
                                                   "(crashed worker?)")
        results = [self.results[n] for n in sorted(self.results)]
        if self.settings.baseline_update and self.settings.baseline is not None:
            # The new baseline is what this session is judged by: failures become known ones.
            self.baseline = Baseline.from_results(results)
            self._write(f"baseline {self.settings.baseline}", lambda: self.baseline.write(self.settings.baseline))
        self.gate = gate(self.baseline, results, self.settings.strict)
        if self.settings.report is not None:
            from .reports import write_reports

            self._write(f"report {self.settings.report}",
                        lambda: write_reports(self.settings.report, results, self.gate, environment()))
        return self.gate

    def _write(self, what: str, write: Callable[[], Any]) -> None:
        try:
            write()
        except OSError as e:
            self.problems.append(f"exportobs: could not write the {what}: {e}")

    def _load_baseline(self) -> Baseline | None:
        path = self.settings.baseline
        if path is None:
            if self.settings.baseline_update:
                raise pytest.UsageError("--export-baseline-update needs --export-baseline PATH (or ini export_baseline)")
            return None
        if self.settings.baseline_update:
            return None  # replaced at the end; an unreadable old file is no reason to stop
        if not path.exists():
            raise pytest.UsageError(f"export baseline {path} does not exist: create it with --export-baseline-update")
        try:
            return Baseline.load(path)
        except BaselineError as e:
            raise pytest.UsageError(str(e)) from None


def is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def environment() -> dict[str, str]:
    """Versions of the packages an export depends on (for display, never compared)."""
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for package in ("torch", "onnx", "onnxscript", "onnxruntime", "transformers"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            continue
    return versions


def _incomplete(name: str, reason: str) -> ModelResult:
    return ModelResult(name=name, verdict=INCOMPLETE, stage="observe", kind="incomplete", reason=reason)
