"""The test side of a session: the ``observe_export`` marker, ``export_observer.watch()`` and
``--export-observe CLASS`` record the calls of models into the session store.

Each observing test records the names of the groups it fed in its ``user_properties``, so that
the process that concludes the session knows every model observed, even on a crashed worker.
Under xdist a test also announces, at setup, the names its markers will observe: when its worker
crashes during the call, the controller still knows which models were lost.
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from ..observe.options import ObserveOptions
from .options import Options

MARKER = "observe_export"
NO_OBSERVE_MARKER = "no_observe_export"
OBSERVED_PROPERTY = "exportobs"  # user_properties key naming a group a test observed
ANNOUNCED_PROPERTY = "exportobs_announced"  # ... naming a group a test's marker is about to observe
MARKER_HELP = (
    f"observe_export(*fixture_names, {ObserveOptions.signature()}): record the calls of the named "
    "fixtures' modules during this test; with --export-check they are exported and verified at the end"
)
NO_OBSERVE_MARKER_HELP = (
    f"{NO_OBSERVE_MARKER}: --export-observe observes no model in these tests (on a test, class or module)"
)
_observed_here = pytest.StashKey[set[int]]()  # ids of the modules a marker or watch() observes in a test


def marked_names(item: pytest.Item) -> list[str]:
    """The group names the item's markers name (``name=``, else each fixture's name)."""
    return [mark.kwargs.get("name") or fixture for mark in item.iter_markers(MARKER) for fixture in mark.args]


def auto_observes(item: pytest.Item, options: Options) -> bool:
    """Whether ``--export-observe`` may observe models in a test (no marker, no pattern excludes it)."""
    return bool(options.observe) and item.get_closest_marker(NO_OBSERVE_MARKER) is None and not any(
        fnmatch.fnmatchcase(item.nodeid, pattern) for pattern in options.observe_exclude)


class Observing:
    """Hooks and fixture support of a process that runs tests and records the models they call."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self._store: Any = None  # created on the first observation: torch is imported then
        self._auto: Any = None  # the AutoObserve of --export-observe, once its classes are resolved

    @property
    def store(self) -> Any:
        if self._store is None:
            from ..observe.store import SessionStore

            self._store = SessionStore()
        return self._store

    def resolve_observed_classes(self) -> None:
        """Import the classes of ``--export-observe``; ``ValueError`` naming a bad path."""
        if self.options.observe:
            from ..observe.autoobserve import AutoObserve, resolve_classes

            self._auto = AutoObserve(resolve_classes(self.options.observe), self.options.observe_exclude)

    def pytest_sessionstart(self) -> None:
        try:
            self.resolve_observed_classes()
        except ValueError as e:
            raise pytest.UsageError(str(e)) from None

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Iterator[None]:
        with self._observe_marked(item), self._observe_called(item):
            return (yield)

    @contextlib.contextmanager
    def _observe_called(self, item: pytest.Item) -> Iterator[None]:
        """``--export-observe``: observe the instances of its classes the test calls (outermost)."""
        if self._auto is None or not auto_observes(item, self.options):
            yield
            return
        with contextlib.ExitStack() as stack, self._auto.calls(lambda module: self._enter_called(stack, module, item)):
            yield

    def _enter_called(self, stack: contextlib.ExitStack, module: Any, item: pytest.Item) -> None:
        """Observe a module the test calls, named as ``watch()`` names it, unless a marker or
        ``watch()`` observes it already (errors go to the caller, which counts them)."""
        if id(module) in item.stash.get(_observed_here, set()):
            return

        observing = self.store.observe(module, type(module).__qualname__, ObserveOptions(), item.nodeid)
        item.user_properties.append((OBSERVED_PROPERTY, stack.enter_context(observing).name))

    def pytest_runtest_logfinish(self) -> None:
        """The test's objects are gone (pytest dropped its fixture values): the models it
        observed that only the store keeps are put away (gradients dropped, packed)."""
        if self._store is not None:
            self._store.put_away()

    def stop_observing(self) -> None:
        """Give the classes of ``--export-observe`` their ``__call__`` back, and release the
        gradients of every kept model: the tests are over (before any check)."""
        if self._auto is not None:
            self._auto.uninstall()
        if self._store is not None:
            self._store.release_gradients()

    def auto_notes(self) -> list[str]:
        """One line per kind of failure to begin observing a called module (never a test's failure)."""
        failures = {} if self._auto is None else self._auto.failures
        return [f"exportobs: --export-observe could not observe a module {n} time(s): {message}"
                for message, n in sorted(failures.items())]

    @contextlib.contextmanager
    def _observe_marked(self, item: pytest.Item) -> Iterator[None]:
        """Observe the fixtures named by the item's ``observe_export`` markers during its call."""
        marks = list(item.iter_markers(MARKER))
        if not marks:
            yield
            return
        with contextlib.ExitStack() as stack:
            for mark in marks:
                if not mark.args:
                    pytest.fail(f"@pytest.mark.{MARKER} needs the name of at least one fixture", pytrace=False)
                options = _options(mark.kwargs, f"@pytest.mark.{MARKER} on {item.nodeid}")
                for fixture in mark.args:
                    self._enter(stack, _fixture_value(item, fixture), fixture, options, item)
            yield

    def watch(self, request: pytest.FixtureRequest, stack: contextlib.ExitStack, module: Any,
              name: str | None, kwargs: dict[str, Any]) -> Any:
        """``export_observer.watch``: observe ``module`` until the test's teardown."""
        options = _options({**kwargs, "name": name}, f"export_observer.watch() in {request.node.nodeid}")
        self._enter(stack, module, type(module).__qualname__, options, request.node)
        return module

    def _enter(self, stack: contextlib.ExitStack, module: Any, default: str, options: Any, item: pytest.Item) -> None:
        try:
            group = stack.enter_context(self.store.observe(module, default, options, item.nodeid))
        except (TypeError, ValueError) as e:
            message = f"exportobs: {e}"
        else:
            item.user_properties.append((OBSERVED_PROPERTY, group.name))
            item.stash.setdefault(_observed_here, set()).add(id(module))
            return
        pytest.fail(message, pytrace=False)

    def groups(self) -> list[Any]:
        """The model groups observed in this process."""
        return [] if self._store is None else list(self._store.groups.values())

    def renamed(self) -> dict[str, str]:
        """Names tests recorded that a later split renamed, and the groups' names now."""
        return {} if self._store is None else dict(self._store.renamed)


def _options(kwargs: Mapping[str, Any], where: str) -> Any:

    try:
        return ObserveOptions.from_kwargs(kwargs, where)
    except TypeError as e:
        message = str(e)
    pytest.fail(message, pytrace=False)


def _fixture_value(item: pytest.Item, fixture: str) -> Any:
    funcargs = getattr(item, "funcargs", {})
    if fixture not in funcargs:
        pytest.fail(
            f"@pytest.mark.{MARKER}({fixture!r}): the test does not use a fixture named {fixture!r} "
            f"(its fixtures: {sorted(funcargs)})", pytrace=False,
        )
    return funcargs[fixture]
