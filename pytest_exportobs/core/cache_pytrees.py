"""Pytree registration of the transformers caches (built from tensors by :mod:`.caches`).

Inside :func:`register_flattening_functions`, :func:`torch.export.export` and
``torch.onnx.export(..., dynamo=True)`` take and return transformers caches, flattened as:

* ``DynamicCache`` of n layers: 2n tensors ``k0, v0, k1, v1, ...`` (context
  ``["key_0", "value_0", ...]``); none when no layer holds tensors yet (``DynamicCache()``,
  or the cache ``generate()`` passes at prefill).  Any other layers (sliding-window, indexed,
  linear-attention and state layers with their ``conv_state_i``/``recurrent_state_i``, hybrids
  of both, empty layers) are flattened layer by layer, in order, each keeping its class,
  constructor arguments and fields through a :class:`MixedLayers` context;
* ``StaticCache`` (and ``SlidingWindowCache``, ``HybridCache`` where they are classes of
  their own): the same layout, each tensor ``max_cache_len`` positions long;
* ``EncoderDecoderCache``: ``[self_attention_cache, cross_attention_cache]``.

Quantized layers are refused: their tensors belong to their quantization backend.
Unflattening assigns the tensors to new layers. It must not call ``update`` (hence
``lazy_initialization``): tensors created while torch.export traces become lifted
constants, which the ONNX decomposition then fails to find.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..compat.export_patches import export_patches
from ..compat.torch_private import deregister_pytree_node
from .caches import ENCODER_DECODER_FIELDS, KeyValue, cache_module, dynamic_cache, filled, static_cache

# the context is a list of names, or a MixedLayers for a cache of other layers than plain ones
Flatten = Callable[[Any], tuple[list[Any], Any]]
Unflatten = Callable[[Sequence[Any], Any], Any]

# constructor arguments a layer keeps as attributes of the same name
_LAYER_ARGUMENTS = ("sliding_window", "max_cache_len", "number_of_states")
_STATIC_CACHE_CLASSES = ("StaticCache", "SlidingWindowCache", "HybridCache")
# a layer's tensors besides keys and values: (attribute, leaf name, flag set when it holds one)
_EXTRA_TENSORS = (("indexer_keys", "indexer_key", "is_indexer_initialized"),
                  ("indexer_position_ids", "indexer_position_ids", None))
_STATES = (("conv_states", "conv_state"), ("recurrent_states", "recurrent_state"))  # linear attention

_lock = threading.Lock()
_owned: dict[type, int] = {}  # class registered here -> number of open contexts using it


# -- flattening -------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerLayout:
    """One cache layer as flattened: its class and constructor arguments, the fields holding its
    tensors in order (``keys``, ``values``, ``indexer_keys``, ``conv_states.0``,
    ``recurrent_states.0``...) and, for a linear-attention layer, which states hold a previous
    step (``has_previous_state``: a decode step reads them, a prefill overwrites them).

    The constructor arguments are no part of the structure (equality): a model's windows come
    from its configuration, and caches built by ``make_dynamic_cache`` without ``cls_kwargs``
    take the length of their keys as window, which grows from call to call."""

    cls: str
    arguments: tuple[tuple[str, Any], ...] = field(compare=False)
    fields: tuple[str, ...]
    previous: tuple[bool, ...] = ()

    @classmethod
    def of(cls, layer: Any, index: int, owner: str) -> tuple[LayerLayout, list[torch.Tensor], list[str]]:
        """The layout of ``layer`` (layer ``index`` of a ``owner``), its tensors and their leaf names."""
        if getattr(layer, "record_past", False):
            raise TypeError(f"cannot flatten {owner}: layer {index} records past states (assisted decoding)")
        if hasattr(layer, "_quantized_keys"):
            raise TypeError(f"cannot flatten {owner}: layer {index} is a {type(layer).__name__}, whose quantized "
                            "tensors belong to its quantization backend")
        if isinstance(layer, cache_module().StaticLayer) and getattr(layer, "keys", None) is None:
            raise TypeError(f"cannot flatten {owner}: layer {index} is empty, a static layer holds its tensors "
                            "from its first update on")
        held = _held_tensors(layer, index)
        states = getattr(layer, "number_of_states", 0)
        previous = tuple(bool(layer.has_previous_state[s]) for s in range(states))
        arguments = tuple((a, getattr(layer, a)) for a in _LAYER_ARGUMENTS if isinstance(getattr(layer, a, None), int))
        layout = cls(type(layer).__name__, arguments, tuple(held_field for held_field, _, _ in held), previous)
        return layout, [tensor for _, _, tensor in held], [name for _, name, _ in held]

    def build(self, tensors: Sequence[torch.Tensor]) -> Any:
        """A new layer of this layout holding ``tensors``, as updating it would have left it."""
        layer = getattr(cache_module(), self.cls)(**dict(self.arguments))
        held = dict(zip(self.fields, tensors, strict=True))
        if "keys" in held:
            filled(layer, held["keys"], held["values"])
        for attribute, _, initialized in _EXTRA_TENSORS:
            if attribute in held:
                setattr(layer, attribute, held[attribute])
                if initialized:
                    setattr(layer, initialized, True)
        for held_field, tensor in held.items():
            attribute, _, number = held_field.partition(".")
            if number:  # a linear-attention state
                _set_state(layer, attribute, int(number), tensor)
        for state, previous in enumerate(self.previous):
            layer.has_previous_state[state] = previous
        return layer

    @property
    def plain(self) -> bool:
        """A filled plain ``DynamicLayer`` or ``StaticLayer``: keys and values, nothing else."""
        return self.cls in ("DynamicLayer", "StaticLayer") and self.fields == ("keys", "values")


@dataclass(frozen=True)
class MixedLayers:
    """Flattening context of a cache whose layers are not all filled plain layers (sliding-window,
    linear-attention or state layers, empty ones): the names of its tensors and each layer's
    layout."""

    names: tuple[str, ...]
    layers: tuple[LayerLayout, ...]

    def new_layers(self, leaves: Sequence[torch.Tensor]) -> list[Any]:
        """The layers, holding ``leaves`` in order."""
        layers, start = [], 0
        for layout in self.layers:
            layers.append(layout.build(leaves[start:start + len(layout.fields)]))
            start += len(layout.fields)
        return layers


def _held_tensors(layer: Any, index: int) -> list[tuple[str, str, torch.Tensor]]:
    """``(field, leaf name, tensor)`` of every tensor a cache layer holds, in order: keys and
    values, an indexer's keys, then each linear-attention state."""
    held = []
    if getattr(layer, "keys", None) is not None and getattr(layer, "is_initialized", False):
        held += [("keys", f"key_{index}", layer.keys), ("values", f"value_{index}", layer.values)]
    for attribute, name, _ in _EXTRA_TENSORS:
        if isinstance(getattr(layer, attribute, None), torch.Tensor):
            held.append((attribute, f"{name}_{index}", getattr(layer, attribute)))
    for attribute, name in _STATES if getattr(layer, "number_of_states", 0) else ():
        for state, tensor in getattr(layer, attribute).items():
            if tensor is not None:
                held.append((f"{attribute}.{state}", f"{name}_{index}" + (f"_{state}" if state else ""), tensor))
    return held


