"""The machine's problems while checking a model: files that cannot be written.

They are no verdict on the model: :func:`writing` turns an ``OSError`` into an
:class:`EnvironmentProblem`, which ``check_model`` reports with kind ``environment`` (the plugin
shows a session problem, never a model failure, and keeps it out of the baseline).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ...core.vocabulary import Stage


class EnvironmentProblem(Exception):
    """A file the check needs could not be written (permissions, disk full, a path in the way)."""

    def __init__(self, stage: Stage, message: str):
        super().__init__(message)
        self.stage = stage


@contextlib.contextmanager
def writing(stage: Stage, what: str) -> Iterator[None]:
    """Turn an ``OSError`` while writing ``what`` at ``stage`` into an :class:`EnvironmentProblem`."""
    try:
        yield
    except OSError as e:
        raise EnvironmentProblem(stage, f"cannot write {what}: {e}") from e
