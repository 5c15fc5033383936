"""The kept models' weights on disk while forked checks run.

A forked child maps every resident page of its parent, so each check's memory counts the
weights of every model the session kept, not only its own.  Before forking, the parent writes
the CPU tensors of each group's module (and the weights it was first observed with) to a file of
the group's own and gives each tensor a one-element stand-in of its shape (``tensor.data =
...``: the same tensor objects, version counters untouched, so recorded calls still count as
made with these weights).  A child points its group's tensors at the group's file,
memory-mapped: only what its check reads is loaded.  The parent points every tensor back once
the checks are over: nothing is lost.  What the parent freed is given back to the system before
it forks (:func:`return_free_memory`).
"""

from __future__ import annotations

import ctypes
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..observe.store import ModelGroup

Spilled = dict[str, torch.Tensor]  # a group's tensors by their key in its file


@dataclass(frozen=True)
class SpilledWeights:
    """A directory of one file per group (by ``id``), the group's tensors stand-ins meanwhile."""

    directory: Path
    files: dict[int, tuple[Path, Spilled]]

    @classmethod
    def spill(cls, groups: Iterable[ModelGroup], directory: Path) -> SpilledWeights | None:
        """Spill the weights of ``groups`` into a new directory in ``directory``; ``None``
        (nothing spilled) when there are none or they cannot be written."""
        groups = list(groups)
        held = {id(group): {str(i): t for i, t in enumerate(_spillable(group))} for group in groups}
        if not any(held.values()):
            return None
        files: dict[int, tuple[Path, Spilled]] = {}
        try:
            directory.mkdir(parents=True, exist_ok=True)
            spill_directory = Path(tempfile.mkdtemp(prefix="weights-", dir=directory))
        except OSError:
            return None
        try:
            for position, group in enumerate(groups):
                if tensors := held[id(group)]:
                    path = spill_directory / f"{position}.pt"
                    torch.save({key: tensor.data for key, tensor in tensors.items()}, path)
                    files[id(group)] = (path, tensors)
        except (OSError, RuntimeError):
            shutil.rmtree(spill_directory, ignore_errors=True)
            return None
        for _, tensors in files.values():
            for tensor in tensors.values():
                tensor.data = torch.zeros((), dtype=tensor.dtype).expand(tensor.shape)
        return cls(spill_directory, files)

    def restore(self, group: ModelGroup | None = None) -> None:
        """Point the tensors of ``group`` (``None``: of every group) at their values in its
        file, memory-mapped."""
        if group is None:
            chosen = list(self.files.values())
        else:
            chosen = [self.files[id(group)]] if id(group) in self.files else []
        for path, tensors in chosen:
            stored = torch.load(path, mmap=True, weights_only=True)
            for key, tensor in tensors.items():
                tensor.data = stored[key]

    def remove(self) -> None:
        """Restore every tensor and delete the files (the mappings outlive them)."""
        self.restore()
        shutil.rmtree(self.directory, ignore_errors=True)


def return_free_memory() -> None:
    """Give the C heap's free pages back to the system before forking (glibc's ``malloc_trim``;
    elsewhere nothing): a forked child maps every resident page of its parent, so what the
    suite freed but the allocator kept (the gradients of trained models...) would count again in
    each check's memory."""
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return
    malloc_trim(0)


def _spillable(group: ModelGroup) -> list[torch.Tensor]:
    """The plain CPU tensors holding the group's weights, each once."""
    found: dict[int, torch.Tensor] = {}
    for tensor in (*group.module.parameters(), *group.module.buffers(), *group.weights.values()):
        data = tensor.data
        plain = type(data) is torch.Tensor and data.layout == torch.strided and not data.is_quantized
        if plain and data.device.type == "cpu":
            found.setdefault(id(tensor), tensor)
    return list(found.values())
