"""The observations of one model made in several processes (xdist workers), pooled.

Each process saves what it observed of its groups (:func:`save`); the process that checks a
model absorbs what the others observed of it (:func:`absorb`) into its own group, whose instance
is the one exported.  A model is keyed by ``(base name, identity)`` (see :mod:`.store`); its name
in the pool is the one a single process observing every call would give it (:func:`pooled_names`).
"""

from __future__ import annotations

from collections.abc import Iterable
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


def absorb(group: ModelGroup, saved: SavedGroup) -> None:
    """Add another process's calls of ``group``'s model as a further test of this process would
    have added them; their recorded outputs are no reference (made on another instance)."""
    for observation in saved.observations:
        observation.instance = FOREIGN_INSTANCE
        group.recorder.absorb(observation, ordinary=MAX_ORDINARY)
    group.sources.extend(source for source in saved.sources if source not in group.sources)


def pooled_names(keys: Iterable[Key]) -> dict[Key, str]:
    """The name of each model: its base name, suffixed ``[identity]`` when models of several
    identities share the base name (as :class:`~.store.SessionStore` splits them)."""
    keys = sorted(set(keys))
    identities: dict[str, int] = {}
    for base, _ in keys:
        identities[base] = identities.get(base, 0) + 1
    return {(base, ident): base if identities[base] == 1 else f"{base}[{ident}]" for base, ident in keys}
