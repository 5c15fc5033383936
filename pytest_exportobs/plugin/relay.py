"""The observations of an xdist worker on another host, brought into the pool through xdist's channel.

A worker that does not see the controller's directory (:func:`~.pooling.sees`) saves what it
observed as a worker that sees it does, but attaches the saves to its test reports (after each
test that observed) and to its output (what is left, and its manifest); the controller takes
them off the reports before anything shows them and writes them into the pool, so that the
workers that see it, or the controller itself, check the models once on every call.  Saves
are plain data (dicts of str, int and bytes: what execnet carries); a module and its calls are
torch's serialized format inside them, so the classes they name must import where they are
checked: a first save carries the directories the worker imported its tests from.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from .pooling import Save, Saves, sees, write_manifest, write_saves

RELAY_PROPERTY = "exportobs_relay"  # a remote worker's saves on a test report (never written in a report)


def import_roots(config: pytest.Config) -> list[str]:
    """The entries of ``sys.path`` inside the rootdir, relative to it: where the test modules
    (and the classes of the models they define) are imported from."""
    roots = []
    for entry in sys.path:
        path = Path(entry or os.getcwd()).resolve()
        if path.is_relative_to(config.rootpath) and (relative := str(path.relative_to(config.rootpath))) not in roots:
            roots.append(relative)
    return roots


def import_paths(config: pytest.Config, roots: Iterable[str]) -> list[str]:
    """On the controller: the directories a remote worker's :func:`import_roots` are here,
    under the rootdir, else beside the paths the session was given (``--rsyncdir`` copies a
    directory into the worker's own, which becomes its rootdir)."""
    given = [config.invocation_params.dir / arg.split("::")[0] for arg in config.args]
    bases = [config.rootpath, *dict.fromkeys(path.parent for path in given)]
    paths = [str(base / root) for root in roots for base in bases if (base / root).is_dir()]
    return list(dict.fromkeys(paths))


class Relay:
    """The side of a worker that does not see the controller's directory: its saves travel on
    its test reports and, at the end, with its output."""

    def __init__(self, worker: str, roots: list[str]):
        self.saves = Saves(worker)
        self.roots = roots

    @classmethod
    def of(cls, config: pytest.Config) -> Relay | None:
        """The relay of an xdist worker that does not see the controller's directory."""
        workerinput = getattr(config, "workerinput", None)
        if workerinput is None or sees(workerinput):
            return None
        return cls(workerinput["workerid"], import_roots(config))

    @property
    def notes(self) -> list[str]:
        return self.saves.notes

    def save(self, store: Any, properties: list[tuple[str, object]]) -> None:
        """Attach what ``store`` recorded since the last save to a test report's ``properties``."""
        properties.extend((RELAY_PROPERTY, save) for save in self._since_last(store))

    def offer(self, store: Any) -> dict[str, Any]:
        """What is left of ``store`` and the manifest, for the worker's output."""
        return {"saves": [] if store is None else self._since_last(store), "manifest": Saves.manifest(store)}

    def _since_last(self, store: Any) -> list[Save]:
        """The saves, a model's first one with the worker's :func:`import_roots` (where the
        process that checks it imports its class from)."""
        saves = self.saves.since_last(store)
        for save in saves:
            if "order" in save:
                save["roots"] = self.roots
        return saves


def taken_relays(report: pytest.TestReport) -> list[Save]:
    """On the controller: the saves a remote worker attached to ``report``, taken off it (no
    report or junit file shows them)."""
    saves: list[Save] = [value for key, value in report.user_properties if key == RELAY_PROPERTY]  # type: ignore[misc]  # what Relay.save attached
    if saves:
        report.user_properties = [(key, value) for key, value in report.user_properties if key != RELAY_PROPERTY]
    return saves


def write_offer(directory: Path, worker: str, offer: dict[str, Any]) -> None:
    """On the controller, as a remote worker goes down: its last saves, then (last: the others
    read it as the sign that everything is there) its manifest, marked as relayed."""
    write_saves(directory, worker, offer["saves"])
    (directory / f"relayed-{worker}").touch()
    write_manifest(directory, worker, offer["manifest"])
