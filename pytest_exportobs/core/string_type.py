"""A one-line description of nested inputs and outputs: ``string_type``.

The format is the one of onnx-diagnostic, e.g. ``(T1s2x6,#2[T7s1,None],dict(a:int))``:
``T`` a tensor, ``A`` a numpy array, ``F`` a fake tensor, followed by the element type as an
``onnx.TensorProto`` number and either ``s`` + the shape or ``r`` + the rank.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from typing import Any

import torch

from ..compat.torch_private import is_fake_tensor

_ONNX_ELEMENT_TYPES = {  # dtype name -> onnx.TensorProto data type
    "float32": 1,
    "uint8": 2,
    "int8": 3,
    "uint16": 4,
    "int16": 5,
    "int32": 6,
    "int64": 7,
    "bool": 9,
    "float16": 10,
    "float64": 11,
    "uint32": 12,
    "uint64": 13,
    "complex64": 14,
    "complex128": 15,
    "bfloat16": 16,
    "float8_e4m3fn": 17,
    "float8_e4m3fnuz": 18,
    "float8_e5m2": 19,
    "float8_e5m2fnuz": 20,
}
_LONG = 20  # sequences this long show their first element only: ``#25[T1s2,...]``
_LONG_SET = 10  # sets this large show their size only: ``{...}``
_DIM_HINT = type(torch.export.Dim.DYNAMIC)  # Dim.DYNAMIC, Dim.AUTO, Dim.STATIC
_DERIVED_DIM = getattr(torch.export.dynamic_shapes, "_DerivedDim", ())  # ``Dim("b") * 2``
_NAMED_TYPES = (torch.device, torch.dtype, torch.memory_format, torch.layout)
_TENSOR_LIKE_FIELDS = ("name", "dtype", "shape", "device")  # shown for an object describing a tensor


def string_type(
    obj: Any,
    with_shape: bool = False,
    with_min_max: bool = False,
    with_device: bool = False,
    ignore: bool = False,
    limit: int = _LONG,
    verbose: int = 0,
) -> str:
    """Describe ``obj`` in one line; never raises (an unknown object gives ``Name(...)``).

    * tensor: ``T1s2x6`` with ``with_shape`` (``T1s`` for a scalar), else ``T1r2``;
      ``with_min_max`` appends ``[min,max:Amean]`` (``[empty]``, or ``=value`` for a scalar);
      ``with_device`` prefixes ``C`` (CPU) or ``G`` (GPU);
    * ``(a,b)`` a tuple, ``#2[a,b]`` a list, ``{a,b}`` a set, ``dict(a:T7s1x10)`` a dict,
      ``{0:...}`` one with int keys, ``Name(key:...)`` a dataclass or another mapping
      (``ModelOutput``); sequences of ``limit`` items or more show their first one
      (``#25[int,...]``, with ``with_min_max`` and numbers ``#25[int=0,...][0,24:12.0]``);
    * ``None``, ``int``, ``float``, ``bool``, ``str`` (``int=5`` with ``with_min_max``);
    * dynamic shapes: ``{0:DYNAMIC,1:Dim(batch),2:DYN(seq)}``, ``DerivedDim``;
    * ``DynamicCache(key_cache=#2[...], value_cache=#2[...])``, the same for the other
      caches, ``DynamicCache(DynamicLayer(k, v), DynamicSlidingWindowLayer(k, v))`` for
      mixed layers, ``DynamicLayer(keys=..., values=...)``,
      ``EncoderDecoderCache(self_attention_cache=..., cross_attention_cache=...)``.

    ``ignore`` and ``verbose`` are accepted for onnx-diagnostic compatibility: this function
    never raises, so there is nothing to ignore.
    """
    return _Describer(with_shape, with_min_max, with_device, limit).describe(obj)


@dataclasses.dataclass(frozen=True)
class _Describer:
    with_shape: bool
    with_min_max: bool
    with_device: bool = False
    limit: int = _LONG

    def describe(self, obj: Any) -> str:
        if obj is None:
            return "None"
        if isinstance(obj, (bool, int, float)):
            name = next(t.__name__ for t in (bool, int, float) if isinstance(obj, t))
            return f"{name}={obj}" if self.with_min_max else name
        if isinstance(obj, (str, slice)):
            return type(obj).__name__
        if isinstance(obj, tuple):
            return self._tuple(obj)
        if isinstance(obj, list):
            return self._sequence(obj, "[", "]")
        if isinstance(obj, (set, frozenset)):
            return self._set(obj)
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, "F" if is_fake_tensor(obj) else "T")
        numpy = sys.modules.get("numpy")
        if numpy is not None and isinstance(obj, numpy.ndarray):
            return self._array(obj)
        return _symbol(obj) or self._structure(obj)

    def _structure(self, obj: Any) -> str:
        """Caches, mappings and dataclasses; ``Name(...)`` for anything else."""
        cache = _cache_fields(obj)
        if isinstance(cache, list):  # layers of different classes
            layers = ", ".join(
                f"{type(layer).__name__}({self.describe(layer.keys)}, {self.describe(layer.values)})"
                for layer in cache
            )
            return f"{type(obj).__name__}({layers})"
        if cache is not None:
            fields = ", ".join(f"{k}={self.describe(v)}" for k, v in cache.items())
            return f"{type(obj).__name__}({fields})"
        if type(obj) is dict:
            return self._dict(obj)
        if isinstance(obj, Mapping):
            return f"{type(obj).__name__}({self._items(obj)})"
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            values = {f.name: getattr(obj, f.name, None) for f in dataclasses.fields(obj)}
            kept = {k: v for k, v in values.items() if v is not None}
            return f"{type(obj).__name__}({self._items(kept)})"
        if isinstance(obj, _NAMED_TYPES):
            return f"{type(obj).__name__}({obj})"
        described = [(a, getattr(obj, a)) for a in _TENSOR_LIKE_FIELDS if hasattr(obj, a)]
        if {"dtype", "shape"} <= {a for a, _ in described}:  # a tensor described, not held (VirtualTensor)
            return f"{type(obj).__name__}({', '.join(f'{a}={_field(v)}' for a, v in described)})"
        return f"{type(obj).__name__}(...)"

    def _dict(self, obj: dict[Any, Any]) -> str:
        """``{}``, ``{0:DYN(seq)}`` for the dynamic shapes of a tensor, ``{0:...}``, ``dict(a:...)``."""
        if not obj:
            return "{}"
        if all(isinstance(k, int) for k in obj) and all(
            isinstance(v, (str, torch.export.Dim, _DIM_HINT)) for v in obj.values()
        ):
            return "{" + ",".join(
                f"{k}:DYN({v})" if isinstance(v, str) else f"{k}:{self.describe(v)}"
                for k, v in obj.items()
            ) + "}"
        items = self._items(obj)
        return f"{{{items}}}" if all(isinstance(k, int) for k in obj) else f"dict({items})"

    def _items(self, mapping: Mapping[Any, Any]) -> str:
        return ",".join(f"{k}:{self.describe(v)}" for k, v in mapping.items())

    def _tuple(self, obj: tuple[Any, ...]) -> str:
        if len(obj) == 1:
            return f"({self.describe(obj[0])},)"
        return self._sequence(obj, "(", ")")

    def _sequence(self, obj: list[Any] | tuple[Any, ...], open_: str, close: str) -> str:
        if len(obj) < self.limit:
            count = f"#{len(obj)}" if isinstance(obj, list) else ""
            return f"{count}{open_}{','.join(map(self.describe, obj))}{close}"
        text = f"#{len(obj)}{open_}{self.describe(obj[0])},...{close}"
        if self.with_min_max and _all_numbers(obj):
            mean = f"A[{_mean(obj)}]" if isinstance(obj, tuple) else f"{_mean(obj)}"
            text += f"[{min(obj)},{max(obj)}:{mean}]"  # onnx-diagnostic's spelling
        return text

    def _set(self, obj: set[Any] | frozenset[Any]) -> str:
        if len(obj) < _LONG_SET:
            return f"{{{','.join(map(self.describe, obj))}}}"
        if self.with_min_max and _all_numbers(obj):
            return f"{{...}}#{len(obj)}[{min(obj)},{max(obj)}:A{_mean(obj)}]"
        return f"{{...}}#{len(obj)}" if self.with_shape else "{...}"

    def _tensor(self, tensor: torch.Tensor, prefix: str) -> str:
        element_type = _ONNX_ELEMENT_TYPES.get(str(tensor.dtype).removeprefix("torch."), "?")
        if self.with_device:
            prefix = ("G" if tensor.get_device() >= 0 else "C") + prefix
        if self.with_shape:
            text = f"{prefix}{element_type}s{'x'.join(map(str, tensor.shape))}"
        else:
            text = f"{prefix}{element_type}r{tensor.dim()}"
        if self.with_min_max:
            text += _statistics(tensor)
        return text

    def _array(self, array: Any) -> str:
        try:
            tensor = torch.from_numpy(array)
        except TypeError:  # a dtype torch does not have
            return type(array).__name__
        return self._tensor(tensor, "A")


def _field(value: Any) -> str:
    """A tensor-like object's field as its ``repr``, a dtype as its name (``float32``)."""
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else repr(value)


def _symbol(obj: Any) -> str | None:
    """Dims, dim hints and symbolic sizes; ``None`` for anything else."""
    if isinstance(obj, _DERIVED_DIM):
        return "DerivedDim"
    if isinstance(obj, torch.export.Dim):
        return f"Dim({obj.__name__})"
    if isinstance(obj, _DIM_HINT):
        return obj.type.name
    if isinstance(obj, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return type(obj).__name__
    return None


def _all_numbers(values: Any) -> bool:
    return all(isinstance(v, (int, float)) for v in values)


def _mean(values: Any) -> float:
    return sum(float(v) for v in values) / len(values)


def _statistics(tensor: torch.Tensor) -> str:
    """``=value`` for a scalar, ``[empty]``, ``[min,max:Amean]`` (+ ``N<n>nans``), or nothing
    for a tensor whose values cannot be read (fake, meta, sparse, ...)."""
    try:
        return _read_statistics(tensor)
    except (RuntimeError, NotImplementedError):
        return ""


def _read_statistics(tensor: torch.Tensor) -> str:
    if tensor.dim() == 0:
        return f"={tensor.item()}"
    if tensor.numel() == 0:
        return "[empty]"
    values = tensor.detach().reshape(-1)
    if values.is_complex():
        values = values.abs()
    nans = int(values.isnan().sum()) if values.is_floating_point() else 0
    if nans:
        values = values[~values.isnan()]
        if values.numel() == 0:
            return f"[N{nans}nans]"
    mean = values.to(torch.float64).mean().item()
    suffix = f"N{nans}nans" if nans else ""
    return f"[{values.min().item()},{values.max().item()}:A{mean}{suffix}]"


def _cache_fields(obj: Any) -> dict[str, Any] | list[Any] | None:
    """The fields shown for a transformers cache or cache layer, the layers of a
    ``DynamicCache`` whose layers are not all ``DynamicLayer``, None for anything else."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    if cache_utils is None:
        return None
    layer_class = getattr(cache_utils, "CacheLayerMixin", None)
    if layer_class is not None and isinstance(obj, layer_class):
        return {"keys": obj.keys, "values": obj.values}
    if not isinstance(obj, cache_utils.Cache):
        return None
    if type(obj) is cache_utils.DynamicCache and any(
        type(layer) is not cache_utils.DynamicLayer for layer in obj.layers
    ):
        return list(obj.layers)
    if isinstance(obj, cache_utils.EncoderDecoderCache):
        return {
            "self_attention_cache": obj.self_attention_cache,
            "cross_attention_cache": obj.cross_attention_cache,
        }
    layers = [
        layer for layer in getattr(obj, "layers", []) if getattr(layer, "keys", None) is not None
    ]
    return {
        "key_cache": [layer.keys for layer in layers],
        "value_cache": [layer.values for layer in layers],
    }
