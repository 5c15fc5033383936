"""pytest hooks of pytest-exportobs (the ``pytest11`` entry point).

Without ``--export-check`` (or ini ``export_check = true``) nothing here imports torch, wraps a
model or writes a file.  With it, :func:`~.roles.choose_role` picks the plugin object for this
process (local, xdist controller or worker), which holds every other hook.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
from collections.abc import Iterator
from typing import Any

import pytest

from .observing import MARKER_HELP, NO_OBSERVE_MARKER_HELP
from .options import Options, add_options

ROLE_PLUGIN = "exportobs-role"
role_key = pytest.StashKey[Any]()


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER_HELP)
    config.addinivalue_line("markers", NO_OBSERVE_MARKER_HELP)
    options = Options.from_config(config)
    if not options.enabled or config.option.collectonly:
        return
    from .roles import choose_role

    role = config.stash[role_key] = choose_role(config, options)
    config.pluginmanager.register(role, ROLE_PLUGIN)
    _freeze_heap_at_exit()


def pytest_unconfigure(config: pytest.Config) -> None:
    role = config.stash.get(role_key, None)
    if role is not None:
        config.pluginmanager.unregister(role)
        del config.stash[role_key]


@functools.cache
def _freeze_heap_at_exit() -> None:
    """Once per process: at exit, move every object out of the garbage collector's reach.

    A process that imported torch holds several hundred thousand objects, and one that exported
    models many more (fx graphs, sympy expressions, torch.export's caches); the interpreter's
    collections at shutdown walk them again and again: about 2 s for a process that exported a
    tiny Llama, 0.2 s frozen, and an xdist controller waits for every worker's exit.  pytest
    has collected the garbage once more by then (its unraisable-exception check); what is left
    is the operating system's to take back."""
    atexit.register(gc.freeze)


class ExportObserver:
    """The ``export_observer`` fixture: ``watch(module, name=None, **marker_kwargs)`` observes a
    module until the end of the test and returns it (unchanged when the check is off)."""

    def __init__(self, request: pytest.FixtureRequest, stack: contextlib.ExitStack):
        self._request = request
        self._stack = stack

    def watch(self, module: Any, name: str | None = None, **kwargs: Any) -> Any:
        role = self._request.config.stash.get(role_key, None)
        if role is None:
            return module
        return role.watch(self._request, self._stack, module, name, kwargs)


@pytest.fixture
def export_observer(request: pytest.FixtureRequest) -> Iterator[ExportObserver]:
    with contextlib.ExitStack() as stack:
        yield ExportObserver(request, stack)