def _set_state(layer: Any, attribute: str, state: int, tensor: torch.Tensor) -> None:
    """A linear-attention layer holding ``tensor`` as its state ``state`` of ``attribute``
    (``conv_states``, ``recurrent_states``), as ``lazy_initialization`` + an update leave it."""
    getattr(layer, attribute)[state] = tensor
    getattr(layer, f"is_{attribute}_initialized")[state] = True
    layer.dtype, layer.device = tensor.dtype, tensor.device
    if attribute == "conv_states":
        layer.conv_kernel_size[state] = tensor.shape[-1]


def _dumpable(context: list[str] | MixedLayers) -> Any:
    """A flattening context as JSON (a repro saves the input tree)."""
    if isinstance(context, MixedLayers):
        layers = [[layout.cls, [list(a) for a in layout.arguments], list(layout.fields), list(layout.previous)]
                  for layout in context.layers]
        return {"names": list(context.names), "layers": layers}
    return context


def _from_dumpable(dumped: Any) -> list[str] | MixedLayers:
    if isinstance(dumped, dict):
        layers = tuple(LayerLayout(name, tuple(tuple(a) for a in arguments), tuple(fields), tuple(previous))
                       for name, arguments, fields, previous in dumped["layers"])
        return MixedLayers(tuple(dumped["names"]), layers)
    return dumped


