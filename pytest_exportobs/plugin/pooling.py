"""Under xdist, the observations of one model made on several workers meet in one process.

Tests spread over the workers as ``--dist load`` spreads them, so a model that tests call
through ``watch()`` or ``--export-observe`` is observed on several.  The controller creates a
directory the models are pooled in; after every test that observed, each worker saves what it
recorded (once per model its module and options, then the new calls), so that a worker that
crashes loses only the calls of the test it crashed in:

* a worker that sees the directory (one machine) writes there itself (:class:`Pool`);
* a worker that does not (another host: ``--tx ssh=...``, ``--tx socket=...``) sends the same
  saves through xdist's channel, and the controller writes them there (:mod:`.relay`).

At the end of the session every worker's manifest (its models and their call counts) is in the
directory, or the worker went down, which the controller marks.  Then each worker that sees the
directory names the models as one process observing every call would, and claims models one by
one, most observed first: those it holds an instance of, then those no such worker holds (a
crashed or a remote worker's, rebuilt from the module it saved), then those another worker holds
and has not claimed yet, from the end of that worker's turn (rebuilt too): a worker whose tests
observed less does not wait idle for one whose tests observed more.  A claim is a file created
exclusively, so each model is checked once while the checks spread over the workers; the
claiming worker absorbs what the others observed of the model before checking it.  What no
worker claimed (every worker remote) the controller claims and checks itself.

Saves are plain data (dicts of str, int and bytes: what xdist's channel carries); a module and
its calls are torch's serialized format inside them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import secrets
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ..core.files import json_text, write_atomic
from ..core.text import error_line

POOL_KEY = "exportobs_pool"  # workerinput: the directory the workers pool their observations in
TOKEN_KEY = "exportobs_pool_token"  # workerinput: the token file's text, which tells a worker it sees it
WAIT_SECONDS = 600.0  # the longest a worker waits for the others' manifests (they follow the last test)
_POLL_SECONDS = 0.05
Key = tuple[str, str]  # (base name, identity), as observe.transfer keys a model
Save = dict[str, Any]  # one model's new calls (and on its first save, what rebuilds it)


def open_pool(directory: Path) -> str:
    """On the controller: make the pool directory; the token a worker reads there to know it
    sees it."""
    directory.mkdir()
    token = secrets.token_hex(8)
    (directory / "token").write_text(token, encoding="utf-8")
    return token


def admit(directory: Path, worker: str) -> None:
    """On the controller, as it starts ``worker``: the others wait for its manifest."""
    (directory / f"ready-{worker}").touch()


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


def write_saves(directory: Path, worker: str, saves: Iterable[Save]) -> None:
    """Write ``worker``'s saves (on the controller: a remote worker's, as it would have)."""
    for save in saves:
        _write(directory, worker, save)


class Saves:
    """One worker's saves: what its store recorded since the last save."""

    def __init__(self, worker: str):
        self.worker = worker
        self.notes: list[str] = []
        self._saved: dict[Key, int] = {}  # model -> the number of its calls saved so far

    def since_last(self, store: Any) -> list[Save]:
        """Per model with something new: the module and options the first time, the new calls."""
        from ..observe.transfer import calls_bytes, record_bytes

        saves = []
        for name, key in store.keys().items():
            group, save = store.groups[name], {"key": list(key), "first": self._saved.get(key, 0)}
            if key not in self._saved:
                try:
                    save["record"] = record_bytes(group, key[0])
                except Exception as e:  # a module pickle cannot take (a class defined in a function)
                    self.notes.append(f"exportobs: {name} could not be saved for the other workers "
                                      f"({error_line(e)}): a crash of {self.worker} would lose it")
                    save["record"] = None
                save["order"] = len(self._saved)
                self._saved[key] = 0
            calls = group.recorder.observations[self._saved[key]:]
            if calls:
                save["calls"] = calls_bytes(calls, group.sources)
                self._saved[key] += len(calls)
            if save.keys() - {"key", "first"}:  # a record or calls
                saves.append(save)
        return saves

    @staticmethod
    def manifest(store: Any) -> dict[str, Any]:
        """Per model its :func:`~..observe.transfer.tally` (``store`` ``None``: nothing observed)."""
        if store is None:
            return {"models": []}
        from ..observe.transfer import tally

        return {"models": [{"base": base, "identity": ident, "tally": tally(store.groups[name].recorder)}
                           for name, (base, ident) in sorted(store.keys().items())]}


