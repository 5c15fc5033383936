"""What the export cache's keys read of a model and its calls: digests of the classes, configuration
and weights' layout of a module, of a call's structure, of tensors' values and of the plugin's own
code (see :mod:`.cache`)."""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree

from ...core.configuration import computation, configuration_text
from ...observe.binding import value_text


def module_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers by qualified name, tied ones under each of their names (the names
    torch.export gives the program's state and torch.onnx its initializers)."""
    return {**dict(module.named_parameters(remove_duplicate=False)),
            **dict(module.named_buffers(remove_duplicate=False))}


def module_digest(module: torch.nn.Module) -> Any:
    """A SHA-256 object fed with what a trace of ``module`` depends on but its inputs: the classes
    of the model and its submodules (qualified names and source files), its configuration, what
    its submodules compute with besides their weights (see :func:`~...core.configuration.computation`),
    the names, dtypes and shapes of the weights (not their values) and the values of tensors held
    as plain attributes."""
    digest = hashlib.sha256()
    classes = sorted({f"{type(m).__module__}.{type(m).__qualname__}" for m in module.modules()})
    digest.update(json.dumps([classes, configuration_text(module), computation(module, constants=True)]).encode())
    for source in _source_files(module):
        digest.update(source.encode())
    for name, tensor in module_state(module).items():
        digest.update(f"{name}:{tensor.dtype}:{tensor.layout}:{tuple(tensor.shape)}".encode())
    for name, tensor in _tensor_attributes(module):
        digest.update(name.encode())
        digest.update(tensor_bytes(tensor))
    return digest


def call_structure(args: tuple, kwargs: dict) -> str:
    """The tree of ``args`` and ``kwargs``, tensors by dtype and shape, other leaves by value
    (an opaque object by type): what the keys read of a call."""
    flat, spec = _pytree.tree_flatten((args, kwargs))
    described = [repr((t.dtype, tuple(t.shape))) if isinstance(t, torch.Tensor) else value_text(t) for t in flat]
    return f"{spec}[{', '.join(described)}]"


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The values of any tensor as bytes, without a copy of a contiguous one: 0-dim,
    non-contiguous, sparse, bfloat16 (which numpy lacks) included."""
    value = tensor.detach().cpu()
    if value.layout != torch.strided:
        value = value.to_dense()
    return value.contiguous().reshape(-1).view(torch.uint8).numpy().data


def _tensor_attributes(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Tensors held as plain attributes (neither parameters nor buffers): torch.export lifts
    them into the program as constants, with their values."""
    return [(f"{prefix}.{name}", value) for prefix, sub in module.named_modules(remove_duplicate=False)
            for name, value in vars(sub).items() if isinstance(value, torch.Tensor)]


def _source_files(module: torch.nn.Module) -> list[str]:
    """Text of the files defining the classes of the module and its submodules (outside torch)."""
    classes = {cls for sub in module.modules() for cls in type(sub).__mro__}
    texts: dict[Any, str] = {}
    for cls in classes:
        if cls.__module__.startswith(("torch.", "builtins")) or cls is object:
            continue
        try:
            path = inspect.getsourcefile(cls)
            texts[path] = _source_text(path) if path else cls.__qualname__
        except (OSError, TypeError):
            texts[cls.__qualname__] = f"{cls.__module__}.{cls.__qualname__}"
    return [texts[k] for k in sorted(texts, key=str)]


@functools.cache
def plugin_digest() -> str:
    """Digest of the plugin's own source files, read once per process."""
    digest = hashlib.sha256()
    package = Path(__file__).parents[2]
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.cache
def _source_text(path: str) -> str:
    """A source file's text, read once per process: the code a process runs is the code it
    imported, whatever happens to the file afterwards."""
    return Path(path).read_text()
