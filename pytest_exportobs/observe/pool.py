"""The observations of one model made in several processes (xdist workers), pooled.

Each process saves what it observed of its groups (:func:`save`); the process that checks a
model absorbs what the others observed of it (:func:`absorb`) into its own group, whose instance
is the one exported.  A model is keyed by ``(base name, identity)`` (see :mod:`.store`); its name
in the pool is the one a single process observing every call would give it (:func:`pooled_names`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from .recorder import Observation
from .store import MAX_ORDINARY, ModelGroup, SessionStore

Key = tuple[str, str]  # (base name, identity)
FOREIGN_INSTANCE = 0  # the instance of a call recorded in another process: never a kept module's id


@dataclass
class SavedGroup:
    """What a process observed of one model: its calls (inputs and eager outputs) and tests."""

    observations: list[Observation]
    sources: list[str]


def save(store: SessionStore, path: Path) -> None:
    """Write the observations of every group of ``store``, by key, to ``path`` (read once the
    process says it is done: no partial file is ever read)."""
    torch.save({key: SavedGroup(store.groups[name].recorder.observations, store.groups[name].sources)
                for name, key in store.keys().items()}, path)


def load(path: Path) -> dict[Key, SavedGroup]:
    """The groups :func:`save` wrote (their inputs hold cache objects: a full unpickling)."""
    return torch.load(path, weights_only=False)


def absorb(group: ModelGroup, others: Iterable[SavedGroup], position: Callable[[str], int]) -> None:
    """Store the calls of ``group`` and those other processes saw of its model as one process
    running the tests in collection order (``position`` of a test's node id) would have: test by
    test, each a block of ``store_n_calls`` under the session bound.  Calls of other processes
    are no reference (their outputs came from another instance)."""
    others = list(others)
    for saved in others:
        for observation in saved.observations:
            observation.instance = FOREIGN_INSTANCE
    calls = sorted([*group.recorder.observations, *(o for saved in others for o in saved.observations)],
                   key=lambda observation: position(observation.source))
    recorder = group.recorder.emptied()
    for _, block in itertools.groupby(calls, key=lambda observation: observation.source):
        room = max(0, MAX_ORDINARY - recorder.num_obs())
        limit = recorder.num_obs() + min(group.options.store_n_calls, room)
        for observation in block:
            recorder.admit(observation, limit)
    recorder.errors, recorder.counts.failed = group.recorder.errors, group.recorder.counts.failed
    group.recorder = recorder
    sources = {*group.sources, *(source for saved in others for source in saved.sources)}
    group.sources = sorted(sources, key=position)


def pooled_names(keys: Iterable[Key]) -> dict[Key, str]:
    """The name of each model: its base name, suffixed ``[identity]`` when models of several
    identities share the base name (as :class:`~.store.SessionStore` splits them)."""
    keys = sorted(set(keys))
    identities: dict[str, int] = {}
    for base, _ in keys:
        identities[base] = identities.get(base, 0) + 1
    return {(base, ident): base if identities[base] == 1 else f"{base}[{ident}]" for base, ident in keys}
