"""Group the observations of one model across the tests of a session.

A group is named by the marker's ``name=``, else the fixture name, else (``watch()`` without a
name) the model class's qualified name.  When one default name would cover models of different
classes or parameter shapes, the groups are split and suffixed ``[ClassName-<digest>]``; an
explicit name covering such models is an error.  The first instance observed is kept: it is the
one exported, and observations made on it with unchanged weights keep their recorded outputs as
the reference, while the session's allowance for outputs lasts (a check recomputes the others).
Once the tests no longer reach a kept instance, it is packed away (see :mod:`.kept`).
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..core.configuration import computation, contract
from ..core.trees import on_meta_device
from .kept import KeptModule
from .options import ObserveOptions
from .recorder import CallRecorder, OutputAllowance
from .weights import parameter_shapes

# Memory bound: distinct call signatures kept per model over a session.  The first
# ``store_n_calls`` of each test are kept up to MAX_ORDINARY; the rest is room for the calls that
# add information (a new input structure, an axis varied for the first time...).
MAX_OBSERVATIONS = 32
MAX_ORDINARY = 24
# Memory bound: bytes of eager outputs kept over a session (a process), every model's together.
MAX_KEPT_OUTPUTS = 32 * 2**20

# references to a kept module when only its group holds it: the group's own and getrefcount's argument
_HELD_HERE = 2


@dataclass
class ModelGroup:
    """All observations of one model in the session and the instance to export."""

    name: str
    identity: str
    # the instance to export, with its parameters and buffers as first observed (what the calls
    # made before a resize, resize_token_embeddings replacing the embeddings, are checked with)
    kept: KeptModule
    options: ObserveOptions
    explicit: bool
    recorder: CallRecorder = field(default_factory=CallRecorder)
    sources: list[str] = field(default_factory=list)
    parameters: list[tuple[str, tuple[int, ...], str]] = field(default_factory=list)  # when first observed

    @property
    def module(self) -> torch.nn.Module:
        return self.kept.module

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        return self.kept.weights

    @property
    def model_class(self) -> str:
        return f"{self.kept.cls.__module__}.{self.kept.cls.__qualname__}"

    def on_kept(self, instance: int) -> bool:
        """Whether a call recorded on ``instance`` (``Observation.instance``) was made on the kept module."""
        return instance == self.kept.instance

    def is_reference_valid(self, instance: int, digest: int) -> bool:
        """Recorded outputs are the reference iff made on the kept instance with today's weights
        (the digest of its weights at the call, see :func:`~.weights.weights_digest`)."""
        return self.on_kept(instance) and digest == self.kept.digest()

    def pack(self) -> None:
        """Pack the kept module away (see :meth:`.kept.KeptModule.pack`); its recorded calls keep
        saying they were made on it."""
        made_here = [o for o in self.recorder.observations if self.on_kept(o.instance)]
        if self.kept.pack():
            for observation in made_here:
                observation.instance = self.kept.instance


def identity(module: torch.nn.Module) -> str:
    """``ClassName-<6 hex digits>`` of the class, the parameter shapes and dtypes, what its
    submodules compute with besides them (attention heads, normalization groups: a UNet of another
    configuration with the same parameter layout is another model), the configuration entries
    that decide which calls it accepts (a transformers model of another ``problem_type`` is
    another model), and the meta device for a model on it (a model without values is never the
    instance a model with values is checked on)."""
    key = (type(module).__qualname__, parameter_shapes(module), computation(module),
           *filter(None, [contract(module)]), *(["meta"] if on_meta_device(module) else []))
    return f"{type(module).__name__}-{hashlib.sha1(repr(key).encode()).hexdigest()[:6]}"


def held_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's parameters and buffers by name (tied ones under each of their names), held by
    reference to their storage (``.data``): ``resize_token_embeddings`` assigns the embedding
    parameter a new ``.data``, and these keep the first one alive, without a copy."""
    named = (*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False))
    return {name: tensor.data for name, tensor in named}