class Pool:
    """A process's side of the pool in ``directory``: a worker's (or the controller's, which
    claims what no worker did)."""

    def __init__(self, directory: Path, worker: str):
        self.directory = directory
        self.worker = worker
        self.saves = Saves(worker)

    @classmethod
    def of(cls, config: pytest.Config) -> Pool | None:
        """The pool of an xdist worker that sees the controller's directory."""
        workerinput = getattr(config, "workerinput", None)
        if workerinput is None or not sees(workerinput):
            return None
        return cls(Path(workerinput[POOL_KEY]), workerinput["workerid"])

    @property
    def notes(self) -> list[str]:
        return self.saves.notes

    def save(self, store: Any) -> None:
        """Save what ``store`` recorded since the last call."""
        write_saves(self.directory, self.worker, self.saves.since_last(store))

    def offer(self, store: Any) -> None:
        """Save what is left of ``store`` (``None``: nothing observed), then the manifest."""
        if store is not None:
            self.save(store)
        write_manifest(self.directory, self.worker, Saves.manifest(store))

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
        node id): its own groups, then those no live worker that checks holds (those crashed
        or remote workers held), then those the others hold and have not claimed yet, from the
        end of their turn (one worker's tests may have observed far more than another's).
        Each is checked on the instance one process would have kept, the one the earliest test
        observed: this worker's, or the module the worker that ran that test saved (whichever
        worker claims it, the same ONNX for the same suite: a model whose configuration's output
        flags another test changed gives other outputs)."""
        from ..observe.transfer import absorb, rebuilt

        def first_test(sources: Iterable[str]) -> int:
            return min(map(position, sources), default=0)

        held, names = self._held, self._names
        local = {} if store is None else store.keys()
        for name, key in local.items():
            store.rename(name, names[key])
        live = {key for worker in held if self._checks(worker) for key in held[worker]}
        turn = {key: (-sum(keys.get(key, 0) for keys in held.values()), names[key]) for key in names}
        own = sorted(local.values(), key=turn.__getitem__)
        orphans = sorted(set(names) - live, key=names.__getitem__)
        # the other workers' models they have not claimed yet, from the end of their turn (they
        # go on from its start): this worker has checked its own and would wait for theirs
        others = sorted((k for k in live - set(local.values()) if self._records_of(k)), key=turn.__getitem__,
                        reverse=True)
        for key in own + orphans + others:
            if not self._claim(key, names[key]):
                continue
            saved = {w: self._saved_calls(w, key) for w in sorted(held) if key in held[w] and w != self.worker}
            # the instance one process would have kept: the one the earliest test observed
            records = sorted((first_test(saved[w].sources), path) for w, path in self._records_of(key).items()
                             if w in saved)
            group = store.groups[names[key]] if key in local.values() else None
            if group is None or (records and records[0][0] < first_test(group.sources)):
                if not records:
                    continue  # the module could not be saved: the controller reports the model lost
                if group is not None:  # this worker's instance came later: its calls are another's, as it saved them
                    saved[self.worker] = self._saved_calls(self.worker, key)
                group = rebuilt(records[0][1])
                group.name = names[key]
            absorb(group, saved.values(), position)
            yield group

    def renames(self, workers: Iterable[str] | None = None) -> dict[str, dict[str, str]]:
        """Per worker that named none of its models as the pool does (``workers``, by default
        those that wrote no manifest: crashed), the names its tests recorded -> the pooled names
        (as its own store would have named the models it saw, in order)."""
        from ..observe.transfer import pooled_names

        names = self._names
        renames = {}
        for worker in [w for w in self._savers if not offered(self.directory, w)] if workers is None else workers:
            seen = self._seen(worker)
            local = pooled_names(seen)
            renames[worker] = {local[key]: names[key] for key in seen}
            first: dict[str, Key] = {}
            for key in sorted(seen, key=seen.__getitem__):  # the first identity seen took the base name
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
                held[worker] = self._seen(worker)
        return held

    def _seen(self, worker: str) -> dict[Key, int]:
        """The models ``worker`` saved, each with the order it first saw it in."""
        keys = [json.loads(path.read_text(encoding="utf-8")) for path in (self.directory / worker).glob("*/key.json")]
        return {(k["base"], k["identity"]): k["order"] for k in keys}

    @functools.cached_property
    def _savers(self) -> list[str]:
        """The workers that saved models, in order of their names."""
        return sorted(path.name for path in self.directory.iterdir() if path.is_dir())

    def _records_of(self, key: Key) -> dict[str, Path]:
        """Per worker that saved the module of model ``key`` (not a class pickle cannot take), its file."""
        paths = {w: self._folder(w, key) / "group.pt" for w in sorted(self._held) if key in self._held[w]}
        return {w: path for w, path in paths.items() if path.exists()}

    def _saved_calls(self, worker: str, key: Key) -> Any:
        """The calls of a model ``worker`` saved (without their outputs), brought up to date by
        its manifest (see :func:`~..observe.transfer.load_calls`)."""
        from ..observe.transfer import load_calls

        return load_calls(sorted(self._folder(worker, key).glob("calls-*.pt")), self._tally(worker, key))

    def _tally(self, worker: str, key: Key) -> dict[str, Any] | None:
        """The tally of a model in ``worker``'s manifest (``None``: it crashed before writing one)."""
        return self._manifests.get(worker, {}).get(key, {}).get("tally")

    @functools.cached_property
    def _names(self) -> dict[Key, str]:
        """Every pooled model's name, as one process observing every call would give it."""
        from ..observe.transfer import pooled_names

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

    def _checks(self, worker: str) -> bool:
        """Whether ``worker`` checks models: it reached its manifest and sees the directory."""
        return offered(self.directory, worker) and not (self.directory / f"relayed-{worker}").exists()

    def _folder(self, worker: str, key: Key) -> Path:
        return _folder(self.directory, worker, key)

    def _joined(self) -> list[str]:
        return sorted(path.name.removeprefix("ready-") for path in self.directory.glob("ready-*"))


