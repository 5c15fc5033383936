"""Export patches: context managers named by dotted paths, entered around export and verification."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def entered(factories: list[Callable[[], contextlib.AbstractContextManager]]) -> Iterator[None]:
    """Enter the context managers the factories make (see :func:`resolve`)."""
    with contextlib.ExitStack() as stack:
        for factory in factories:
            stack.enter_context(factory())
        yield


def resolve(path: str) -> Any:
    """The object at ``package.module.attribute`` (``package.module:attribute`` also works)."""
    module_name, _, attribute = path.replace(":", ".").rpartition(".")
    if not module_name:
        raise ValueError(f"export patch {path!r} is no dotted path module.attribute")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"export patch {path!r} cannot be imported: {e}") from e
