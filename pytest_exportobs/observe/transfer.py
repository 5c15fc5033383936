"""The observations of one model made in several processes (xdist workers), pooled.

Each process saves, test by test, what it observed of its groups: once per group a
:class:`GroupRecord` (the module and its options, to rebuild the group where no other process
holds an instance, :func:`record_bytes`), then its new calls (:func:`calls_bytes`).  The process that checks a model
absorbs what the others observed of it (:func:`absorb`).  A model is keyed by ``(base name,
identity)`` (see :mod:`.store`); its name in the pool is the one a single process observing every
call would give it (:func:`pooled_names`).
"""

from __future__ import annotations

import io
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ..compat.transformers_hooks import without_output_capturing_hooks
from .kept import KeptModule
from .options import ObserveOptions
from .recorder import CallRecorder, Observation, signature_of
from .store import MAX_OBSERVATIONS, MAX_ORDINARY, ModelGroup

Key = tuple[str, str]  # (base name, identity)
FOREIGN_INSTANCE = 0  # the instance of a call recorded in another process: never a kept module's id


@dataclass
class SavedCalls:
    """Calls a process observed of one model (inputs and eager outputs), and its tests; with the
    process's :func:`tally`, also how many calls it stored nothing for (``dropped``) and could
    not record (``failed``, for ``errors``)."""

    observations: list[Observation]
    sources: list[str]
    dropped: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)


@dataclass
class GroupRecord:
    """What rebuilds a group in another process: the module (pickled by reference to its class),
    how it was observed, and its parameters' shapes and weights when first observed (a resize
    after the first calls replaces them: see :mod:`..engine.verify.resized`)."""

    base: str
    identity: str
    explicit: bool
    options: ObserveOptions
    module: torch.nn.Module
    parameters: list[tuple[str, tuple[int, ...], str]]
    weights: dict[str, torch.Tensor]


def record_bytes(group: ModelGroup, base: str) -> bytes:
    """What rebuilds ``group``, serialized (raises when its module cannot be pickled);
    transformers' output-capturing hooks are left out (the rebuilt model installs them again)."""
    with without_output_capturing_hooks(group.module):
        return _serialized(GroupRecord(base, group.identity, group.explicit, group.options, group.module,
                                       group.parameters, group.weights))


def rebuilt(path: Path) -> ModelGroup:
    """A group of no call, on the module a crashed process saved (its calls are absorbed next)."""
    record: GroupRecord = torch.load(path, weights_only=False)
    recorder = CallRecorder(record.options.value_if_missing, capacity=MAX_OBSERVATIONS)
    recorder.signature = signature_of(getattr(record.module, record.options.method))
    return ModelGroup(record.base, record.identity, KeptModule(record.module, record.weights), record.options,
                      record.explicit, recorder, parameters=record.parameters)


def calls_bytes(observations: list[Observation], sources: list[str]) -> bytes:
    """``observations`` and their tests, serialized without their outputs: a call recorded in
    another process is no reference (see :func:`absorb`)."""
    return _serialized(SavedCalls([replace(observation, outputs=None) for observation in observations], sources))


def _serialized(value: Any) -> bytes:
    """``value`` in torch's format (tensors as raw storage), as bytes a file or xdist's channel takes."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def tally(recorder: CallRecorder) -> dict[str, Any]:
    """What a process's saved calls of a model miss once its tests are over (plain JSON): how many
    calls each stored observation stands for by then, the calls it stored nothing for, and those
    it could not record."""
    return {"calls": [observation.calls for observation in recorder.observations],
            "dropped": recorder.counts.dropped, "failed": recorder.counts.failed, "errors": recorder.errors}


def load_calls(paths: Iterable[Path], tallied: dict[str, Any] | None = None) -> SavedCalls:
    """The calls saved in ``paths``, in order (their inputs hold cache objects: a full unpickling),
    brought up to date by the process's :func:`tally` when it wrote one (a crashed process did
    not: its counts stop at its last save)."""
    calls = SavedCalls([], [])
    for path in paths:
        saved: SavedCalls = torch.load(path, weights_only=False)
        calls.observations += saved.observations
        calls.sources += [source for source in saved.sources if source not in calls.sources]
    if tallied is not None:
        for observation, count in zip(calls.observations, tallied["calls"]):
            observation.calls = count
        calls.dropped, calls.failed, calls.errors = tallied["dropped"], tallied["failed"], tallied["errors"]
    return calls


def absorb(group: ModelGroup, others: Iterable[SavedCalls], position: Callable[[str], int]) -> None:
    """Store the calls of ``group`` and those other processes saw of its model as one process
    running the tests in collection order (``position`` of a test's node id) would have: test by
    test, each a block of ``store_n_calls`` under the session bound; every call any of them saw is
    counted.  Calls of other processes are no reference (their outputs came from another
    instance)."""
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
    own = group.recorder
    recorder.counts.dropped += own.counts.dropped + sum(saved.dropped for saved in others)
    recorder.counts.failed = own.counts.failed + sum(saved.failed for saved in others)
    recorder.errors = list(dict.fromkeys([*own.errors, *(error for saved in others for error in saved.errors)]))
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
