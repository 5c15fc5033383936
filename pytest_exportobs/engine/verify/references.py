"""The eager outputs an export is judged against, and whether eager reproduces them.

Every eager run here is the model as the tests ran it: no export patch (those are for tracing
only).  A recorded output is the reference when the call ran on the exported instance, in eval
mode, with today's weights (the digest of its weights at the call equals today's).  Otherwise it
is recomputed now: a call observed in training mode (dropout) is judged in eval mode, and one
made on another instance or before the weights changed is judged on the weights exported, as is
one whose outputs the session did not keep (its memory bound, see
:class:`~...observe.recorder.OutputAllowance`).  A
call of another instance of a configured model (transformers, diffusers: one group's instances
share the configuration that decides which calls they accept) that the exported instance rejects
was made for that instance's weights (Gemma-3's ``inputs_embeds`` find the image tokens by their
instance's embedding of them): it is left out, with a note.  Before a mismatch is blamed on the
export, the engine asks :func:`reproduction` whether eager itself gives the reference again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from ...core.configuration import contract
from ...core.trees import detached_clone, flat_outputs, on_meta_device
from ...observe.recorder import Observation
from ...observe.store import ModelGroup
from ..base.eager import attributes_kept
from .compare import Tolerance, compare

Outputs = list[torch.Tensor | None]


@dataclass
class References:
    """One reference per recorded call (none for a call left out), where they come from
    (``recorded``, or what was recomputed and why), and why each call left out is."""

    outputs: list[Outputs]
    origin: str
    left_out: dict[int, str] = field(default_factory=dict)


class ReferenceFailed(Exception):
    """The exported instance cannot run a call recorded on another instance or before a change."""


def references(group: ModelGroup, observations: list[Observation]) -> References:
    """Recorded outputs where they are valid references, eager recomputed elsewhere (raises
    :class:`ReferenceFailed` when the exported instance cannot run such a call, unless it was
    made on another instance of a configured model: then it is left out)."""
    outputs: list[Outputs] = []
    left_out: dict[int, str] = {}
    recomputed = training = unkept = 0
    for index, obs in enumerate(observations):
        if on_meta_device(obs):  # timm's default-config tests call a shared module on the meta device
            left_out[index] = f"call {index} from {obs.source or 'a recorded call'} left out: it ran on the meta " \
                              "device (shapes, no values)"
            outputs.append([])
            continue
        valid = group.is_reference_valid(obs.instance, obs.weights_digest) and not obs.training
        if valid and obs.outputs is not None:
            outputs.append(obs.outputs)
            continue
        source = obs.source or "a recorded call"
        try:
            outputs.append(eager(group, obs))
        except Exception as e:  # the model's own code, on a call made on another instance
            rejection = f"{type(e).__name__}: {e}"
            if not group.on_kept(obs.instance) and contract(group.module):
                left_out[index] = (f"call {index} from {source} left out: made on another instance, whose weights "
                                   f"its inputs were made for, and the exported instance rejects it ({rejection})")
                outputs.append([])
                continue
            when = ("ran in its test, and the exported instance, with the same weights, no longer runs it (a "
                    "config entry or an attribute changed after the call)" if valid else
                    "was made on another instance or before the model changed, and the exported instance cannot "
                    "run it")
            raise ReferenceFailed(f"call {index} from {source} {when}: {rejection}") from e
        recomputed += 1
        training += obs.training
        unkept += valid
    if not recomputed:
        return References(outputs, "recorded", left_out)
    why = f", {training} observed in training mode (eval used)" if training else ""
    why += f", {unkept} whose outputs the session's memory bound did not keep" if unkept else ""
    return References(
        outputs, f"recomputed on the exported instance for {recomputed} of {len(outputs)} calls{why}", left_out)


def eager(group: ModelGroup, observation: Observation) -> Outputs:
    """The exported instance's outputs on a recorded call, now."""
    args, kwargs = detached_clone((observation.args, observation.kwargs))
    with attributes_kept(group.module):
        return flat_outputs(getattr(group.module, group.options.method)(*args, **kwargs))


class Reproduction(Enum):
    """What eager, run again on a recorded call, gives."""

    SAME = "same"  # the reference
    NONDETERMINISTIC = "nondeterministic"  # two eager runs differ
    STALE = "stale"  # steadily another output: the model's state changed after the call


def reproduction(
    group: ModelGroup, observation: Observation, reference: Outputs, tolerance: Tolerance,
) -> Reproduction:
    """Whether eager, as the tests ran it (no export patch), gives ``reference`` again on the call;
    ``STALE`` although the weights are those of the call (their digest, see
    :func:`~..observe.weights.weights_digest`, decides first): a config entry or an attribute
    changed after the call."""
    first, second = eager(group, observation), eager(group, observation)
    if not compare(first, second, tolerance).ok:
        return Reproduction.NONDETERMINISTIC
    return Reproduction.SAME if compare(first, reference, tolerance).ok else Reproduction.STALE


def refreshed(group: ModelGroup, observations: list[Observation]) -> References:
    """Every reference recomputed on the exported instance."""
    return References(
        [eager(group, obs) for obs in observations],
        "recomputed on the exported instance for every call: eager, as the tests ran it, no longer gave the "
        "recorded outputs with the same weights (the model's state changed after the calls: a config entry, an "
        "attribute)",
    )
