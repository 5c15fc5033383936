"""A model's configuration as text: what, beside its class and weights, decides its traced code."""

from __future__ import annotations

from typing import Any


def configuration_text(module: Any) -> str:
    """The ``config`` of a transformers or diffusers model as JSON text ('' when it has none)."""
    config = getattr(module, "config", None)
    if config is None:
        return ""
    to_json = getattr(config, "to_json_string", None)
    try:
        return to_json(use_diff=False) if callable(to_json) else repr(config)
    except (TypeError, ValueError):
        return repr(config)
