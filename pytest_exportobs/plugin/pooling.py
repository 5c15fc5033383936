"""Under xdist, the observations of one model made on several workers meet on one worker.

Tests spread over the workers as ``--dist load`` spreads them, so a model that tests call
through ``watch()`` or ``--export-observe`` is observed on several.  At the end of the session
each worker saves its observations to a directory the controller shares with the workers and
then writes a manifest of its models.  Once every worker has written one (or went down, which the
controller marks), each worker names the models as one process observing every call would, and
claims the models it holds one by one, most observed first: a claim is a file created
exclusively, so each model is checked once, on a worker that has an instance of it, while the
checks spread over the workers.  The claiming worker absorbs what the others observed of the
model before checking it.  A worker that crashed saved nothing: the controller reports its models.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ..core.files import json_text, write_atomic

POOL_KEY = "exportobs_pool"  # workerinput: the directory the workers pool their observations in
WAIT_SECONDS = 600.0  # the longest a worker waits for the others' manifests (they follow the last test)
_POLL_SECONDS = 0.05


def mark_down(directory: Path, worker: str) -> None:
    """On the controller: ``worker`` went down; nobody waits for its manifest any more."""
    (directory / f"down-{worker}").touch()


def claimed(directory: Path) -> dict[str, str]:
    """On the controller: ``{model name: the worker that claimed it}``."""
    owners = {}
    for path in directory.glob("claim-*"):
        worker, _, name = path.read_text(encoding="utf-8").partition(" ")
        owners[name] = worker
    return owners


def offered(directory: Path, worker: str) -> bool:
    """Whether ``worker`` pooled its observations (a crash after that loses none)."""
    return (directory / f"{worker}.json").exists()


class Pool:
    """One worker's side of the pool in ``directory``."""

    def __init__(self, directory: Path, worker: str):
        self.directory = directory
        self.worker = worker
        self._saved: dict[str, Any] = {}  # worker -> the groups it saved, loaded once

    @classmethod
    def of(cls, config: pytest.Config) -> Pool | None:
        """The pool the controller set up for this worker, ``None`` outside xdist."""
        workerinput = getattr(config, "workerinput", {})
        directory = workerinput.get(POOL_KEY)
        return None if directory is None else cls(Path(directory), workerinput["workerid"])

    def join(self) -> None:
        """Say, before collecting, that this worker will write a manifest."""
        (self.directory / f"ready-{self.worker}").touch()

    def offer(self, store: Any) -> None:
        """Save the observations of ``store`` (``None``: nothing observed), then the manifest."""
        keys = {} if store is None else store.keys()
        if keys:
            from ..observe.pool import save

            save(store, self._observations(self.worker))
        models = [{"base": base, "identity": ident, "observations": store.groups[name].recorder.num_obs()}
                  for name, (base, ident) in sorted(keys.items())]
        write_atomic(self._manifest(self.worker), json_text({"models": models}))

    def wait(self, clock: Callable[[], float] = time.monotonic) -> list[str]:
        """Wait until every worker that joined has written its manifest or went down; a note
        names those still silent after :data:`WAIT_SECONDS` (their observations are left out)."""
        deadline = clock() + WAIT_SECONDS
        while True:
            silent = [worker for worker in self._joined()
                      if not offered(self.directory, worker) and not (self.directory / f"down-{worker}").exists()]
            if not silent:
                return []
            if clock() > deadline:
                return [f"exportobs: worker(s) {', '.join(silent)} wrote no observations within "
                        f"{WAIT_SECONDS:g} s; the models were checked without them"]
            time.sleep(_POLL_SECONDS)

    def claims(self, store: Any, position: Callable[[str], int]) -> Iterator[Any]:
        """Name this worker's groups as the pool names them, then yield those it claims, each with
        the other workers' observations of it absorbed in the tests' collection order
        (``position`` of a node id)."""
        if store is None:
            return
        from ..observe.pool import absorb, pooled_names

        manifests = {path.stem: json.loads(path.read_text(encoding="utf-8"))["models"]
                     for path in sorted(self.directory.glob("*.json"))}
        held = {worker: {(m["base"], m["identity"]): m["observations"] for m in models}
                for worker, models in manifests.items()}
        names = pooled_names(key for models in held.values() for key in models)
        local = store.keys()
        for name, key in local.items():
            store.rename(name, names[key])
        for key in sorted(local.values(), key=lambda k: (-sum(m.get(k, 0) for m in held.values()), names[k])):
            if self._claim(key, names[key]):
                group = store.groups[names[key]]
                absorb(group, [self._saved_by(worker)[key] for worker in sorted(held)
                               if worker != self.worker and key in held[worker]], position)
                yield group

    def _claim(self, key: tuple[str, str], name: str) -> bool:
        """Create the model's claim file, naming this worker and the model; ``False`` if it exists."""
        digest = hashlib.sha1(repr(key).encode()).hexdigest()[:16]
        try:
            descriptor = os.open(self.directory / f"claim-{digest}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            file.write(f"{self.worker} {name}")
        return True

    def _saved_by(self, worker: str) -> Any:
        if worker not in self._saved:
            from ..observe.pool import load

            self._saved[worker] = load(self._observations(worker))
        return self._saved[worker]

    def _joined(self) -> list[str]:
        return sorted(path.name.removeprefix("ready-") for path in self.directory.glob("ready-*"))

    def _manifest(self, worker: str) -> Path:
        return self.directory / f"{worker}.json"

    def _observations(self, worker: str) -> Path:
        return self.directory / f"{worker}.pt"
