"""Record the inputs and eager outputs of a module's method while ordinary code calls it."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree

from ..core.trees import detached_clone, flattening_context
from .alignment import AlignedCalls, align_calls
from .binding import value_text
from .interception import intercepted
from .structures import structure_families
from .weights import layout_digest, parameter_shapes, weights_digest


@dataclass
class Observation:
    """One distinct call signature seen by an :class:`InputObserver`.

    ``args``/``kwargs`` are detached clones taken before the call (models update caches in
    place); ``outputs`` are the flattened eager outputs, ``None`` when they were not kept (see
    :class:`OutputAllowance`).  ``calls`` counts the calls that had the same flattened shape
    signature and therefore stored no extra copy.
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: list[torch.Tensor | None] | None
    calls: int = 1
    source: str = ""
    instance: int = 0
    weights_digest: int = 0  # of the instance's weights at the call (see weights_digest)
    layout: int = 0  # of the instance's parameter shapes at the call: a resize changes it
    training: bool = False  # the module was in training mode (dropout...) during the call


@dataclass
class OutputAllowance:
    """The bytes of eager outputs the recorders sharing it may still keep.  A call's outputs
    beyond it are not kept (``Observation.outputs`` is ``None``): its inputs are, and a check
    recomputes the outputs from them.  Attention maps make outputs the bulk of what a session
    records (a tiny DINOv2's, 10 MB a call), and every forked check inherits them."""

    remaining: int

    def take(self, nbytes: int) -> bool:
        """Whether outputs of ``nbytes`` are kept, taken from the allowance if so."""
        if nbytes > self.remaining:
            return False
        self.remaining -= nbytes
        return True


@dataclass
class CallCounts:
    """How many calls were recorded, merged into an existing signature, or not stored.

    ``failed`` counts the calls that could not be recorded (inputs or outputs pytree cannot
    flatten, ...): the model still ran, the reasons are in ``InputObserver.errors``.
    """

    stored: int = 0
    duplicates: int = 0
    dropped: int = 0
    failed: int = 0


def call_signature(args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, tuple[int, ...]]:
    """``(structure, sizes)``, equal for two calls iff they flatten to the same shapes and
    constants: the structure holds the tree, dtypes, ranks and constants, ``sizes`` every
    tensor dim in leaf order.

    Calls of plain tensors (most calls) skip pytree: this runs on every observed call."""
    if all(type(t) is torch.Tensor for t in args) and all(type(t) is torch.Tensor for t in kwargs.values()):
        tensors = (*args, *kwargs.values())
        structure: tuple[Any, ...] = (len(args), tuple(kwargs), tuple((t.dtype, t.dim()) for t in tensors))
    else:
        leaves, spec = _pytree.tree_flatten((args, kwargs))
        tensors = tuple(t for t in leaves if isinstance(t, torch.Tensor))
        structure = (str(spec), tuple(
            (t.dtype, t.dim()) if isinstance(t, torch.Tensor) else (type(t), value_text(t)) for t in leaves))
    return structure, tuple(d for t in tensors for d in t.shape)


class _SizesSeen:
    """What the stored calls of one input structure tell about its axes: which axes varied, and
    which patterns of equal sizes (sizes 0 and 1 apart: torch.export specializes them) occurred."""

    def __init__(self, sizes: tuple[int, ...]):
        self.first = sizes
        self.varied: set[int] = set()
        self.patterns: set[tuple[int, ...]] = set()
        self.add(sizes)

    def add(self, sizes: tuple[int, ...]) -> None:
        self.varied.update(i for i, (a, b) in enumerate(zip(self.first, sizes)) if a != b)
        self.patterns.add(_equal_sizes(sizes))

    def adds_information(self, sizes: tuple[int, ...]) -> bool:
        """Whether a call of these ``sizes`` varies an axis constant so far, or breaks or makes an
        equality between axes: what dynamic dims and their relations are inferred from."""
        return any(a != b and i not in self.varied for i, (a, b) in enumerate(zip(self.first, sizes))) or (
            _equal_sizes(sizes) not in self.patterns)


def _equal_sizes(sizes: tuple[int, ...]) -> tuple[int, ...]:
    """Per axis, the first axis of the same size (sizes 0 and 1 as such, negated)."""
    first: dict[int, int] = {}
    return tuple(-1 - s if s < 2 else first.setdefault(s, i) for i, s in enumerate(sizes))


def signature_of(method: Callable[..., Any]) -> inspect.Signature:
    """``inspect.signature(method)``, computed once per function for bound methods: a session
    enters an observing block per test and model."""
    if inspect.ismethod(method):
        return _bound_signature(method.__func__)
    return inspect.signature(method)


@functools.lru_cache(maxsize=256)
def _bound_signature(function: Callable[..., Any]) -> inspect.Signature:
    signature = inspect.signature(function)
    parameters = list(signature.parameters.values())
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if parameters and parameters[0].kind in positional:
        parameters = parameters[1:]  # what binding takes (``self``); ``*args`` stays
    return signature.replace(parameters=parameters)


