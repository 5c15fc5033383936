"""A group's kept module, packed away once the tests no longer reach it.

A session keeps the first instance of every model it observes until its checks, and every full
collection of the garbage collector walks the objects of each (a tiny UNet: 3,300 of them,
modules, their dicts and hooks, parameters).  A suite that calls ``gc.collect()`` after each test
pays that walk hundreds of times (diffusers' model tests: 272 full collections for 937 tests, 56
models kept).  Once only its group holds the module, nothing can call or change it before the checks,
so :meth:`KeptModule.pack` pickles it with the weights it was first observed with, the tensors'
storages by reference (kept aside as they are: no copy), into one bytes object the collector does
not walk, and lets its objects go; the first read of :attr:`KeptModule.module` unpacks it onto the
same storages.  What the recorded calls refer to survives the round trip: the instance they were made
on (:attr:`KeptModule.instance`) and the digest of its weights (:meth:`KeptModule.digest`, taken
when packed: unpacked tensors count no past in-place update).
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from ..compat.transformers_hooks import without_output_capturing_hooks
from ..core.trees import on_meta_device
from .weights import weights_digest

PACKED_INSTANCE = -1  # KeptModule.instance once packed: the id of no live object


class KeptModule:
    """The module a group exports and the weights it was first observed with, held as is or packed."""

    def __init__(self, module: torch.nn.Module, weights: dict[str, torch.Tensor]):
        self._module: torch.nn.Module | None = module
        self._weights = weights
        self._packed: bytes | None = None
        self._storages: list[Any] = []  # of the packed tensors, by reference
        self._digest: int | None = None  # of the weights when packed
        self._meta_when_packed = False  # whether the packed module held a tensor on the meta device
        self.cls: type[torch.nn.Module] = type(module)
        self.instance = id(module)  # what Observation.instance holds for calls made on this module
        self.packable = True  # False once pickling failed: the module stays as is

    @property
    def module(self) -> torch.nn.Module:
        self._unpack()
        assert self._module is not None
        return self._module

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        """The parameters and buffers as first observed, by name (see :func:`.store.held_weights`)."""
        self._unpack()
        return self._weights

    @property
    def packed(self) -> bool:
        return self._packed is not None

    @property
    def on_meta(self) -> bool:
        """Whether the module holds a tensor on the meta device (a packed one: as packed)."""
        return self._meta_when_packed if self._packed is not None else on_meta_device(self.module)

    def digest(self) -> int:
        """The digest of the module's weights (see :func:`.weights.weights_digest`): as packed,
        once it was."""
        return weights_digest(self.module) if self._digest is None else self._digest

    def pack(self) -> bool:
        """Pickle the module and its first weights together, their storages by reference (no
        copy: shared storages stay shared), and let them go; only call when nothing but the group
        reaches the module.  A module on the meta device (timm's tests build a model there for
        its configuration alone) is packed too: nothing to set aside, all of its objects out of
        the collector's walk.  ``False`` when the module was packed before or cannot be pickled
        (it stays as is)."""
        if self._module is None or self._digest is not None or not self.packable:
            return False
        buffer, storages = io.BytesIO(), list[Any]()
        try:
            with without_output_capturing_hooks(self._module):
                _StoragesAside(buffer, storages).dump((self._module, self._weights))
        except Exception:  # a local class, a closure in a hook, a lock...: pickle's errors vary
            self.packable = False
            return False
        self._digest, self._meta_when_packed = weights_digest(self._module), on_meta_device(self._module)
        self._packed, self._storages, self._module, self._weights = buffer.getvalue(), storages, None, {}
        self.instance = PACKED_INSTANCE
        return True

    def _unpack(self) -> None:
        if self._packed is not None:
            self._module, self._weights = _StoragesBack(io.BytesIO(self._packed), self._storages).load()
            self._packed, self._storages = None, []


class _StoragesAside(pickle.Pickler):
    """Pickles the tensors' storages by reference: each untyped storage is appended to
    ``storages`` once, as it is (a typed one is pickled as its untyped storage and dtype): every
    object kept aside is one more the garbage collector walks (a tiny UNet's: 800 typed wrappers
    of 300 storages)."""

    def __init__(self, file: io.BytesIO, storages: list[Any]):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.storages = storages
        self._indices: dict[int, int] = {}  # id of an untyped storage -> its index in storages

    def persistent_id(self, obj: Any) -> tuple[int, torch.dtype | None] | None:
        if isinstance(obj, torch.storage.TypedStorage):
            return self._index(obj._untyped_storage), obj.dtype
        if isinstance(obj, torch.UntypedStorage):
            return self._index(obj), None
        return None

    def _index(self, storage: torch.UntypedStorage) -> int:
        if id(storage) not in self._indices:
            self._indices[id(storage)] = len(self.storages)
            self.storages.append(storage)
        return self._indices[id(storage)]


class _StoragesBack(pickle.Unpickler):
    """Unpickles what :class:`_StoragesAside` pickled, onto the storages it set aside."""

    def __init__(self, file: io.BytesIO, storages: list[Any]):
        super().__init__(file)
        self.storages = storages

    def persistent_load(self, pid: tuple[int, torch.dtype | None]) -> Any:
        index, dtype = pid
        if dtype is None:
            return self.storages[index]
        return torch.storage.TypedStorage(wrap_storage=self.storages[index], dtype=dtype, _internal=True)
