"""What torch.export traces a model under, and only torch.export: this package's export patches
(:mod:`..compat.export_patches`) and the user's (context-manager factories named by dotted paths).

Eager runs that the verdict compares with (references, probes, the eager side of variations) run
as the tests ran the model, without them; a patch that changes what eager computes is named by
:meth:`TracingPatches.changing`.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...compat.export_patches import named_export_patches
from ...core.trees import detached_clone
from ..base.eager import ModelRaised
from ..verify.compare import Tolerance, compare

Factory = Callable[[], contextlib.AbstractContextManager[Any]]


@dataclass(frozen=True)
class TracingPatches:
    """The patches torch.export runs under; ``paths``: the user's, by dotted path."""

    paths: tuple[str, ...] = ()
    factories: tuple[Factory, ...] = field(default=(), compare=False)

    @classmethod
    def resolved(cls, paths: tuple[str, ...]) -> TracingPatches:
        """The patches with the user's ``paths`` imported; raises ValueError naming a bad one."""
        return cls(paths, tuple(resolve(path) for path in paths))

    def named(self) -> list[tuple[str, Factory]]:
        """Every patch by name, this package's first (those that apply), then the user's."""
        return [*named_export_patches(), *zip(self.paths, self.factories)]

    @contextlib.contextmanager
    def tracing(self, only: str | None = None) -> Iterator[None]:
        """Every patch (or the one named ``only``) for the duration of the block."""
        with contextlib.ExitStack() as stack:
            for name, factory in self.named():
                if only is None or name == only:
                    stack.enter_context(factory())
            yield

    def changing(self, differs: Callable[[contextlib.AbstractContextManager[None]], bool]) -> str:
        """The name of the first patch under which ``differs(context)`` is true (eager, run within
        the context, differs from eager without it); ``"the export patches"`` when only all of
        them together make a difference, ``""`` when they make none."""
        if not differs(self.tracing()):
            return ""
        return next((name for name, _ in self.named() if differs(self.tracing(name))), "the export patches")

    def changing_outputs(
        self, eager: Callable[[list[Any]], Any], leaves: list[Any], expected: Sequence[Any], tolerance: Tolerance,
    ) -> str:
        """:meth:`changing` for ``eager`` run on (a copy of) ``leaves``: the patch under which it
        no longer gives ``expected`` within ``tolerance``, or raises."""

        def differs(patched: contextlib.AbstractContextManager[None]) -> bool:
            with patched:
                try:
                    outputs = eager(detached_clone(leaves))
                except ModelRaised:
                    return True
            return not compare(outputs, expected, tolerance).ok

        return self.changing(differs)


NO_PATCHES = TracingPatches()  # this package's export patches only


def resolve(path: str) -> Any:
    """The object at ``package.module.attribute`` (``package.module:attribute`` also works)."""
    module_name, _, attribute = path.replace(":", ".").rpartition(".")
    if not module_name:
        raise ValueError(f"export patch {path!r} is no dotted path module.attribute")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"export patch {path!r} cannot be imported: {e}") from e
