"""Observe every called instance of some classes (``--export-observe CLASS``), outermost calls only.

``__call__`` is replaced on the most general target classes (a class attribute, as
``nn.Module.__call__`` is; and on their subclasses that have a ``__call__`` of their own) from the
first :meth:`AutoObserve.calls` block until :meth:`AutoObserve.uninstall`, which restores it
exactly.  Inside a block, the first call of a target instance made by the block's thread outside
any other target call runs ``start(module)`` before the call proceeds, so that the caller can
begin recording it; calls made inside a target call (a ``LlamaModel`` inside a
``LlamaForCausalLM``), from another thread, while torch traces, or outside a block run the
original unobserved.  ``start`` failures are counted, never raised: the model is called exactly
once, as without observation.
"""

from __future__ import annotations

import contextlib
import fnmatch
import pkgutil
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .interception import tracing


def resolve_classes(paths: Iterable[str]) -> tuple[type[torch.nn.Module], ...]:
    """The classes named by dotted paths; ``ValueError`` naming the path when one cannot be
    imported or is no ``torch.nn.Module`` subclass."""
    return tuple(_resolve(path) for path in paths)


def _resolve(path: str) -> type[torch.nn.Module]:
    where = f"--export-observe / export_observe {path!r}"
    try:
        found = pkgutil.resolve_name(path)
    except Exception as e:  # ImportError, AttributeError, ValueError, or the imported module's own error
        raise ValueError(f"{where} cannot be imported: {type(e).__name__}: {e}") from None
    if not isinstance(found, type):
        raise ValueError(f"{where} is a {type(found).__name__}, not a class")
    if not issubclass(found, torch.nn.Module):
        raise ValueError(f"{where} is not a torch.nn.Module subclass")
    return found


def qualified_name(cls: type) -> str:
    """``module.qualname`` of a class, what exclusion patterns are matched against."""
    return f"{cls.__module__}.{cls.__qualname__}"


def most_general(classes: Iterable[type]) -> list[type]:
    """The classes none of the others is a base of (each once, in order)."""
    unique = list(dict.fromkeys(classes))
    return [c for c in unique if not any(o is not c and issubclass(c, o) for o in unique)]


def patched_classes(classes: Iterable[type]) -> list[type]:
    """Where ``__call__`` is replaced: on the most general classes, and on the classes below them
    (defined so far) that have their own ``__call__``, which would hide a replacement on a base."""
    general = most_general(classes)
    below = [sub for cls in general for sub in _subclasses(cls) if "__call__" in vars(sub)]
    return general + list(dict.fromkeys(below))


def _subclasses(cls: type) -> Iterator[type]:
    stack: list[type] = list(cls.__subclasses__())
    while stack:
        sub = stack.pop()
        yield sub
        stack.extend(sub.__subclasses__())


@dataclass
class AutoObserve:
    """The target classes, the class-name patterns excluded, and the failures of ``start``."""

    classes: tuple[type[torch.nn.Module], ...]
    exclude: tuple[str, ...] = ()
    failures: Counter[str] = field(default_factory=Counter)  # "Type: message" -> count
    _excluded: dict[type, bool] = field(default_factory=dict, repr=False)
    _patches: list[_Patch] = field(default_factory=list, repr=False)
    _block: _Block | None = field(default=None, repr=False)  # the block running, read by the replacements

    def excluded(self, cls: type) -> bool:
        found = self._excluded.get(cls)
        if found is None:
            name = qualified_name(cls)
            found = self._excluded[cls] = any(fnmatch.fnmatchcase(name, p) for p in self.exclude)
        return found

    @contextlib.contextmanager
    def calls(self, start: Callable[[torch.nn.Module], None]) -> Iterator[None]:
        """Call ``start(module)`` before the first outermost call of each target instance in the block.

        The first block installs the replacements, which stay until :meth:`uninstall` and only call
        the original outside a block: replacing a class attribute costs each later call of the
        class's instances more than the replacement does (CPython re-specializes their code)."""
        if not self._patches:
            self._patches = [_Patch(cls, self) for cls in patched_classes(self.classes)]
            for patch in self._patches:
                patch.install()
        self._block = _Block(self, start)
        try:
            yield
        finally:
            self._block = None

    def uninstall(self) -> None:
        """Give every patched class its ``__call__`` back."""
        for patch in reversed(self._patches):
            patch.restore()
        self._patches = []


@dataclass
class _Block:
    """The state of one block, shared by the replacements."""

    observer: AutoObserve
    start: Callable[[torch.nn.Module], None]
    thread: int = field(default_factory=threading.get_ident)
    depth: int = 0  # target calls in progress
    seen: dict[int, tuple[bool, torch.nn.Module]] = field(default_factory=dict)  # id -> (target?, kept alive)

    def first_call(self, module: torch.nn.Module) -> bool:
        """Whether ``module`` is a target (its class not excluded); ``start`` it if so."""
        target = False
        try:
            target = not self.observer.excluded(type(module))
            self.seen[id(module)] = (target, module)
            if target:
                self.start(module)
        except Exception as e:
            self.observer.failures[f"{type(e).__name__}: {e}"] += 1
        return target


@dataclass
class _Patch:
    """``__call__`` of one class replaced, and put back exactly as it was."""

    cls: type
    observer: AutoObserve
    own: Any = None  # the class's own ``__call__``, when it had one
    replacement: Any = None

    def install(self) -> None:
        self.own = vars(self.cls).get("__call__")
        self.replacement = _replacement(self.cls, self.own, self.observer)
        self.cls.__call__ = self.replacement  # type: ignore[method-assign]  # the patch itself

    def restore(self) -> None:
        """Give the class its attribute back, unless someone replaced ours meanwhile."""
        if vars(self.cls).get("__call__") is not self.replacement:
            return
        if self.own is not None:
            self.cls.__call__ = self.own  # type: ignore[method-assign]
        else:
            delattr(self.cls, "__call__")


def _replacement(cls: type, own: Any, observer: AutoObserve) -> Callable[..., Any]:
    # Without an own ``__call__``, the inherited one is looked up at each call in the live
    # namespace of the class defining it (torch.fx's tracer patches ``nn.Module.__call__``).
    namespace = vars(next(k for k in cls.__mro__[1:] if "__call__" in vars(k))) if own is None else None
    get_ident = threading.get_ident

    def __call__(module: Any, *args: Any, **kwargs: Any) -> Any:
        original = own if namespace is None else namespace["__call__"]
        block = observer._block
        # tracing() before the block's state: a tracer (dynamo inlines this function) reads no more
        if block is None or tracing() or block.depth or block.thread != get_ident():
            return original(module, *args, **kwargs)
        entry = block.seen.get(id(module))
        if not (block.first_call(module) if entry is None else entry[0]):
            return original(module, *args, **kwargs)
        block.depth += 1
        try:
            return original(module, *args, **kwargs)
        finally:
            block.depth -= 1

    __call__.__qualname__ = f"{cls.__qualname__}.__call__"
    return __call__
