"""Pytree registration of the transformers caches, and builders of caches from tensors.

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

KeyValue = tuple[torch.Tensor, torch.Tensor]
Flatten = Callable[[Any], tuple[list[Any], list[str]]]
Unflatten = Callable[[Sequence[Any], list[str]], Any]

LayerClasses = str | type | Sequence[str | type] | None
LayerKwargs = dict[str, Any] | Sequence[dict[str, Any]] | None

_ENCODER_DECODER_FIELDS = ["self_attention_cache", "cross_attention_cache"]
_LAYER_ARGUMENTS = ("sliding_window",)  # constructor arguments a layer keeps as attributes
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
    if isinstance(getattr(layer, "cumulative_length", None), int):  # DynamicSlidingWindowLayer
        layer.cumulative_length = key.shape[-2]
    if isinstance(layer, _cache_utils().StaticLayer):
        layer.max_batch_size = key.shape[0]  # read by ``Cache.max_batch_size`` (transformers 4.57)
        if hasattr(layer, "cumulative_length"):  # transformers 5 keeps the fill level as a tensor
            # computed from the keys as transformers 4.57 does (the positions holding a non-zero
            # key), so that the tensor ``StaticLayer.__init__`` made is dropped, out of the graph
            layer.cumulative_length = key[0, 0].any(dim=-1).sum()
    return layer


def _dynamic_cache(pairs: Sequence[KeyValue], layers: Sequence[Any] | None = None) -> Any:
    """A ``DynamicCache`` whose layer i is ``layers[i]`` (a new ``DynamicLayer`` by default)
    holding ``pairs[i]``."""
    cache_utils = _cache_utils()
    cache = cache_utils.DynamicCache()
    layers = layers if layers is not None else [cache_utils.DynamicLayer() for _ in pairs]
    cache.layers.extend(_filled(layer, k, v) for layer, (k, v) in zip(layers, pairs, strict=True))
    return cache


def _static_cache(cls: type, pairs: Sequence[KeyValue]) -> Any:
    """A ``cls`` (``StaticCache`` or a subclass) holding ``pairs``, already max_cache_len long."""
    cache_utils = _cache_utils()
    layers = [_filled(cache_utils.StaticLayer(max_cache_len=k.shape[2]), k, v) for k, v in pairs]
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
        return _dynamic_cache(checked)
    return _dynamic_cache(checked, _new_layers(checked, cls_layers, cls_kwargs))


def _new_layers(pairs: list[KeyValue], cls_layers: LayerClasses, cls_kwargs: LayerKwargs) -> list[Any]:
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
    cache_utils = _cache_utils()
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
        return [getattr(_cache_utils(), name)(**dict(arguments)) for name, arguments in self.layers]


def _dumpable(context: list[str] | MixedLayers) -> Any:
    """A flattening context as JSON (a repro saves the input tree)."""
    if isinstance(context, MixedLayers):
        return {"names": list(context.names), "layers": [[name, [list(a) for a in arguments]] for name, arguments in context.layers]}
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
    layer_type = _cache_utils().DynamicLayer
    if all(isinstance(layer, layer_type) and layer.keys is None for layer in cache.layers):
        return [], []  # nothing cached yet
    leaves, names = _flat_key_values(cache, layer_type, subclasses=True)
    if all(type(layer) is layer_type for layer in cache.layers):
        return leaves, names
    return leaves, MixedLayers.of(cache, names)


def _unflatten_dynamic_cache(leaves: Sequence[torch.Tensor], context: list[str] | MixedLayers) -> Any:
    layers = context.new_layers() if isinstance(context, MixedLayers) else None
    return _dynamic_cache(_pairs(leaves), layers)


def _flatten_static_cache(cache: Any) -> tuple[list[torch.Tensor], list[str]]:
    return _flat_key_values(cache, _cache_utils().StaticLayer)


def _unflatten_static_cache(cls: type, leaves: Sequence[torch.Tensor], context: list[str]) -> Any:
    return _static_cache(cls, _pairs(leaves))


def _flatten_encoder_decoder_cache(cache: Any) -> tuple[list[Any], list[str]]:
    return [getattr(cache, name) for name in _ENCODER_DECODER_FIELDS], _ENCODER_DECODER_FIELDS


def _unflatten_encoder_decoder_cache(children: Sequence[Any], context: list[str]) -> Any:
    return _cache_utils().EncoderDecoderCache(*children)


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
