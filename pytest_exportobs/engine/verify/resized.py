"""A model resized after some of its calls: each call checked on the weights it was made with.

transformers' tests call a model, ``resize_token_embeddings`` it (new embedding and head
modules), and call it again.  The calls before the resize ran on weights the instance no longer
holds; the group keeps their storage by reference from its first observation (no copy: the
storage a resize replaces is the only memory kept alive).  The calls are split by the parameter shapes
they were made with: those of the first observation run on a copy of the instance holding the
first weights again, those of today's shapes on the instance itself; calls of any other shapes
(a second resize) are left out with a note.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any

import torch

from ...observe.kept import KeptModule
from ...observe.recorder import CallRecorder, Observation
from ...observe.store import ModelGroup
from ...observe.weights import layout_digest, parameter_shapes

BEFORE, AFTER = "before the resize", "after the resize"


@dataclass
class Side:
    """The calls made with one set of weights, as a group of their own, and their indices among
    the group's calls."""

    label: str
    group: ModelGroup
    calls: list[int]


def sides(group: ModelGroup) -> tuple[list[Side], list[str]]:
    """The sides of a group whose parameters changed shape after its first call (one side, the
    group itself, when they did not), and notes on the calls no side takes."""
    now = parameter_shapes(group.module)
    if not group.parameters or now == group.parameters:
        return [Side("", group, list(range(group.recorder.num_obs())))], []
    first, current = layout_digest(group.parameters), layout_digest(now)
    observations = group.recorder.observations
    before = [i for i, o in enumerate(observations) if o.layout == first]
    after = [i for i, o in enumerate(observations) if o.layout == current]
    found, notes = [], []
    module = as_first_observed(group) if before else None
    if module is not None:
        first_kept = KeptModule(module, group.weights)
        found.append(Side(BEFORE, _subgroup(group, first_kept, [observations[i] for i in before]), before))
    elif before:
        notes.append(f"calls {before} left out: made before the parameters changed shape (resize_token_embeddings?), "
                     "with weights no longer at hand")
    if after:
        found.append(Side(AFTER, _subgroup(group, group.kept, [observations[i] for i in after]), after))
    others = sorted(set(range(len(observations))) - set(before) - set(after))
    if others:
        notes.append(f"calls {others} left out: made with parameters of other shapes than the first and the last")
    return found, notes


def as_first_observed(group: ModelGroup) -> torch.nn.Module | None:
    """A copy of the group's module holding the parameters and buffers it had when first
    observed (``None`` when one of them is missing: a module it was in is gone)."""
    module = copy.deepcopy(group.module)
    parameters: dict[tuple[Any, ...], torch.nn.Parameter] = {}  # by storage: tied weights stay one parameter
    for name, tensor in group.weights.items():
        owner, _, leaf = name.rpartition(".")
        try:
            holder = module.get_submodule(owner)
        except AttributeError:
            return None
        if leaf in holder._parameters:
            key = (tensor.data_ptr(), tuple(tensor.shape), tensor.stride())
            holder._parameters[leaf] = parameters.setdefault(key, torch.nn.Parameter(tensor, requires_grad=False))
        else:
            holder._buffers[leaf] = tensor
    return module if parameter_shapes(module) == group.parameters else None


def _subgroup(group: ModelGroup, kept: KeptModule, observations: list[Observation]) -> ModelGroup:
    recorder: CallRecorder = group.recorder.emptied()
    for observation in observations:
        recorder.admit(observation, len(observations))
    return replace(group, kept=kept, recorder=recorder)
