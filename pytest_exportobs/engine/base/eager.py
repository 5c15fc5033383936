"""The model's own calls inside the engine: what such a call raises is the model's answer (it
rejects these inputs), never the engine's failure; everything around it may fail loudly.  None of
them leaves the model changed (:func:`attributes_kept`)."""

from __future__ import annotations

import collections
import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ...core.text import error_line

_TABLES = (dict, collections.OrderedDict, set)  # what a module's attributes hold entries in: torch's tables, hooks


class ModelRaised(Exception):
    """The model's call raised; the original error is the cause."""

    def __init__(self, error: Exception):
        super().__init__(error_line(error))
        self.error = error


def call_model(method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``method(*args, **kwargs)``, its exceptions raised as :class:`ModelRaised`, the attributes
    of its module (the method's, or the module called) kept as they were."""
    owner = method if isinstance(method, torch.nn.Module) else getattr(method, "__self__", None)
    try:
        with attributes_kept(owner):
            return method(*args, **kwargs)
    except Exception as e:
        raise ModelRaised(e) from e


@contextlib.contextmanager
def attributes_kept(module: object) -> Iterator[None]:
    """What the block does to the attributes of ``module`` and its submodules (a
    ``torch.nn.Module``; anything else is left alone) undone at its end: attributes assigned,
    added or deleted, and entries of the dicts and sets they hold (parameters, buffers, submodules
    and hooks among them).  A forward that sets attributes from its input's sizes would otherwise
    carry every size the engine tries into the model's later calls: Swin's layers take the side
    they see as their window when it is no larger than theirs, and keep it (after one call at
    8×8, its calls at 32×32, the tests' own size, fail).  A forward that installs hooks once and
    flags it (transformers' output capturing) is undone whole, flag and hooks, so that its next
    call installs them once again.  Tensors and lists changed in place stay changed.  (A trace
    needs none of it: torch.export puts back the attributes it finds assigned, with copies of the
    containers they held.)"""
    if not isinstance(module, torch.nn.Module):
        yield
        return
    saved = [_Attributes(m) for m in module.modules()]
    try:
        yield
    finally:
        for attributes in saved:
            attributes.restore()


class _Attributes:
    """A module's ``__dict__`` as it was, and the entries of the dicts and sets it held."""

    def __init__(self, module: torch.nn.Module):
        self.now = vars(module)
        self.before = dict(self.now)
        self.tables = [(table, copy.copy(table)) for table in self.before.values() if type(table) in _TABLES]

    def restore(self) -> None:
        for table, entries in self.tables:
            if _changed(table, entries):
                table.clear()
                table.update(entries)
        if _changed(self.now, self.before):
            self.now.clear()
            self.now.update(self.before)


def _changed(now: Any, before: Any) -> bool:
    """Whether an entry of the dict or set ``now`` was added, removed or (a dict's) rebound."""
    if isinstance(now, set):
        return bool(now != before)
    return bool(now.keys() != before.keys() or any(now[key] is not value for key, value in before.items()))