@dataclass(eq=False)
class _Block:
    """An open ``with recorder(...)`` block: the number of observations it may reach, and the
    test its calls come from."""

    limit: int
    source: str


class CallRecorder:
    """Records the inputs and eager outputs of a module's method while ordinary code calls it.

    The module is left intact (see :mod:`.interception`): calls reach the recorder through the
    module's class, whether made as ``module(...)``, ``module.forward(...)`` or another method,
    and not while torch.compile / torch.export trace the module.  ``value_if_missing`` gives, by
    argument name or position, the value to assume for an argument absent from some calls (e.g.
    ``pixel_values`` after the prefill step); it is only used to align calls, never to run the model.

    With a ``capacity``, the calls that add information (a new input structure, an axis varied
    for the first time, a new pattern of equal sizes) are also stored beyond a block's
    ``store_n_calls``, while fewer than ``capacity`` calls are stored.  With an ``allowance``,
    a call's eager outputs are kept while it lasts (see :class:`OutputAllowance`).
    """

    def __init__(self, value_if_missing: dict[str | int, Any] | None = None, capacity: int = 0,
                 allowance: OutputAllowance | None = None):
        self.value_if_missing: dict[str | int, Any] = dict(value_if_missing or {})
        self.capacity = capacity
        self.allowance = allowance
        self.observations: list[Observation] = []
        self.counts = CallCounts()
        self.signature: inspect.Signature | None = None
        self.errors: list[str] = []  # why calls could not be recorded (distinct messages)
        self._by_key: dict[tuple, Observation] = {}
        self._structures: dict[tuple, _SizesSeen] = {}
        self._blocks: list[_Block] = []  # the open blocks, innermost last

    def num_obs(self) -> int:
        """Number of stored (distinct) observations."""
        return len(self.observations)

    def __call__(
        self, model: torch.nn.Module, store_n_calls: int = 3, method_name: str = "forward"
    ) -> contextlib.AbstractContextManager[CallRecorder]:
        """Record the calls of ``model.<method_name>`` made inside the ``with`` block.

        At most ``store_n_calls`` new distinct call signatures are stored per block; blocks may
        nest and overlap (each call is recorded once).  The module is exactly as it was on exit.
        """
        return self.recording(model, store_n_calls, method_name)

    @contextlib.contextmanager
    def recording(
        self, model: torch.nn.Module, store_n_calls: int, method_name: str, source: str = ""
    ) -> Iterator[CallRecorder]:
        """``with recorder(...)``, its calls made by ``source`` (a test): a call is recorded
        with the source of the innermost block open."""
        if not isinstance(store_n_calls, int) or store_n_calls < 0:
            raise ValueError(f"store_n_calls must be a non-negative int, got {store_n_calls!r}")
        method = getattr(model, method_name, None)
        if not callable(method):
            raise ValueError(f"{type(model).__name__} has no method {method_name!r} to observe")
        self._check_signature(signature_of(method))
        block = _Block(len(self.observations) + store_n_calls, source)
        self._blocks.append(block)
        try:
            # Registered once for the block, not per call: flattening caches is on the hot path.
            with flattening_context(), intercepted(model, method_name, self):
                yield self
        finally:
            self._blocks.remove(block)

    def _check_signature(self, signature: inspect.Signature) -> None:
        if self.signature is not None and list(self.signature.parameters) != list(signature.parameters):
            raise ValueError(
                f"this observer already recorded a method with parameters "
                f"{list(self.signature.parameters)}, now asked to observe {list(signature.parameters)}"
            )
        names = list(signature.parameters)
        accepts_var_keyword = any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()
        )
        for key in self.value_if_missing:
            if isinstance(key, int) and not 0 <= key < len(names):
                raise ValueError(
                    f"value_if_missing key {key} is no position of the signature {tuple(names)}"
                )
            if isinstance(key, str) and key not in names and not accepts_var_keyword:
                raise ValueError(
                    f"value_if_missing key {key!r} is not an argument of the signature {tuple(names)}"
                )
            if not isinstance(key, (int, str)):
                raise TypeError(f"value_if_missing keys are names or positions, got {key!r}")
        self.signature = signature

    # Observing never changes what the call does: a call that cannot be recorded (a cache pytree
    # cannot flatten, ...) still runs and is counted as failed.

    def before_call(self, instance: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
        """Listener of the interception: the call's key and a copy of its inputs, taken before the
        call (models update caches in place), when the call is to be stored; else ``None``."""
        try:
            ordered = self._ordered(kwargs)
            key = call_signature(args, ordered)
            if not self._stores(key):
                self._count_unstored(key)
                return None
            return key, detached_clone((args, ordered))
        except Exception as e:
            self._count_failed(e)
            return None

    def after_call(self, instance: torch.nn.Module, token: Any, outputs: Any) -> None:
        """Listener of the interception: store the call with its eager outputs."""
        key, (args, kwargs) = token
        try:
            observation = Observation(
                args=args,
                kwargs=kwargs,
                outputs=self._kept(_pytree.tree_leaves(outputs)),
                source=self._blocks[-1].source if self._blocks else "",
                instance=id(instance),
                weights_digest=weights_digest(instance),
                layout=layout_digest(parameter_shapes(instance)),
                training=instance.training,
            )
        except Exception as e:
            self._count_failed(e)
        else:
            self._store(key, observation)

    def _kept(self, leaves: list[Any]) -> list[torch.Tensor | None] | None:
        """Copies of a call's output tensors (``None`` for other leaves), or ``None`` beyond the
        allowance."""
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        if self.allowance is not None and not self.allowance.take(sum(t.nbytes for t in tensors)):
            return None
        return [t.detach().clone() if isinstance(t, torch.Tensor) else None for t in leaves]

    def emptied(self) -> CallRecorder:
        """A recorder of the same method and settings, holding no call."""
        recorder = CallRecorder(self.value_if_missing, self.capacity, self.allowance)
        recorder.signature = self.signature
        return recorder

    def admit(self, observation: Observation, limit: int) -> None:
        """Add a call recorded before (here or in another process) as a block whose ``limit``
        is the number of calls it may reach would store it: a new signature below the limit, or
        one adding information within the capacity.  Every call it stands for is counted (a
        known signature's calls add to that observation's)."""
        with flattening_context():
            key = call_signature(observation.args, observation.kwargs)
        known = self._by_key.get(key)
        if known is not None:
            known.calls += observation.calls
            self.counts.duplicates += observation.calls
        elif len(self.observations) < limit or (
                len(self.observations) < self.capacity and self._adds_information(key)):
            self._store(key, observation)
            self.counts.duplicates += observation.calls - 1
        else:
            self.counts.dropped += observation.calls

    def _store(self, key: tuple, observation: Observation) -> None:
        self._by_key[key] = observation
        structure, sizes = key
        if structure in self._structures:
            self._structures[structure].add(sizes)
        else:
            self._structures[structure] = _SizesSeen(sizes)
        self.observations.append(observation)
        self.counts.stored += 1

    def _stores(self, key: tuple) -> bool:
        """The storing decision: a call is stored when its signature is new and an open block
        still has room (``store_n_calls``), or the call adds information within the capacity."""
        if key in self._by_key:
            return False
        stored = len(self.observations)
        return stored < max(b.limit for b in self._blocks) or (stored < self.capacity and self._adds_information(key))

    def _adds_information(self, key: tuple) -> bool:
        """Whether a call of signature ``key`` has a new input structure or, for a known one,
        varies an axis constant so far or breaks or makes an equality between axes."""
        structure, sizes = key
        seen = self._structures.get(structure)
        return seen is None or seen.adds_information(sizes)

    def _count_unstored(self, key: tuple) -> None:
        known = self._by_key.get(key)
        if known is None:
            self.counts.dropped += 1
        else:
            known.calls += 1
            self.counts.duplicates += 1

    def _count_failed(self, error: Exception) -> None:
        self.counts.failed += 1
        message = f"{type(error).__name__}: {error}"
        if message not in self.errors:
            self.errors.append(message)

    def _ordered(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Keyword arguments in signature order (torch.export matches them by order)."""
        assert self.signature is not None
        names = [n for n in self.signature.parameters if n in kwargs]
        return {**{n: kwargs[n] for n in names}, **kwargs}

    def families(self) -> list[list[int]]:
        """The stored observations in families of one graph signature (see
        :func:`.structures.structure_families`), largest first."""
        signature = self._recorded_signature()
        with flattening_context():
            return structure_families([(o.args, o.kwargs) for o in self.observations], signature)

    def aligned(self, mixed_constants: bool = False, calls: list[int] | None = None) -> AlignedCalls:
        """The stored observations (or those of index ``calls``) aligned on one input structure (see
        :mod:`.alignment`); ``mixed_constants`` records each call's constant arguments instead of
        raising when they differ."""
        signature = self._recorded_signature()
        chosen = list(range(len(self.observations))) if calls is None else list(calls)
        with flattening_context():
            aligned = align_calls(
                [(self.observations[i].args, self.observations[i].kwargs) for i in chosen], signature,
                self.value_if_missing, mixed_constants=mixed_constants,
            )
        aligned.kept = chosen
        return aligned

    def _recorded_signature(self) -> inspect.Signature:
        """The signature of the recorded calls; raises when none was recorded."""
        if not self.observations or self.signature is None:
            reason = (
                f"; {self.counts.failed} call(s) could not be recorded: {'; '.join(self.errors)}"
                if self.counts.failed else ""
            )
            raise ValueError(f"no call was recorded: call the model inside `with observer(model):`{reason}")
        return self.signature
