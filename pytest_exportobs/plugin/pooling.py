"""Under xdist, the observations of one model made on several workers meet on one worker.

Tests spread over the workers as ``--dist load`` spreads them, so a model that tests call
through ``watch()`` or ``--export-observe`` is observed on several.  Each worker saves, after
every test that observed, what it recorded to a directory the controller shares with the
workers (once per model its module and options, then the new calls), so that a worker that
crashes loses only the calls of the test it crashed in.  At the end of the session each worker
writes a manifest of its models.  Once every worker has written one (or went down, which the
controller marks), each worker names the models as one process observing every call would, and
claims models one by one, most observed first: those it holds an instance of, then those only a
crashed worker held (rebuilt from the module it saved).  A claim is a file created exclusively,
so each model is checked once while the checks spread over the workers; the claiming worker
absorbs what the others observed of the model before checking it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ..core.files import json_text, write_atomic
from ..core.text import error_line

POOL_KEY = "exportobs_pool"  # workerinput: the directory the workers pool their observations in
WAIT_SECONDS = 600.0  # the longest a worker waits for the others' manifests (they follow the last test)
_POLL_SECONDS = 0.05
Key = tuple[str, str]  # (base name, identity), as observe.pool keys a model


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
    """Whether ``worker`` wrote its manifest (it reached the end of its tests)."""
    return _manifest(directory, worker).exists()


class Pool:
    """One worker's side of the pool in ``directory``."""

    def __init__(self, directory: Path, worker: str):
        self.directory = directory
        self.worker = worker
        self.notes: list[str] = []
        self._saved: dict[Key, int] = {}  # model -> the number of its calls saved so far

    @classmethod
    def of(cls, config: pytest.Config) -> Pool | None:
        """The pool the controller set up for this worker, ``None`` outside xdist."""
        workerinput = getattr(config, "workerinput", {})
        directory = workerinput.get(POOL_KEY)
        return None if directory is None else cls(Path(directory), workerinput["workerid"])

    def join(self) -> None:
        """Say, before collecting, that this worker will write a manifest."""
        (self.directory / f"ready-{self.worker}").touch()

    def save(self, store: Any) -> None:
        """Save what ``store`` recorded since the last call: a model's module and options the
        first time, then its new calls."""
        from ..observe.pool import save_calls, save_record

        for name, key in store.keys().items():
            group, folder = store.groups[name], self._folder(self.worker, key)
            if key not in self._saved:
                folder.mkdir(parents=True)
                try:
                    save_record(group, key[0], folder / "group.pt")
                except Exception as e:  # a module pickle cannot take (a class defined in a function)
                    self.notes.append(f"exportobs: {name} could not be saved for the other workers "
                                      f"({error_line(e)}): a crash of {self.worker} would lose it")
                write_atomic(folder / "key.json", json_text({"base": key[0], "identity": key[1],
                                                             "order": len(self._saved)}))
                self._saved[key] = 0
            calls = group.recorder.observations[self._saved[key]:]
            if calls:
                save_calls(calls, group.sources, folder / f"calls-{self._saved[key]:04d}.pt")
                self._saved[key] += len(calls)

    def offer(self, store: Any) -> None:
        """Save what is left of ``store`` (``None``: nothing observed), then the manifest: per
        model its :func:`~..observe.pool.tally` (one count per observation kept)."""
        from ..observe.pool import tally

        if store is not None:
            self.save(store)
        models = [{"base": base, "identity": ident, "tally": tally(store.groups[name].recorder)}
                  for name, (base, ident) in sorted(({} if store is None else store.keys()).items())]
        write_atomic(_manifest(self.directory, self.worker), json_text({"models": models}))

    def wait(self, clock: Callable[[], float] = time.monotonic) -> list[str]:
        """Wait until every worker that joined has written its manifest or went down; a note
        names those still silent after :data:`WAIT_SECONDS` (their last calls are left out)."""
        deadline = clock() + WAIT_SECONDS
        while True:
            silent = [worker for worker in self._joined()
                      if not offered(self.directory, worker) and not (self.directory / f"down-{worker}").exists()]
            if not silent:
                return []
            if clock() > deadline:
                return [f"exportobs: worker(s) {', '.join(silent)} wrote no manifest within "
                        f"{WAIT_SECONDS:g} s; the models were checked with the calls they had saved"]
            time.sleep(_POLL_SECONDS)

    def claims(self, store: Any, position: Callable[[str], int]) -> Iterator[Any]:
        """Name the groups as the pool names them, then yield those this worker claims, each with
        the other workers' calls absorbed in the tests' collection order (``position`` of a
        node id): its own groups, then those only crashed workers held."""
        from ..observe.pool import absorb, load_calls, rebuilt

        held, names = self._held, self._names
        local = {} if store is None else store.keys()
        for name, key in local.items():
            store.rename(name, names[key])
        live = {key for worker in held if offered(self.directory, worker) for key in held[worker]}
        own = sorted(local.values(), key=lambda k: (-sum(keys.get(k, 0) for keys in held.values()), names[k]))
        orphans = sorted(set(names) - live, key=names.__getitem__)
        for key in own + orphans:
            if not self._claim(key, names[key]):
                continue
            holders = sorted(worker for worker in held if key in held[worker])
            if key in local.values():
                group = store.groups[names[key]]
            else:
                records = [path for w in holders if (path := self._folder(w, key) / "group.pt").exists()]
                if not records:
                    continue  # the module could not be saved: the controller reports the model lost
                group = rebuilt(records[0])
                group.name = names[key]
            absorb(group, [load_calls(sorted(self._folder(w, key).glob("calls-*.pt")), self._tally(w, key))
                           for w in holders if w != self.worker], position)
            yield group

    def renames(self) -> dict[str, dict[str, str]]:
        """Per worker that wrote no manifest (crashed), the names its tests recorded -> the
        pooled names (as its own store would have named the models it saw, in order)."""
        from ..observe.pool import pooled_names

        held, names = self._held, self._names
        renames = {}
        for worker, keys in held.items():
            if offered(self.directory, worker):
                continue
            local = pooled_names(keys)
            renames[worker] = {local[key]: names[key] for key in keys}
            first: dict[str, Key] = {}
            for key in sorted(keys, key=keys.__getitem__):  # the first identity seen took the base name
                first.setdefault(key[0], key)
            renames[worker].update({base: names[key] for base, key in first.items()})
        return renames

    @functools.cached_property
    def _manifests(self) -> dict[str, dict[Key, dict[str, Any]]]:
        """Per worker that saved models and wrote a manifest, its models' entries.  Read once,
        after :meth:`wait`."""
        manifests = {}
        for worker in self._savers:
            if (path := _manifest(self.directory, worker)).exists():
                models = json.loads(path.read_text(encoding="utf-8"))["models"]
                manifests[worker] = {(m["base"], m["identity"]): m for m in models}
        return manifests

    @functools.cached_property
    def _held(self) -> dict[str, dict[Key, int]]:
        """Per worker, the models it saved: their observation count from its manifest, else
        (a crashed worker) the order it first saw them in."""
        held: dict[str, dict[Key, int]] = {}
        for worker in self._savers:
            if worker in self._manifests:
                held[worker] = {key: len(m["tally"]["calls"]) for key, m in self._manifests[worker].items()}
            else:
                keys = [json.loads(path.read_text(encoding="utf-8"))
                        for path in (self.directory / worker).glob("*/key.json")]
                held[worker] = {(k["base"], k["identity"]): k["order"] for k in keys}
        return held

    @functools.cached_property
    def _savers(self) -> list[str]:
        """The workers that saved models, in order of their names."""
        return sorted(path.name for path in self.directory.iterdir() if path.is_dir())

    def _tally(self, worker: str, key: Key) -> dict[str, Any] | None:
        """The tally of a model in ``worker``'s manifest (``None``: it crashed before writing one)."""
        return self._manifests.get(worker, {}).get(key, {}).get("tally")

    @functools.cached_property
    def _names(self) -> dict[Key, str]:
        """Every pooled model's name, as one process observing every call would give it."""
        from ..observe.pool import pooled_names

        return pooled_names(key for keys in self._held.values() for key in keys)

    def _claim(self, key: Key, name: str) -> bool:
        """Create the model's claim file, naming this worker and the model; ``False`` if it exists."""
        try:
            descriptor = os.open(self.directory / f"claim-{_digest(key)}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            file.write(f"{self.worker} {name}")
        return True

    def _folder(self, worker: str, key: Key) -> Path:
        return self.directory / worker / _digest(key)

    def _joined(self) -> list[str]:
        return sorted(path.name.removeprefix("ready-") for path in self.directory.glob("ready-*"))


def _manifest(directory: Path, worker: str) -> Path:
    return directory / f"{worker}.json"


def _digest(key: Key) -> str:
    return hashlib.sha1(repr(key).encode()).hexdigest()[:16]
