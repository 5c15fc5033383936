"""The export cache: ONNX files keyed by everything they depend on.

A hit skips torch.export and the translation; verification still runs.  Code paths chosen by
environment variables or global state are not part of the key.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree

from ..core.versions import package_versions
from ..shapes.model import ShapeModel


@dataclass
class CacheEntry:
    """What an export left besides its ONNX file."""

    opset: int | None = None
    op_counts: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    equalities: list[tuple[str, str]] = field(default_factory=list)


@dataclass(frozen=True)
class ExportCache:
    """A directory of ``<key>.onnx`` files and their ``<key>.json`` metadata; ``extra`` (the
    export patches) is part of every key."""

    directory: Path
    extra: tuple[str, ...] = ()

    def key(self, module: torch.nn.Module, shapes: ShapeModel, args: tuple, kwargs: dict) -> str:
        """Hash of what the ONNX file depends on: the source files of the model's classes, its
        weights, shapes, package versions and patches."""
        digest = hashlib.sha256()
        for source in _source_files(module):
            digest.update(source.encode())
        for name, tensor in (*module.named_parameters(), *module.named_buffers()):
            digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
            digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        digest.update(json.dumps(shapes.to_json(), sort_keys=True).encode())
        leaves = _pytree.tree_leaves((args, kwargs))
        digest.update(repr([(t.dtype, tuple(t.shape)) if isinstance(t, torch.Tensor) else t for t in leaves]).encode())
        digest.update(json.dumps([package_versions(), list(self.extra)]).encode())
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
                [tuple(pair) for pair in meta.get("equalities", [])],
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def store(self, key: str, onnx_path: Path, entry: CacheEntry) -> None:
        """Add ``onnx_path`` under ``key`` (atomically: a concurrent reader sees all or nothing)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        target = self.directory / f"{key}.onnx"
        _atomic_copy(onnx_path, target)
        meta = {"sha256": _file_digest(target), "opset": entry.opset, "op_counts": entry.op_counts,
                "notes": entry.notes, "equalities": entry.equalities}
        with tempfile.NamedTemporaryFile("w", dir=self.directory, delete=False, suffix=".tmp") as f:
            json.dump(meta, f)
        os.replace(f.name, self.directory / f"{key}.json")


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
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _atomic_copy(source: Path, target: Path) -> None:
    with tempfile.NamedTemporaryFile(dir=target.parent, delete=False, suffix=".tmp") as f:
        temp = Path(f.name)
    shutil.copyfile(source, temp)
    os.replace(temp, target)
