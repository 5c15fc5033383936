"""The library API's user errors: ours are ``ValueError``s, torch.onnx.InputObserver's are
``RuntimeError``s; these classes are both, so that code written for either catches them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class ObserverError(ValueError, RuntimeError):
    """A call sequence, argument or option the observer cannot work with."""


class ObserverIndexError(IndexError, RuntimeError):
    """An index of a recorded call that does not exist."""


@contextlib.contextmanager
def user_errors(prefix: str = "") -> Iterator[None]:
    """Re-raise the ``ValueError``s of the lower layers as :class:`ObserverError`, the message
    preceded by ``prefix``."""
    try:
        yield
    except ObserverError:
        raise
    except ValueError as e:
        raise ObserverError(f"{prefix}{e}") from e
