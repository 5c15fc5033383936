"""Pytree registration of the transformers caches (built from tensors by :mod:`.caches`).

Inside :func:`register_flattening_functions`, :func:`torch.export.export` and
``torch.onnx.export(..., dynamo=True)`` take and return transformers caches, flattened as:

* ``DynamicCache`` of n layers: 2n tensors ``k0, v0, k1, v1, ...`` (context
  ``["key_0", "value_0", ...]``); none when no layer holds tensors yet (``DynamicCache()``,
  or the cache ``generate()`` passes at prefill); layers of other classes than
  ``DynamicLayer`` (``DynamicSlidingWindowLayer``) keep their class and window through a
  :class:`MixedLayers` context;
* ``StaticCache`` (and ``SlidingWindowCache``, ``HybridCache`` where they are classes of
  their own): the same layout, each tensor ``max_cache_len`` positions long;
* ``EncoderDecoderCache``: ``[self_attention_cache, cross_attention_cache]``.

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
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..compat.export_patches import export_patches
from ..compat.torch_private import deregister_pytree_node
from .caches import ENCODER_DECODER_FIELDS, KeyValue, cache_module, dynamic_cache, static_cache

# the context is a list of names, or a MixedLayers for a DynamicCache of mixed layers
Flatten = Callable[[Any], tuple[list[Any], Any]]
Unflatten = Callable[[Sequence[Any], Any], Any]

_LAYER_ARGUMENTS = ("sliding_window",)  # constructor arguments a layer keeps as attributes
_STATIC_CACHE_CLASSES = ("StaticCache", "SlidingWindowCache", "HybridCache")

_lock = threading.Lock()
_owned: dict[type, int] = {}  # class registered here -> number of open contexts using it


# -- flattening -------------------------------------------------------------------------


@dataclass(frozen=True)
class MixedLayers:
    """Flattening context of a ``DynamicCache`` whose layers are not all ``DynamicLayer``:
    the names of its tensors and, per layer, its class name and constructor arguments."""

    names: tuple[str, ...]
    layers: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]

    @classmethod
    def of(cls, cache: Any, names: list[str]) -> MixedLayers:
        return cls(tuple(names), tuple(
            (type(layer).__name__, tuple((a, getattr(layer, a)) for a in _LAYER_ARGUMENTS if hasattr(layer, a)))
            for layer in cache.layers
        ))

    def new_layers(self) -> list[Any]:
        return [getattr(cache_module(), name)(**dict(arguments)) for name, arguments in self.layers]


def _dumpable(context: list[str] | MixedLayers) -> Any:
    """A flattening context as JSON (a repro saves the input tree)."""
    if isinstance(context, MixedLayers):
        layers = [[name, [list(a) for a in arguments]] for name, arguments in context.layers]
        return {"names": list(context.names), "layers": layers}
    return context


def _from_dumpable(dumped: Any) -> list[str] | MixedLayers:
    if isinstance(dumped, dict):
        layers = tuple((name, tuple(tuple(a) for a in arguments)) for name, arguments in dumped["layers"])
        return MixedLayers(tuple(dumped["names"]), layers)
    return dumped


def _names(context: list[str] | MixedLayers) -> list[str]:
    return list(context.names) if isinstance(context, MixedLayers) else context


def _flat_key_values(
    cache: Any, layer_type: type, subclasses: bool = False
) -> tuple[list[torch.Tensor], list[str]]:
    """``k0, v0, k1, ...`` and their names, once checked all layers are filled ``layer_type``
    (or one of its subclasses when ``subclasses``)."""
    for i, layer in enumerate(cache.layers):
        accepted = isinstance(layer, layer_type) if subclasses else type(layer) is layer_type
        if not accepted or layer.keys is None:
            what = "empty" if accepted else f"a {type(layer).__name__}"
            raise TypeError(
                f"cannot flatten {type(cache).__name__}: layer {i} is {what},"
                f" only filled {layer_type.__name__} layers are supported"
            )
    leaves = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    names = [f"{kind}_{i}" for i in range(len(cache.layers)) for kind in ("key", "value")]
    return leaves, names


def _pairs(leaves: Sequence[torch.Tensor]) -> list[KeyValue]:
    return list(zip(leaves[::2], leaves[1::2], strict=True))


def _flatten_dynamic_cache(cache: Any) -> tuple[list[torch.Tensor], list[str] | MixedLayers]:
    layer_type = cache_module().DynamicLayer
    if all(isinstance(layer, layer_type) and layer.keys is None for layer in cache.layers):
        return [], []  # nothing cached yet
    leaves, names = _flat_key_values(cache, layer_type, subclasses=True)
    if all(type(layer) is layer_type for layer in cache.layers):
        return leaves, names
    return leaves, MixedLayers.of(cache, names)


def _unflatten_dynamic_cache(leaves: Sequence[torch.Tensor], context: list[str] | MixedLayers) -> Any:
    layers = context.new_layers() if isinstance(context, MixedLayers) else None
    return dynamic_cache(_pairs(leaves), layers)


def _flatten_static_cache(cache: Any) -> tuple[list[torch.Tensor], list[str]]:
    return _flat_key_values(cache, cache_module().StaticLayer)


def _unflatten_static_cache(cls: type, leaves: Sequence[torch.Tensor], context: list[str]) -> Any:
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
