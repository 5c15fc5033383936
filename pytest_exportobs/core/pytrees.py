"""Pytree registration of the transformers caches, and builders of caches from tensors.

Inside :func:`register_flattening_functions`, :func:`torch.export.export` and
``torch.onnx.export(..., dynamo=True)`` take and return transformers caches, flattened as:

* ``DynamicCache`` of n layers: 2n tensors ``k0, v0, k1, v1, ...`` (context
  ``["key_0", "value_0", ...]``); none when no layer holds tensors yet (``DynamicCache()``,
  or the cache ``generate()`` passes at prefill);
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
from typing import Any

import torch
import torch.utils._pytree as pytree

KeyValue = tuple[torch.Tensor, torch.Tensor]
Flatten = Callable[[Any], tuple[list[Any], list[str]]]
Unflatten = Callable[[Sequence[Any], list[str]], Any]

_ENCODER_DECODER_FIELDS = ["self_attention_cache", "cross_attention_cache"]
_STATIC_CACHE_CLASSES = ("StaticCache", "SlidingWindowCache", "HybridCache")

_lock = threading.Lock()
_owned: dict[type, int] = {}  # class registered here -> number of open contexts using it


def _cache_utils() -> Any:
    import transformers.cache_utils

    return transformers.cache_utils


# -- building caches --------------------------------------------------------------------


def _filled(layer: Any, key: torch.Tensor, value: torch.Tensor) -> Any:
    """``layer`` holding ``key``/``value``, as ``lazy_initialization`` + ``update`` leave it."""
    layer.keys, layer.values = key, value
    layer.dtype, layer.device = key.dtype, key.device
    layer.is_initialized = True
    if isinstance(layer, _cache_utils().StaticLayer):
        layer.max_batch_size = key.shape[0]  # read by ``Cache.max_batch_size`` (transformers 4.57)
        if hasattr(layer, "cumulative_length"):  # transformers 5 keeps the fill level as a tensor
            # computed from the keys as transformers 4.57 does (the positions holding a non-zero
            # key), so that the tensor ``StaticLayer.__init__`` made is dropped, out of the graph
            layer.cumulative_length = key[0, 0].any(dim=-1).sum()
    return layer


def _dynamic_cache(pairs: Sequence[KeyValue]) -> Any:
    cache_utils = _cache_utils()
    cache = cache_utils.DynamicCache()
    cache.layers.extend(_filled(cache_utils.DynamicLayer(), k, v) for k, v in pairs)
    return cache


def _static_cache(cls: type, pairs: Sequence[KeyValue]) -> Any:
    """A ``cls`` (``StaticCache`` or a subclass) holding ``pairs``, already max_cache_len long."""
    cache_utils = _cache_utils()
    layers = [_filled(cache_utils.StaticLayer(max_cache_len=k.shape[2]), k, v) for k, v in pairs]
    # the constructor transformers 4.57 and 5.x share, and which needs no model config
    cache = cls.__new__(cls)
    cache_utils.Cache.__init__(cache, layers=layers)
    return cache


def _checked_pairs(pairs: Sequence[KeyValue]) -> list[KeyValue]:
    """``pairs`` as a list, once checked to be (key, value) pairs of 4-D tensors."""
    if not isinstance(pairs, (list, tuple)):
        raise TypeError(f"pairs must be a list of (key, value) tensors, not {type(pairs).__name__}")
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            raise TypeError(f"pairs[{i}] must be a (key, value) pair, not {type(pair).__name__}")
        key, value = pair
        if not (isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor)):
            raise TypeError(
                f"pairs[{i}] must hold two tensors, "
                f"not {type(key).__name__}, {type(value).__name__}"
            )
        if key.dim() != 4 or value.dim() != 4 or key.shape[:3] != value.shape[:3]:
            raise ValueError(
                f"pairs[{i}]: key and value must be (batch, heads, seq, head_dim) tensors with"
                f" the same batch, heads and seq, got {tuple(key.shape)} and {tuple(value.shape)}"
            )
    return [tuple(pair) for pair in pairs]


def make_dynamic_cache(pairs: Sequence[KeyValue]) -> Any:
    """A ``DynamicCache`` whose layer i holds ``pairs[i] = (key, value)`` (not copied).

    Keys and values are ``(batch, heads, seq, head_dim)`` tensors.
    """
    return _dynamic_cache(_checked_pairs(pairs))


def make_static_cache(pairs: Sequence[KeyValue], max_cache_len: int) -> Any:
    """A ``StaticCache`` of ``max_cache_len`` positions whose layer i starts with ``pairs[i]``.

    Layer i holds ``(batch, heads, max_cache_len, head_dim)`` tensors: the ``seq``
    positions of ``pairs[i]`` first, zeros after them.
    """
    checked = _checked_pairs(pairs)
    too_long = [k.shape[2] for k, _ in checked if k.shape[2] > max_cache_len]
    if too_long:
        raise ValueError(
            f"max_cache_len={max_cache_len} is shorter than a sequence of {too_long[0]}"
        )
    padded = [
        tuple(torch.nn.functional.pad(t, (0, 0, 0, max_cache_len - t.shape[2])) for t in pair)
        for pair in checked
    ]
    return _static_cache(_cache_utils().StaticCache, padded)


def make_encoder_decoder_cache(self_attention_cache: Any, cross_attention_cache: Any) -> Any:
    """An ``EncoderDecoderCache`` of the two given caches."""
    cache_utils = _cache_utils()
    for name, cache in zip(
        _ENCODER_DECODER_FIELDS, (self_attention_cache, cross_attention_cache), strict=True
    ):
        if not isinstance(cache, cache_utils.Cache):
            raise TypeError(f"{name} must be a transformers Cache, not {type(cache).__name__}")
    return cache_utils.EncoderDecoderCache(self_attention_cache, cross_attention_cache)


# -- flattening -------------------------------------------------------------------------


def _flat_key_values(cache: Any, layer_type: type) -> tuple[list[torch.Tensor], list[str]]:
    """``k0, v0, k1, ...`` and their names, once checked all layers are filled ``layer_type``."""
    for i, layer in enumerate(cache.layers):
        if type(layer) is not layer_type or layer.keys is None:
            what = "empty" if type(layer) is layer_type else f"a {type(layer).__name__}"
            raise TypeError(
                f"cannot flatten {type(cache).__name__}: layer {i} is {what},"
                f" only filled {layer_type.__name__} layers are supported"
            )
    leaves = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    names = [f"{kind}_{i}" for i in range(len(cache.layers)) for kind in ("key", "value")]
    return leaves, names


def _pairs(leaves: Sequence[torch.Tensor]) -> list[KeyValue]:
    return list(zip(leaves[::2], leaves[1::2], strict=True))


def _flatten_dynamic_cache(cache: Any) -> tuple[list[torch.Tensor], list[str]]:
    layer_type = _cache_utils().DynamicLayer
    if all(type(layer) is layer_type and layer.keys is None for layer in cache.layers):
        return [], []  # nothing cached yet
    return _flat_key_values(cache, layer_type)


def _unflatten_dynamic_cache(leaves: Sequence[torch.Tensor], context: list[str]) -> Any:
    return _dynamic_cache(_pairs(leaves))


def _flatten_static_cache(cache: Any) -> tuple[list[torch.Tensor], list[str]]:
    return _flat_key_values(cache, _cache_utils().StaticLayer)


def _unflatten_static_cache(cls: type, leaves: Sequence[torch.Tensor], context: list[str]) -> Any:
    return _static_cache(cls, _pairs(leaves))


def _flatten_encoder_decoder_cache(cache: Any) -> tuple[list[Any], list[str]]:
    return [getattr(cache, name) for name in _ENCODER_DECODER_FIELDS], _ENCODER_DECODER_FIELDS


def _unflatten_encoder_decoder_cache(children: Sequence[Any], context: list[str]) -> Any:
    return _cache_utils().EncoderDecoderCache(*children)


def _with_keys(flatten: Flatten) -> Callable[[Any], tuple[list[tuple[Any, Any]], list[str]]]:
    def flatten_with_keys(obj: Any) -> tuple[list[tuple[Any, Any]], list[str]]:
        children, names = flatten(obj)
        return [(pytree.MappingKey(n), c) for n, c in zip(names, children, strict=True)], names

    return flatten_with_keys


def _transformers_nodes() -> dict[type, tuple[Flatten, Unflatten]]:
    """The cache classes of the installed transformers and their (flatten, unflatten)."""
    cache_utils = _cache_utils()
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
                    unflatten,
                    serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
                    flatten_with_keys_fn=_with_keys(flatten),
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
                    pytree._deregister_pytree_node(cls)


@contextlib.contextmanager
def register_flattening_functions(patch_transformers: bool = True) -> Iterator[None]:
    """Register the transformers caches with torch's pytree for the duration of the block.

    ``patch_transformers=False`` leaves transformers alone (the block then does nothing);
    the caches need no patch of transformers beyond this registration. Classes registered
    before entering, by transformers or anyone else, are left as they are. Contexts nest:
    a class is unregistered when the last context holding it exits.
    """
    wanted = patch_transformers and importlib.util.find_spec("transformers") is not None
    held = _acquire(_transformers_nodes()) if wanted else []
    try:
        yield
    finally:
        _release(held)