def _names(context: list[str] | MixedLayers) -> list[str]:
    return list(context.names) if isinstance(context, MixedLayers) else context


def _flatten_layers(cache: Any) -> tuple[list[torch.Tensor], list[str] | MixedLayers]:
    """Every layer's tensors in order (``k0, v0, k1, v1, ...`` for plain layers), with their names
    as context when all layers are filled plain ones of one class, else a :class:`MixedLayers`."""
    owner = type(cache).__name__
    layouts, leaves, names = [], [], []
    for index, layer in enumerate(cache.layers):
        layout, tensors, layer_names = LayerLayout.of(layer, index, owner)
        layouts.append(layout)
        leaves += tensors
        names += layer_names
    if layouts and all(layout.plain and layout.cls == layouts[0].cls for layout in layouts):
        return leaves, names
    return leaves, MixedLayers(tuple(names), tuple(layouts))


def _pairs(leaves: Sequence[torch.Tensor]) -> list[KeyValue]:
    return list(zip(leaves[::2], leaves[1::2], strict=True))


def _flatten_dynamic_cache(cache: Any) -> tuple[list[torch.Tensor], list[str] | MixedLayers]:
    layer_type = cache_module().DynamicLayer
    if all(type(layer) is layer_type and layer.keys is None for layer in cache.layers):
        return [], []  # nothing cached yet, in layers a DynamicCache() makes again
    return _flatten_layers(cache)


def _unflatten_dynamic_cache(leaves: Sequence[torch.Tensor], context: list[str] | MixedLayers) -> Any:
    if isinstance(context, MixedLayers):
        cache = cache_module().DynamicCache()
        cache.layers.extend(context.new_layers(leaves))
        return cache
    return dynamic_cache(_pairs(leaves))


def _flatten_static_cache(cache: Any) -> tuple[list[torch.Tensor], list[str] | MixedLayers]:
    return _flatten_layers(cache)


def _unflatten_static_cache(cls: type, leaves: Sequence[torch.Tensor], context: list[str] | MixedLayers) -> Any:
    if isinstance(context, MixedLayers):
        return static_cache(cls, [], context.new_layers(leaves))
    return static_cache(cls, _pairs(leaves))


def _flatten_encoder_decoder_cache(cache: Any) -> tuple[list[Any], list[str]]:
    return [getattr(cache, name) for name in ENCODER_DECODER_FIELDS], ENCODER_DECODER_FIELDS


def _unflatten_encoder_decoder_cache(children: Sequence[Any], context: list[str]) -> Any:
    return cache_module().EncoderDecoderCache(*children)


def _with_keys(
    flatten: Flatten, key: Callable[[str], Any] = pytree.GetAttrKey
) -> Callable[[Any], tuple[list[tuple[Any, Any]], list[str]]]:
    """A ``flatten_with_keys`` from ``flatten`` whose context names the children.  Attribute keys
    by default: torch's ShapesSpec (torch >= 2.14) addresses a registered class's children with
    ObjectSpec, which matches them by GetAttrKey name."""

    def flatten_with_keys(obj: Any) -> tuple[list[tuple[Any, Any]], Any]:
        children, context = flatten(obj)
        keys = [key(n) for n in _names(context)]
        return list(zip(keys, children, strict=True)), context

    return flatten_with_keys


