"""The export cache: ONNX files keyed by everything they depend on.

A hit skips torch.export and the translation; verification still runs.  Code paths chosen by
environment variables or global state are not part of the key.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree

from ..core.configuration import configuration_text
from ..core.files import copy_atomic, write_atomic
from ..core.versions import package_versions
from ..shapes.model import ShapeModel
from .domain import Refinement

# What an entry holds; a change makes earlier entries miss (2: the conditions of runtime asserts
# among the refinements)
ENTRY_FORMAT = 2


@dataclass
class CacheEntry:
    """What an export left besides its ONNX file."""

    opset: int | None = None
    op_counts: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    refinements: list[Refinement] = field(default_factory=list)  # what the export established
    outputs: list[str] = field(default_factory=list)  # names of the graph's outputs


@dataclass(frozen=True)
class ExportCache:
    """A directory of ``<key>.onnx`` files and their ``<key>.json`` metadata; ``extra`` (the
    export patches) is part of every key."""

    directory: Path
    extra: tuple[str, ...] = ()

    def key(self, module: torch.nn.Module, method: str, shapes: ShapeModel, args: tuple, kwargs: dict) -> str:
        """Hash of what the ONNX file depends on: the classes of the model and its submodules
        (qualified names and source files), its configuration, the method exported, the constant
        arguments bound, the input structure (tree, dtypes, ranks) and its dynamic dims, the
        weights, package versions, patches and the entries' :data:`ENTRY_FORMAT`."""
        digest = hashlib.sha256()
        classes = sorted({f"{type(m).__module__}.{type(m).__qualname__}" for m in module.modules()})
        constants = sorted((k, repr(v)) for k, v in shapes.aligned.constants().items())
        described = [classes, method, shapes.aligned.leaf_names, constants, configuration_text(module)]
        digest.update(json.dumps(described).encode())
        for source in _source_files(module):
            digest.update(source.encode())
        for name, tensor in (*module.named_parameters(), *module.named_buffers()):
            digest.update(f"{name}:{tensor.dtype}:{tensor.layout}:{tuple(tensor.shape)}".encode())
            digest.update(tensor_bytes(tensor))
        digest.update(json.dumps(shapes.to_json(), sort_keys=True).encode())
        flat, spec = _pytree.tree_flatten((args, kwargs))
        digest.update(str(spec).encode())
        digest.update(repr([(t.dtype, tuple(t.shape)) if isinstance(t, torch.Tensor) else t for t in flat]).encode())
        digest.update(json.dumps([package_versions(), list(self.extra), ENTRY_FORMAT]).encode())
        return digest.hexdigest()[:32]

    def load(self, key: str, onnx_path: Path) -> CacheEntry | None:
        """Copy the entry to ``onnx_path`` when its metadata and file digest agree; else ``None``."""
        entry, meta_path = self.directory / f"{key}.onnx", self.directory / f"{key}.json"
        try:
            meta = json.loads(meta_path.read_text())
            if meta["sha256"] != _file_digest(entry):
                return None
            onnx_path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(entry, onnx_path)
            return CacheEntry(
                meta.get("opset"), meta.get("op_counts", {}), meta.get("notes", []),
                [Refinement.from_json(r) for r in meta.get("refinements", [])],
                meta.get("outputs", []),
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def store(self, key: str, onnx_path: Path, entry: CacheEntry) -> None:
        """Add ``onnx_path`` under ``key`` (atomically: a concurrent reader sees all or nothing)."""
        target = copy_atomic(onnx_path, self.directory / f"{key}.onnx")
        meta = {"sha256": _file_digest(target), "opset": entry.opset, "op_counts": entry.op_counts,
                "notes": entry.notes, "refinements": [r.to_json() for r in entry.refinements], "outputs": entry.outputs}
        write_atomic(self.directory / f"{key}.json", json.dumps(meta))


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The values of any tensor as bytes: 0-dim, non-contiguous, sparse, bfloat16 (which numpy
    lacks) included."""
    value = tensor.detach().cpu()
    if value.layout != torch.strided:
        value = value.to_dense()
    return value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _source_files(module: torch.nn.Module) -> list[str]:
    """Text of the files defining the classes of the module and its submodules (outside torch)."""
    classes = {cls for sub in module.modules() for cls in type(sub).__mro__}
    texts: dict[Any, str] = {}
    for cls in classes:
        if cls.__module__.startswith(("torch.", "builtins")) or cls is object:
            continue
        try:
            path = inspect.getsourcefile(cls)
            texts[path] = Path(path).read_text() if path else cls.__qualname__
        except (OSError, TypeError):
            texts[cls.__qualname__] = f"{cls.__module__}.{cls.__qualname__}"
    return [texts[k] for k in sorted(texts, key=str)]


def _file_digest(path: Path) -> str:
    """SHA-256 of the file, read in chunks (``hashlib.file_digest`` is Python 3.11+)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()

