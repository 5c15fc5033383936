"""Builders of transformers caches from tensors (``make_dynamic_cache``, ``make_static_cache``,
``make_encoder_decoder_cache``), also used to unflatten them (see :mod:`.cache_pytrees`).

Tensors are assigned to the layers, as ``lazy_initialization`` + ``update`` leave them: calling
``update`` while torch.export traces makes lifted constants the ONNX decomposition cannot find.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar, cast

import torch

C = TypeVar("C")
KeyValue = tuple[torch.Tensor, torch.Tensor]
LayerClasses = str | type | Sequence[str | type] | None
LayerKwargs = dict[str, Any] | list[dict[str, Any]] | tuple[dict[str, Any], ...] | None

ENCODER_DECODER_FIELDS = ["self_attention_cache", "cross_attention_cache"]


def cache_module() -> Any:
    import transformers.cache_utils

    return transformers.cache_utils


def filled(layer: Any, key: torch.Tensor, value: torch.Tensor) -> Any:
    """``layer`` holding ``key``/``value``, as ``lazy_initialization`` + ``update`` leave it."""
    layer.keys, layer.values = key, value
    layer.dtype, layer.device = key.dtype, key.device
    layer.is_initialized = True
    if isinstance(getattr(layer, "cumulative_length", None), int):  # DynamicSlidingWindowLayer
        layer.cumulative_length = key.shape[-2]
    if isinstance(layer, cache_module().StaticLayer):
        layer.max_batch_size = key.shape[0]  # read by ``Cache.max_batch_size`` (transformers 4.57)
        if hasattr(layer, "cumulative_length"):  # transformers 5 keeps the fill level as a tensor
            # computed from the keys as transformers 4.57 does (the positions holding a non-zero
            # key), so that the tensor ``StaticLayer.__init__`` made is dropped, out of the graph
            layer.cumulative_length = key[0, 0].any(dim=-1).sum()
    return layer


def dynamic_cache(pairs: Sequence[KeyValue], layers: Sequence[Any] | None = None) -> Any:
    """A ``DynamicCache`` whose layer i is ``layers[i]`` (a new ``DynamicLayer`` by default)
    holding ``pairs[i]``."""
    cache_utils = cache_module()
    cache = cache_utils.DynamicCache()
    layers = layers if layers is not None else [cache_utils.DynamicLayer() for _ in pairs]
    cache.layers.extend(filled(layer, k, v) for layer, (k, v) in zip(layers, pairs, strict=True))
    return cache


def static_cache(cls: type[C], pairs: Sequence[KeyValue], layers: Sequence[Any] | None = None) -> C:
    """A ``cls`` (``StaticCache`` or a subclass) holding ``pairs`` in new ``StaticLayer``s, already
    max_cache_len long, or holding the given ``layers``."""
    cache_utils = cache_module()
    if layers is None:
        layers = [filled(cache_utils.StaticLayer(max_cache_len=k.shape[2]), k, v) for k, v in pairs]
    # the constructor transformers 4.57 and 5.x share, and which needs no model config
    cache = cls.__new__(cls)
    cache_utils.Cache.__init__(cache, layers=layers)
    return cache


def _as_pairs(pairs: Sequence[Any]) -> list[Any]:
    """(key, value) pairs from a list of pairs or a flat list ``k0, v0, k1, v1, ...``."""
    if not isinstance(pairs, (list, tuple)):
        raise TypeError(f"pairs must be a list of (key, value) tensors, not {type(pairs).__name__}")
    if pairs and all(isinstance(t, torch.Tensor) for t in pairs):
        if len(pairs) % 2:
            raise TypeError(
                f"pairs[{len(pairs) - 1}] must be a (key, value) pair: a flat list of tensors holds"
                f" keys and values in turn, got {len(pairs)} tensors"
            )
        return list(zip(pairs[::2], pairs[1::2]))
    return list(pairs)


def _checked_tensor_pairs(pairs: Sequence[Any], min_rank: int) -> list[KeyValue]:
    """(key, value) pairs of tensors of rank ``min_rank`` or more."""
    pairs = _as_pairs(pairs)
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            raise TypeError(f"pairs[{i}] must be a (key, value) pair, not {type(pair).__name__}")
        key, value = pair
        if not (isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor)):
            raise TypeError(
                f"pairs[{i}] must hold two tensors, "
                f"not {type(key).__name__}, {type(value).__name__}"
            )
        if min(key.dim(), value.dim()) < min_rank:
            raise ValueError(
                f"pairs[{i}]: keys and values need {min_rank} dimensions or more, "
                f"got {tuple(key.shape)} and {tuple(value.shape)}"
            )
    return [tuple(pair) for pair in pairs]


def _checked_pairs(pairs: Sequence[Any]) -> list[KeyValue]:
    """(key, value) pairs of ``(batch, heads, seq, head_dim)`` tensors agreeing on the first three."""
    pairs = _checked_tensor_pairs(pairs, min_rank=1)
    for i, (key, value) in enumerate(pairs):
        if key.dim() != 4 or value.dim() != 4 or key.shape[:3] != value.shape[:3]:
            raise ValueError(
                f"pairs[{i}]: key and value must be (batch, heads, seq, head_dim) tensors with"
                f" the same batch, heads and seq, got {tuple(key.shape)} and {tuple(value.shape)}"
            )
    return pairs


def make_dynamic_cache(
    pairs: Sequence[Any], cls_layers: LayerClasses = None, cls_kwargs: LayerKwargs = None
) -> Any:
    """A ``DynamicCache`` whose layer i holds ``pairs[i] = (key, value)`` (not copied).

    ``pairs`` is a list of (key, value) pairs or a flat list ``k0, v0, k1, v1, ...``; keys and
    values are tensors of rank 2 or more, usually ``(batch, heads, seq, head_dim)``.
    ``cls_layers`` gives the layer class of every layer (one class or name for all, or one per
    layer, e.g. ``[DynamicLayer, DynamicSlidingWindowLayer]``), ``cls_kwargs`` their
    constructor arguments (``sliding_window`` defaults to the length of the keys).
    """
    checked = _checked_tensor_pairs(pairs, min_rank=2)
    if cls_layers is None:
        if cls_kwargs is not None:
            raise ValueError("cls_kwargs needs cls_layers")
        return dynamic_cache(checked)
    return dynamic_cache(checked, _new_layers(checked, cls_layers, cls_kwargs))


def _new_layers(
    pairs: list[KeyValue], cls_layers: str | type | Sequence[str | type], cls_kwargs: LayerKwargs
) -> list[Any]:
    """One new layer per pair, of the class ``cls_layers`` names for it."""
    per_layer = [cls_layers] * len(pairs) if isinstance(cls_layers, (str, type)) else list(cls_layers)
    kwargs = [cls_kwargs or {}] * len(pairs) if not isinstance(cls_kwargs, (list, tuple)) else list(cls_kwargs)
    if not len(per_layer) == len(kwargs) == len(pairs):
        raise ValueError(
            f"{len(pairs)} layers, {len(per_layer)} classes in cls_layers and {len(kwargs)} in cls_kwargs"
        )
    layers = []
    for (key, _), cls, arguments in zip(pairs, per_layer, kwargs):
        cls = _layer_class(cls)
        defaults = {"sliding_window": key.shape[-2]} if "SlidingWindow" in cls.__name__ else {}
        layers.append(cls(**{**defaults, **arguments}))
    return layers


def _layer_class(cls: str | type) -> type:
    """A cache layer class, or its name in ``transformers.cache_utils``."""
    cache_utils = cache_module()
    resolved = getattr(cache_utils, cls, None) if isinstance(cls, str) else cls
    if not (isinstance(resolved, type) and issubclass(resolved, cache_utils.DynamicLayer)):
        raise ValueError(f"{cls!r} is no DynamicLayer class of transformers.cache_utils")
    return resolved


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
    return static_cache(cache_module().StaticCache, cast(list[KeyValue], padded))


def make_encoder_decoder_cache(self_attention_cache: Any, cross_attention_cache: Any) -> Any:
    """An ``EncoderDecoderCache`` of the two given caches."""
    cache_utils = cache_module()
    for name, cache in zip(
        ENCODER_DECODER_FIELDS, (self_attention_cache, cross_attention_cache), strict=True
    ):
        if not isinstance(cache, cache_utils.Cache):
            raise TypeError(f"{name} must be a transformers Cache, not {type(cache).__name__}")
    return cache_utils.EncoderDecoderCache(self_attention_cache, cross_attention_cache)
