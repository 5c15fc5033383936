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
from torch._subclasses.fake_tensor import FakeTensor

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


def string_type(obj: Any, with_shape: bool = False, with_min_max: bool = False) -> str:
    """Describe ``obj`` in one line; never raises (an unknown object gives its class name).

    * tensor: ``T1s2x6`` with ``with_shape`` (``T1s`` for a scalar), else ``T1r2``;
      ``with_min_max`` appends ``[min,max:Amean]`` (``[empty]``, or ``=value`` for a scalar);
    * ``(a,b)`` a tuple, ``#2[a,b]`` a list, ``dict(a:T7s1x10)`` a dict, ``{0:...}`` one
      with int keys, ``Name(key:...)`` a dataclass or another mapping (``ModelOutput``);
    * ``None``, ``int``, ``float``, ``bool``, ``str`` (``int=5`` with ``with_min_max``);
    * ``DynamicCache(key_cache=#2[...], value_cache=#2[...])``, the same for the other
      caches, ``EncoderDecoderCache(self_attention_cache=..., cross_attention_cache=...)``.
    """
    return _Describer(with_shape, with_min_max).describe(obj)


@dataclasses.dataclass(frozen=True)
class _Describer:
    with_shape: bool
    with_min_max: bool

    def describe(self, obj: Any) -> str:
        if obj is None:
            return "None"
        if isinstance(obj, (bool, int, float)):
            name = next(t.__name__ for t in (bool, int, float) if isinstance(obj, t))
            return f"{name}={obj}" if self.with_min_max else name
        if isinstance(obj, str):
            return "str"
        if isinstance(obj, tuple):
            return self._tuple(obj)
        if isinstance(obj, list):
            return self._sequence(obj, "[", "]")
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, "F" if isinstance(obj, FakeTensor) else "T")
        numpy = sys.modules.get("numpy")
        if numpy is not None and isinstance(obj, numpy.ndarray):
            return self._array(obj)
        if isinstance(obj, torch.export.Dim):
            return f"Dim({obj.__name__})"
        if isinstance(obj, type(torch.export.Dim.DYNAMIC)):  # Dim.DYNAMIC, Dim.AUTO, Dim.STATIC
            return obj.type.name
        return self._structure(obj)

    def _structure(self, obj: Any) -> str:
        """Caches, mappings and dataclasses; the class name of anything else."""
        cache = _cache_fields(obj)
        if cache is not None:
            fields = ", ".join(f"{k}={self.describe(v)}" for k, v in cache.items())
            return f"{type(obj).__name__}({fields})"
        if type(obj) is dict:
            if not obj:
                return "{}"
            items = self._items(obj)
            return f"{{{items}}}" if all(isinstance(k, int) for k in obj) else f"dict({items})"
        if isinstance(obj, Mapping):
            return f"{type(obj).__name__}({self._items(obj)})"
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            values = {f.name: getattr(obj, f.name, None) for f in dataclasses.fields(obj)}
            kept = {k: v for k, v in values.items() if v is not None}
            return f"{type(obj).__name__}({self._items(kept)})"
        return type(obj).__name__

    def _items(self, mapping: Mapping[Any, Any]) -> str:
        return ",".join(f"{k}:{self.describe(v)}" for k, v in mapping.items())

    def _tuple(self, obj: tuple[Any, ...]) -> str:
        if len(obj) == 1:
            return f"({self.describe(obj[0])},)"
        return self._sequence(obj, "(", ")")

    def _sequence(self, obj: list[Any] | tuple[Any, ...], open_: str, close: str) -> str:
        if len(obj) >= _LONG:
            return f"#{len(obj)}{open_}{self.describe(obj[0])},...{close}"
        count = f"#{len(obj)}" if isinstance(obj, list) else ""
        return f"{count}{open_}{','.join(map(self.describe, obj))}{close}"

    def _tensor(self, tensor: torch.Tensor, prefix: str) -> str:
        element_type = _ONNX_ELEMENT_TYPES.get(str(tensor.dtype).removeprefix("torch."), "?")
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


def _cache_fields(obj: Any) -> dict[str, Any] | None:
    """The fields shown for a transformers cache, None when ``obj`` is not one."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    if cache_utils is None or not isinstance(obj, cache_utils.Cache):
        return None
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
