"""A model's configuration as text: what, beside its class and weights, decides its traced code."""

from __future__ import annotations

import json
import math
import types
from collections.abc import Mapping
from typing import Any

import torch

# configuration entries that change which calls a model accepts: a model with another of these is
# another model (its recorded calls may not run on the first); the rest (epsilons, dropout, output
# flags, paths) leave the calls valid, and the exported instance's own config decides its graph
CONTRACT_KEYS = ("problem_type", "is_decoder", "add_cross_attention", "is_encoder_decoder")
# configuration entries declaring the channels of a model's input (diffusers, transformers, timm)
CHANNEL_KEYS = ("in_channels", "num_channels", "in_chans")
# configuration entries declaring the longest sequence a model takes: a bound torch puts there is
# the model's domain
MAXIMUM_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length", "n_ctx",
                "max_source_positions", "max_target_positions", "max_length")
# where a configuration was loaded from, not what the model computes: transformers' tests load
# models saved to a fresh temporary directory, a new ``_name_or_path`` in every run; diffusers
# lists the entries left at their defaults in a set's order, another in every process
PROVENANCE_KEYS = frozenset({"_name_or_path", "_commit_hash", "name_or_path", "_use_default_values"})
ATTENTION_KEY = "_attn_implementation"  # in configuration_text: the attention implementations, private to transformers
# module attributes that change nothing a model computes in eval mode without gradients
INERT_WORDS = ("drop", "checkpointing")
PLAIN = (int, float, bool, str, type(None))  # module attributes read by value


def configuration_text(module: Any) -> str:
    """The ``config`` of a transformers or diffusers model as JSON text with sorted keys, the same
    in every process, without the :data:`PROVENANCE_KEYS` of it or its sub-configurations, with
    transformers' attention implementations (private: its JSON leaves them out, yet an ``eager``
    and an ``sdpa`` model trace other graphs); '' when it has none."""
    config = getattr(module, "config", None)
    if config is None:
        return ""
    to_json = getattr(config, "to_json_string", None)
    try:
        if isinstance(config, Mapping):  # diffusers' FrozenDict
            data = dict(config)
        elif callable(to_json):
            data = {**json.loads(to_json(use_diff=False)), ATTENTION_KEY: _attention_implementations(config)}
        else:
            return repr(config)
        return json.dumps(_without_provenance(data), sort_keys=True, default=repr)
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
    return json.dumps({key: repr(_entry(config, key)) for key in CONTRACT_KEYS})


def declared_maximum(module: Any, size: int) -> str:
    """``max_position_embeddings = 128``: the entry of the model's configuration (its text
    configuration's included) that declares ``size`` the longest sequence it takes; ``""`` if none."""
    return next((f"{key} = {size}" for key, value in _maxima(module) if value == size), "")


def declared_limit(module: Any) -> tuple[str, int] | None:
    """The first entry of the model's configuration (its text configuration's included) declaring
    the longest sequence it takes, ``("max_position_embeddings", 512)``; ``None`` if none."""
    return next(iter(_maxima(module)), None)


def rope_factor(module: Any) -> float:
    """How far the model's rotary scaling stretches its declared maximum (``rope_parameters``,
    ``rope_scaling`` before transformers 5: linear, dynamic, YaRN... ``{"factor": 2.0}``; per
    attention type, the largest); 1.0 without one."""
    config = getattr(module, "config", None)
    factors = [1.0]
    for found in filter(None, [config, getattr(config, "text_config", None)]):
        for key in ("rope_parameters", "rope_scaling"):
            entry = _entry(found, key)
            for parameters in [entry, *entry.values()] if isinstance(entry, dict) else []:
                factor = parameters.get("factor") if isinstance(parameters, dict) else None
                if isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor > 1:
                    factors.append(float(factor))
    return max(factors)


def _maxima(module: Any) -> list[tuple[str, int]]:
    """The :data:`MAXIMUM_KEYS` entries of the model's configurations that are positive integers."""
    config = getattr(module, "config", None)
    configs = [config, getattr(config, "text_config", None), getattr(config, "decoder", None)]
    return [(key, value) for found in filter(None, configs) for key in MAXIMUM_KEYS
            if isinstance(value := _entry(found, key), int) and not isinstance(value, bool) and value > 0]


def computation(module: Any, constants: bool = False) -> str:
    """What shapes each submodule's graph besides its weights, as text: its class and its public
    attributes that are whole numbers, flags, strings (or tuples of them) or objects named by
    their class (an attention processor, an activation function); not floats (an epsilon sets a
    constant of the same graph: the exported instance serves another's calls, their references
    recomputed on it), those inert in eval mode without gradients (dropout rates, gradient
    checkpointing) nor where it was loaded from.  Two UNets of one parameter layout whose attention
    heads or normalization groups differ compute differently: their texts differ.  With
    ``constants``, floats too: what a trace of the module bakes into its graph."""
    parts = []
    for name, sub in module.named_modules():
        if any(word in type(sub).__name__.lower() for word in INERT_WORDS):
            continue
        described = sorted((key, _described(value)) for key, value in vars(sub).items()
                           if _computes(key, value) and (constants or not isinstance(value, float)))
        parts.append(f"{name}:{type(sub).__qualname__}{described}")
    return "\n".join(parts)


def _computes(key: str, value: Any) -> bool:
    """Whether a module's attribute may change what it computes (see :func:`computation`)."""
    return (not key.startswith("_") and key not in ("training", *PROVENANCE_KEYS)
            and not isinstance(value, torch.nn.Module) and not any(word in key.lower() for word in INERT_WORDS))


def _described(value: Any) -> str:
    """A value as :func:`computation` reads it: plain values and tuples of them by ``repr``,
    functions by name, other objects by class (tensors: their values are weights; lists and
    dicts: state a model may change as it runs, a record of the batches it saw)."""
    if isinstance(value, PLAIN) or (isinstance(value, tuple) and all(isinstance(v, PLAIN) for v in value)):
        return repr(value)
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):
        return f"{value.__module__}.{value.__qualname__}"
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def declared_channels(module: Any) -> frozenset[int]:
    """The channels a model takes its input in: its configuration's (``in_channels``...) and its
    first convolution's (an input ``(batch, channels, length)`` is laid out channels first)."""
    config = getattr(module, "config", None)
    found = {value for key in CHANNEL_KEYS if isinstance(value := _entry(config, key), int)}
    convolutions = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
    first = next((m for m in module.modules() if isinstance(m, convolutions)), None)
    return frozenset(found | ({first.in_channels} if first is not None else set()))


def declared_patch(module: Any) -> int:
    """The patch size a model's configuration declares (``patch_size``, the least common multiple
    of its entries when it has one per axis); 1 without one."""
    value = _entry(getattr(module, "config", None), "patch_size")
    sizes = [value] if isinstance(value, int) else list(value) if isinstance(value, (tuple, list)) else []
    return math.lcm(*sizes) if sizes and all(isinstance(v, int) and v > 0 for v in sizes) else 1


def _entry(config: Any, key: str) -> Any:
    """An entry of a configuration: a dict's (diffusers' ``FrozenDict``) or an object's attribute."""
    if config is None:
        return None
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)
