"""A model's configuration as text: what, beside its class and weights, decides its traced code."""

from __future__ import annotations

import json
from typing import Any

# configuration entries that change which calls a model accepts: a model with another of these is
# another model (its recorded calls may not run on the first); the rest (epsilons, dropout, output
# flags, paths) leave the calls valid, and the exported instance's own config decides its graph
CONTRACT_KEYS = ("problem_type", "is_decoder", "add_cross_attention", "is_encoder_decoder")
# configuration entries declaring the longest sequence a model takes: a bound torch puts there is
# the model's domain
MAXIMUM_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length", "n_ctx",
                "max_source_positions", "max_target_positions", "max_length")
# where a configuration was loaded from, not what the model computes: transformers' tests load
# models saved to a fresh temporary directory, a new ``_name_or_path`` in every run
PROVENANCE_KEYS = frozenset({"_name_or_path", "_commit_hash"})
ATTENTION_KEY = "_attn_implementation"  # in configuration_text: the attention implementations, private to transformers


def configuration_text(module: Any) -> str:
    """The ``config`` of a transformers or diffusers model as JSON text, without the
    :data:`PROVENANCE_KEYS` of it or its sub-configurations, with the attention implementations
    (private: its JSON leaves them out, yet an ``eager`` and an ``sdpa`` model trace other graphs);
    '' when it has none."""
    config = getattr(module, "config", None)
    if config is None:
        return ""
    to_json = getattr(config, "to_json_string", None)
    try:
        if not callable(to_json):
            return repr(config)
        data = _without_provenance(json.loads(to_json(use_diff=False)))
        return json.dumps({**data, ATTENTION_KEY: _attention_implementations(config)}, sort_keys=True)
    except (TypeError, ValueError):
        return repr(config)


def _attention_implementations(config: Any) -> dict[str, str | None]:
    """The attention implementation of a transformers configuration ('') and of each of its
    sub-configurations (by name)."""
    found = {"": getattr(config, "_attn_implementation", None)}
    for name in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, name, None)
        if sub is not None:
            found[name] = getattr(sub, "_attn_implementation", None)
    return found


def _without_provenance(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_provenance(v) for k, v in value.items() if k not in PROVENANCE_KEYS}
    if isinstance(value, list):
        return [_without_provenance(v) for v in value]
    return value


def contract(module: Any) -> str:
    """The :data:`CONTRACT_KEYS` entries of the model's configuration, as JSON ('' without a config)."""
    config = getattr(module, "config", None)
    if config is None:
        return ""
    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
    return json.dumps({key: repr(get(key)) for key in CONTRACT_KEYS})


def declared_maximum(module: Any, size: int) -> str:
    """``max_position_embeddings = 128``: the entry of the model's configuration (its text
    configuration's included) that declares ``size`` the longest sequence it takes; ``""`` if none."""
    config = getattr(module, "config", None)
    configs = [config, getattr(config, "text_config", None), getattr(config, "decoder", None)]
    for found in filter(None, configs):
        get = found.get if isinstance(found, dict) else lambda key, found=found: getattr(found, key, None)
        for key in MAXIMUM_KEYS:
            if get(key) == size:
                return f"{key} = {size}"
    return ""
