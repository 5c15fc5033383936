"""The test side of a session: the ``observe_export`` marker and ``export_observer.watch()``
record the calls of models into the session store.

Each observing test records the names of the groups it fed in its ``user_properties``, so that
the process that concludes the session knows every model observed, even on a crashed worker.
Under xdist a test also announces, at setup, the names its markers will observe: when its worker
crashes during the call, the controller still knows which models were lost.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

MARKER = "observe_export"
OBSERVED_PROPERTY = "exportobs"  # user_properties key naming a group a test observed
ANNOUNCED_PROPERTY = "exportobs_announced"  # ... naming a group a test's marker is about to observe
MARKER_HELP = (
    "observe_export(*fixture_names, name=None, set_batch_dimension_for=None, value_if_missing=None, "
    "dim_names=None, atol=None, rtol=None, examples=None, method='forward', xfail=None, patches=(), "
    "store_n_calls=3): record the calls of the named fixtures' modules during this test; with "
    "--export-check they are exported and verified at the end"
)


def marked_names(item: pytest.Item) -> list[str]:
    """The group names the item's markers name (``name=``, else each fixture's name)."""
    return [mark.kwargs.get("name") or fixture for mark in item.iter_markers(MARKER) for fixture in mark.args]


def watches(item: pytest.Item) -> bool:
    """Whether a test may observe models through ``export_observer.watch()``."""
    return "export_observer" in getattr(item, "fixturenames", ())


class Observing:
    """Hooks and fixture support of a process that runs tests and records the models they call."""

    def __init__(self) -> None:
        self._store: Any = None  # created on the first observation: torch is imported then

    @property
    def store(self) -> Any:
        if self._store is None:
            from ..observe.store import SessionStore

            self._store = SessionStore()
        return self._store

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Iterator[None]:
        with self._observe_marked(item):
            return (yield)

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
            return
        pytest.fail(message, pytrace=False)

    def groups(self) -> list[Any]:
        """The model groups observed in this process."""
        return [] if self._store is None else list(self._store.groups.values())


def _options(kwargs: dict[str, Any], where: str) -> Any:
    from ..observe.store import ObserveOptions

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
