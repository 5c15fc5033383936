"""pytest-xdist support: the tests of a marked model on one worker, results brought to the controller.

The controller creates a directory for the workers (named in ``workerinput``; a worker on
another host does not see it).  Under
``--dist load`` (the default) the plugin replaces xdist's scheduler with
:class:`~.scheduling.ModelScheduling`, which sends the tests of one *placement group* to one
worker: the tests whose markers name a common model, merged transitively, which each worker
computes from its collection and writes to that directory (when no worker sees it, a scope is a
test module, as under ``--dist loadfile``).  Every other test (those observing
through ``export_observer.watch()`` or ``--export-observe``, whose models are known only when
they run) is spread as ``--dist load`` spreads it, and the observations of a model made on
several workers are pooled (:mod:`.pooling`).  Node ids are left as they are.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from ..core.files import json_text, write_atomic
from .observing import ANNOUNCED_PROPERTY, marked_names
from .pooling import POOL_KEY, TOKEN_KEY, admit, open_pool

PLACEMENT_KEY = "exportobs_placement"  # workerinput: the directory the workers write their placement to
OUTPUT_KEY = "exportobs"  # workeroutput: the worker's JSON results


def is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def is_controller(config: pytest.Config) -> bool:
    """Whether this process distributes the tests to xdist workers."""
    return config.pluginmanager.hasplugin("xdist") and getattr(config.option, "dist", "no") != "no"


class SharedDirectory:
    """A new directory the workers write their placement and pool their observations in
    (removed at the end of the session), and the token that tells a worker it sees it."""

    def __init__(self, config: pytest.Config):
        self.path = Path(tempfile.mkdtemp(prefix="exportobs-xdist-"))
        config.add_cleanup(lambda: shutil.rmtree(self.path, ignore_errors=True))
        self.pool = self.path / "pool"
        self.token = open_pool(self.pool)


def schedules(config: pytest.Config) -> bool:
    """Whether the plugin places the tests: under ``--dist load``; any other is the user's choice."""
    return config.option.dist == "load"


def make_scheduler(config: pytest.Config, log: Any, directory: Path) -> Any:
    from .scheduling import ModelScheduling

    return ModelScheduling(config, log, directory)


def configure_node(config: pytest.Config, node: Any, shared: SharedDirectory) -> None:
    node.workerinput[POOL_KEY] = str(shared.pool)
    node.workerinput[TOKEN_KEY] = shared.token
    admit(shared.pool, node.gateway.id)
    if schedules(config):
        node.workerinput[PLACEMENT_KEY] = str(shared.path)


def write_placement(config: pytest.Config, items: Iterable[pytest.Item]) -> None:
    """Write the placement group of every marked test, when the controller asked for it (on a
    worker that sees the shared directory)."""
    workerinput = config.workerinput  # type: ignore[attr-defined]  # set by xdist on workers
    directory = workerinput.get(PLACEMENT_KEY)
    if directory is not None:
        write_atomic(Path(directory, f"{workerinput['workerid']}.json"), json_text(placement(items)))


def placement(items: Iterable[pytest.Item]) -> dict[str, str]:
    """``{node id: group}`` for the tests whose markers name models: tests naming a common model
    share a group (named after its first model in sorted order)."""
    parent: dict[str, str] = {}

    def root(name: str) -> str:
        while parent.setdefault(name, name) != name:
            name = parent[name]
        return name

    keys = {item.nodeid: marked_names(item) for item in items}
    for names in keys.values():
        for name in names:
            parent[root(name)] = root(names[0])
    label: dict[str, str] = {}  # root -> the first of its group's names in sorted order
    for name in sorted(parent):
        label.setdefault(root(name), name)
    return {nodeid: f"exportobs:{label[root(names[0])]}" for nodeid, names in keys.items() if names}


def announce(item: pytest.Item) -> None:
    """At setup, name the groups the item's markers will observe (sent with the setup report)."""
    item.user_properties.extend((ANNOUNCED_PROPERTY, name) for name in marked_names(item))


def worker_of(report: pytest.TestReport) -> str | None:
    """The id of the worker that sent ``report`` (``None`` for the controller's own reports)."""
    node = getattr(report, "node", None)
    return node.gateway.id if node is not None else None