def sees(workerinput: dict[str, Any]) -> bool:
    """Whether this worker sees the directory the controller named (its token file is there)."""
    try:
        return Path(workerinput[POOL_KEY], "token").read_text(encoding="utf-8") == workerinput[TOKEN_KEY]
    except (KeyError, OSError):
        return False


def write_manifest(directory: Path, worker: str, manifest: dict[str, Any]) -> None:
    """Write ``worker``'s manifest (read as the sign that all its saves are there)."""
    write_atomic(_manifest(directory, worker), json_text(manifest))


def _write(directory: Path, worker: str, save: Save) -> None:
    """Write one save in ``worker``'s part of the pool: on a model's first, its record and key."""
    key = (save["key"][0], save["key"][1])
    folder = _folder(directory, worker, key)
    if "order" in save:
        folder.mkdir(parents=True, exist_ok=True)
        if save["record"] is not None:
            (folder / "group.pt").write_bytes(save["record"])
        write_atomic(folder / "key.json", json_text({"base": key[0], "identity": key[1], "order": save["order"]}))
    if "calls" in save:
        (folder / f"calls-{save['first']:04d}.pt").write_bytes(save["calls"])


def _folder(directory: Path, worker: str, key: Key) -> Path:
    return directory / worker / _digest(key)


def _manifest(directory: Path, worker: str) -> Path:
    return directory / f"{worker}.json"


def _digest(key: Key) -> str:
    return hashlib.sha1(repr(key).encode()).hexdigest()[:16]
