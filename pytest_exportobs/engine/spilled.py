"""The kept models' weights on disk while forked checks run.

A forked child maps every resident page of its parent, so each check's memory counts the
weights of every model the session kept, not only its own.  Before forking, the parent writes
the CPU tensors of each group's module (and the weights it was first observed with) to a file of
the group's own and gives each tensor a one-element stand-in of its shape (``tensor.data =
...``: the same tensor objects, version counters untouched, so recorded calls still count as
made with these weights).  A child points each group's tensors at the group's file for the
group's check, memory-mapped (only what the check reads is loaded), and at stand-ins again
after it.  The parent points a group's tensors back as soon as its check is over, those of the
groups left once the checks are: nothing is lost.  What
the parent freed is given back to the system before it forks (:func:`return_free_memory`).
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
        spilled = cls(spill_directory, files)
        spilled.release()
        return spilled

    def restore(self, group: ModelGroup | None = None) -> None:
        """Point the tensors of ``group`` (``None``: of every group) at their values in its
        file, memory-mapped."""
        for path, tensors in self._of(group):
            stored = torch.load(path, mmap=True, weights_only=True)
            for key, tensor in tensors.items():
                tensor.data = stored[key]

    def release(self, group: ModelGroup | None = None) -> None:
        """Give the tensors of ``group`` (``None``: of every group) one-element stand-ins of their
        shapes again: a child checking several groups in turn keeps none of its earlier groups'
        pages."""
        for _, tensors in self._of(group):
            for tensor in tensors.values():
                tensor.data = torch.zeros((), dtype=tensor.dtype).expand(tensor.shape)

    def give_back(self, group: ModelGroup) -> None:
        """Point the tensors of ``group``, whose check is over, at their values for good
        (:meth:`remove` leaves them as they are)."""
        self.restore(group)
        self.files.pop(id(group), None)

    def _of(self, group: ModelGroup | None) -> list[tuple[Path, Spilled]]:
        """The files and tensors of ``group``, or of every group (``None``)."""
        if group is None:
            return list(self.files.values())
        return [self.files[id(group)]] if id(group) in self.files else []

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
