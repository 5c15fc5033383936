"""pytest-xdist support: one worker per model, results brought to the controller.

The observations of one model must all reach the process that checks it, while different models
may go to different workers, which check them at the same time.  On the controller the plugin
replaces ``--dist load`` (the default) with :class:`~.scheduling.ModelScheduling`, which sends
the tests of one *placement group* to one worker.  Each worker computes the groups from its
collection — the tests whose markers name a common model, merged transitively; every test that
calls ``export_observer.watch()`` or in which ``--export-observe`` may observe (its models are
known only when it runs) in one group — and writes them to a directory the controller passed in
``workerinput``.  Node ids are left as they are.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

from ..core.files import json_text, write_atomic
from .observing import ANNOUNCED_PROPERTY, marked_names, watches

PLACEMENT_KEY = "exportobs_placement"  # workerinput: the directory the workers write their placement to
OUTPUT_KEY = "exportobs"  # workeroutput: the worker's JSON results
WATCH_GROUP = "watch()"  # the placement group of the tests whose models are named at run time


def is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def is_controller(config: pytest.Config) -> bool:
    """Whether this process distributes the tests to xdist workers."""
    return config.pluginmanager.hasplugin("xdist") and getattr(config.option, "dist", "no") != "no"


def placement_directory(config: pytest.Config) -> Path | None:
    """With ``--dist load``, a new directory for the workers' placement (removed at the end of
    the session); ``None`` under any other ``--dist``, the user's choice."""
    if config.option.dist != "load":
        return None
    directory = Path(tempfile.mkdtemp(prefix="exportobs-placement-"))
    config.add_cleanup(lambda: shutil.rmtree(directory, ignore_errors=True))
    return directory


def make_scheduler(config: pytest.Config, log: Any, directory: Path) -> Any:
    from .scheduling import ModelScheduling

    return ModelScheduling(config, log, directory)


def configure_node(node: Any, directory: Path) -> None:
    node.workerinput[PLACEMENT_KEY] = str(directory)


def write_placement(config: pytest.Config, items: Iterable[pytest.Item],
                    auto: Callable[[pytest.Item], bool] | None = None) -> None:
    """Write the placement group of every observing test, when the controller asked for it."""
    directory = config.workerinput.get(PLACEMENT_KEY)
    if directory is not None:
        write_atomic(Path(directory, f"{config.workerinput['workerid']}.json"), json_text(placement(items, auto)))


def placement(items: Iterable[pytest.Item], auto: Callable[[pytest.Item], bool] | None = None) -> dict[str, str]:
    """``{node id: group}`` for the tests that observe: tests naming a common model share a
    group (named after its first model in sorted order), and so do all tests calling ``watch()``
    and all tests ``auto`` says ``--export-observe`` may observe models in (their models are
    known only when they run)."""
    parent: dict[str, str] = {}

    def root(name: str) -> str:
        while parent.setdefault(name, name) != name:
            name = parent[name]
        return name

    runtime = auto or (lambda item: False)
    keys = {item.nodeid: marked_names(item) + ([WATCH_GROUP] if watches(item) or runtime(item) else [])
            for item in items}
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
