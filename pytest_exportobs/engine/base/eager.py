"""The model's own calls inside the engine: what such a call raises is the model's answer (it
rejects these inputs), never the engine's failure; everything around it may fail loudly."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...core.text import error_line


class ModelRaised(Exception):
    """The model's call raised; the original error is the cause."""

    def __init__(self, error: Exception):
        super().__init__(error_line(error))
        self.error = error


def call_model(method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``method(*args, **kwargs)``, its exceptions raised as :class:`ModelRaised`."""
    try:
        return method(*args, **kwargs)
    except Exception as e:
        raise ModelRaised(e) from e