def _transformers_nodes() -> dict[type, tuple[Flatten, Unflatten]]:
    """The cache classes of the installed transformers and their (flatten, unflatten)."""
    cache_utils = cache_module()
    nodes: dict[type, tuple[Flatten, Unflatten]] = {
        cache_utils.DynamicCache: (_flatten_dynamic_cache, _unflatten_dynamic_cache),
        cache_utils.EncoderDecoderCache: (
            _flatten_encoder_decoder_cache,
            _unflatten_encoder_decoder_cache,
        ),
    }
    for name in _STATIC_CACHE_CLASSES:  # transformers 5 keeps SlidingWindowCache as an alias
        cls = getattr(cache_utils, name, None)
        if cls is not None:
            nodes.setdefault(
                cls, (_flatten_static_cache, functools.partial(_unflatten_static_cache, cls))
            )
    return nodes


# -- registration -----------------------------------------------------------------------


def _acquire(nodes: dict[type, tuple[Flatten, Unflatten]]) -> list[type]:
    """Register the classes nobody registered yet; return those this context now holds."""
    held = []
    with _lock:
        for cls, (flatten, unflatten) in nodes.items():
            if cls not in _owned:
                if cls in pytree.SUPPORTED_NODES:  # registered by transformers or someone else
                    continue
                pytree.register_pytree_node(
                    cls,
                    flatten,
                    unflatten,  # type: ignore[arg-type]  # typed Iterable in torch, always given a list
                    serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
                    flatten_with_keys_fn=_with_keys(flatten),
                    to_dumpable_context=_dumpable,
                    from_dumpable_context=_from_dumpable,
                )
                _owned[cls] = 0
            _owned[cls] += 1
            held.append(cls)
    return held


def _release(held: list[type]) -> None:
    """Unregister the classes of ``held`` no other open context holds (if still registered here)."""
    with _lock:
        for cls in held:
            _owned[cls] -= 1
            if _owned[cls] == 0:
                del _owned[cls]
                node = pytree.SUPPORTED_NODES.get(cls)
                if node is not None and node.flatten_fn.__module__ == __name__:
                    deregister_pytree_node(cls)


@contextlib.contextmanager
def register_flattening_functions(patch_transformers: bool = True) -> Iterator[None]:
    """Register the transformers caches with torch's pytree and patch transformers for
    ``torch.export`` (:func:`~.export_patches.export_patches`) for the duration of the block, as
    the peers' ``torch_export_patches(patch_transformers=True)`` do; eager calls compute what
    they compute outside it.  ``patch_transformers=False`` leaves transformers alone (the block
    then does nothing)."""
    if not patch_transformers:
        yield
        return
    with cache_registration(), export_patches():
        yield


@contextlib.contextmanager
def cache_registration() -> Iterator[None]:
    """Register the transformers caches with torch's pytree for the duration of the block.

    Classes registered before entering, by transformers or anyone else, are left as they are.
    Contexts nest: a class is unregistered when the last context holding it exits.
    """
    wanted = importlib.util.find_spec("transformers") is not None
    held = _acquire(_transformers_nodes()) if wanted else []
    try:
        with _keyed_model_outputs() if wanted else contextlib.nullcontext():
            yield
    finally:
        _release(held)


@contextlib.contextmanager
def _keyed_model_outputs() -> Iterator[None]:
    """Key paths for the model outputs transformers registers without them (4.57): torch.export
    flattens its inputs with key paths, and ``generate()`` passes ``encoder_outputs`` as one."""
    keyless = {
        cls: node for cls, node in list(pytree.SUPPORTED_NODES.items())
        if node.flatten_with_keys_fn is None and cls.__module__.startswith("transformers.")
    }
    for cls, node in keyless.items():
        pytree.SUPPORTED_NODES[cls] = node._replace(flatten_with_keys_fn=_with_keys(node.flatten_fn, pytree.MappingKey))
    try:
        yield
    finally:
        for cls, node in keyless.items():
            pytree.SUPPORTED_NODES[cls] = node
