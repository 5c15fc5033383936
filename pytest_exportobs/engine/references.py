"""The eager outputs an export is judged against, and whether eager reproduces them.

A recorded output is the reference when the call ran on the exported instance, in eval mode,
with today's weights.  Otherwise it is recomputed now: a call observed in training mode
(dropout) is judged in eval mode, and one made on another instance or before the weights
changed is judged on the weights exported.  Before a mismatch is blamed on the export, the
engine asks :func:`reproduction` whether eager itself gives the reference again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.trees import detached_clone, flat_outputs
from ..observe.recorder import Observation
from ..observe.store import ModelGroup
from .verify import Tolerance, compare

Outputs = list[torch.Tensor | None]


@dataclass
class References:
    """One reference per recorded call, and where they come from (``recorded``, or what was
    recomputed and why)."""

    outputs: list[Outputs]
    origin: str


class ReferenceFailed(Exception):
    """The exported instance cannot run a call recorded on another instance or before a change."""


def references(group: ModelGroup, observations: list[Observation]) -> References:
    """Recorded outputs where they are valid references, eager recomputed elsewhere (raises
    :class:`ReferenceFailed` when the exported instance cannot run such a call)."""
    outputs, recomputed, training = [], 0, 0
    for index, obs in enumerate(observations):
        if group.is_reference_valid(obs.instance, obs.weights_version) and not obs.training:
            outputs.append(obs.outputs)
            continue
        try:
            outputs.append(eager(group, obs))
        except Exception as e:  # the model's own code, on a call made on another instance
            raise ReferenceFailed(
                f"call {index} from {obs.source or 'a recorded call'} was made on another instance or before "
                f"the model changed, and the exported instance cannot run it: {type(e).__name__}: {e}") from e
        recomputed += 1
        training += obs.training
    if not recomputed:
        return References(outputs, "recorded")
    why = f", {training} observed in training mode (eval used)" if training else ""
    return References(outputs, f"recomputed on the exported instance for {recomputed} of {len(outputs)} calls{why}")


def eager(group: ModelGroup, observation: Observation) -> Outputs:
    """The exported instance's outputs on a recorded call, now."""
    args, kwargs = detached_clone((observation.args, observation.kwargs))
    return flat_outputs(getattr(group.module, group.options.method)(*args, **kwargs))


def reproduction(group: ModelGroup, observation: Observation, reference: Outputs, tolerance: Tolerance) -> str:
    """Whether eager gives ``reference`` again on the call: ``""`` when it does, ``nondeterministic``
    when two eager runs differ, ``stale`` when eager is steady but gives another output (weights
    or state changed after the call, through ``p.data`` or a buffer)."""
    first, second = eager(group, observation), eager(group, observation)
    if not compare(first, second, tolerance).ok:
        return "nondeterministic"
    return "" if compare(first, reference, tolerance).ok else "stale"


def refreshed(group: ModelGroup, observations: list[Observation]) -> References:
    """Every reference recomputed on the exported instance."""
    return References(
        [eager(group, obs) for obs in observations],
        "recomputed on the exported instance for every call: eager no longer gave the recorded outputs "
        "(weights or state changed after the calls)",
    )
