"""Load an ExportedProgram the plugin saved (``--export-target torch``) in a fresh process.

``torch.export.load`` rebuilds the program's input and output trees from the registered name of
each node's type.  transformers registers its model outputs when their module is imported, which
its lazy ``import transformers`` does not do, and its caches are registered only inside
:func:`~.cache_pytrees.register_flattening_functions`; without them torch logs the missing type and
raises a generic error.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import zipfile
from typing import Any

import torch
import torch.utils._pytree as pytree

from .cache_pytrees import cache_registration

_TREE_TYPE = re.compile(r'type\\*"\s*:\s*\\*"([A-Za-z_][\w.]*\.[A-Za-z_]\w*)')  # in the (escaped) tree specs


def load_program(path: str | os.PathLike[str]) -> Any:
    """``torch.export.load(path)`` once the modules defining the program's tree types are
    imported; call the result's ``module()`` inside
    :func:`~.cache_pytrees.register_flattening_functions` when its inputs hold transformers caches."""
    for name in tree_types(path):
        if name not in pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE:
            with contextlib.suppress(ImportError):  # torch names the type it still misses
                importlib.import_module(name.rpartition(".")[0])
    with cache_registration():
        return torch.export.load(path)


def tree_types(path: str | os.PathLike[str]) -> set[str]:
    """The serialized names of the types in the saved program's input and output trees."""
    with zipfile.ZipFile(path) as archive:
        return {name for entry in archive.namelist() if "/models/" in entry and entry.endswith(".json")
                for name in _TREE_TYPE.findall(archive.read(entry).decode("utf-8", errors="replace"))}