class SessionStore:
    """The groups of a session, by final name."""

    def __init__(self) -> None:
        self.groups: dict[str, ModelGroup] = {}
        self.renamed: dict[str, str] = {}  # a name tests recorded -> the group's name since a split
        self._by_base: dict[str, dict[str, str]] = {}  # base name -> identity -> group name
        self._identities: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
        self._observed: dict[int, ModelGroup] = {}  # groups observed since gradients were last released
        self.allowance = OutputAllowance(MAX_KEPT_OUTPUTS)

    def group_for(
        self, module: torch.nn.Module, default_name: str, options: ObserveOptions
    ) -> ModelGroup:
        """The group ``module`` belongs to, created (or split) as needed."""
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"{default_name!r} is a {type(module).__name__}, not a torch.nn.Module: nothing to observe")
        explicit = options.name is not None
        base = options.name or default_name
        ident = self._identities.get(module) or self._identities.setdefault(module, identity(module))
        members = self._by_base.setdefault(base, {})
        if ident in members:
            return self.groups[members[ident]]
        if members and (explicit or any(self.groups[g].explicit for g in members.values())):
            other = next(iter(members))
            raise ValueError(
                f"name {base!r} already covers a {other} model; this one is {ident}: "
                f"give each model its own name="
            )
        if len(members) == 1:
            self._rename(base, next(iter(members)), f"{base}[{next(iter(members))}]")
        name = f"{base}[{ident}]" if members else base
        members[ident] = name
        self.groups[name] = ModelGroup(name, ident, KeptModule(module, held_weights(module)), options, explicit,
                                       CallRecorder(options.value_if_missing, MAX_OBSERVATIONS, self.allowance),
                                       parameters=parameter_shapes(module))
        return self.groups[name]

    def keys(self) -> dict[str, tuple[str, str]]:
        """``{group name: (base name, identity)}``: what identifies a group across processes."""
        return {name: (base, ident) for base, members in self._by_base.items() for ident, name in members.items()}

    def rename(self, name: str, new_name: str) -> None:
        """Give group ``name`` the name a wider view (the pooled workers) gives it."""
        if new_name != name:
            self._rename(*self.keys()[name], new_name)

    def _rename(self, base: str, ident: str, new_name: str) -> None:
        group = self.groups.pop(self._by_base[base][ident])
        self.renamed[group.name] = new_name
        group.name = new_name
        self.groups[new_name] = group
        self._by_base[base][ident] = new_name

    @contextlib.contextmanager
    def observe(self, module: torch.nn.Module, default_name: str, options: ObserveOptions,
                source: str) -> Iterator[ModelGroup]:
        """Record the calls of ``module`` into its group while the block runs."""
        group = self.group_for(module, default_name, options)
        self._observed[id(group)] = group
        if source not in group.sources:
            group.sources.append(source)
        room = max(0, MAX_ORDINARY - group.recorder.num_obs())
        with group.recorder.recording(module, min(options.store_n_calls, room), options.method, source):
            yield group

    def put_away(self) -> None:
        """After a test: the kept modules observed since the last call that nothing but this
        store reaches any more lose their gradients and are packed.  A check never reads the
        gradients; kept, a training test's would double what its model holds until the session
        ends, where the suite alone frees both after the test."""
        released = [g for g in self._observed.values() if g.kept.packed or sys.getrefcount(g.module) <= _HELD_HERE]
        for group in released:
            del self._observed[id(group)]
            if not group.kept.packed:
                _drop_gradients(group.module)
                group.pack()

    def release_gradients(self) -> None:
        """Drop the gradients of every kept module not packed: the tests are over."""
        self._observed = {}
        for group in self.groups.values():
            if not group.kept.packed:
                _drop_gradients(group.module)


def _drop_gradients(module: torch.nn.Module) -> None:
    for parameter in module.parameters():
        parameter.grad = None
