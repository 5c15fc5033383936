"""Tiny untrained transformers models with matching inputs and dynamic shapes, built offline.

:func:`get_untrained_model_with_inputs` shrinks a configuration (a few layers, hidden size 64,
vocabulary of at most 1000 tokens...), builds the model for the task the configuration implies,
and returns inputs for one forward call with their dynamic shapes named in the peers' form
(``{0: "batch", 1: "seq"}``, one dict per flattened cache tensor).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from transformers.models.auto import modeling_auto

from ..core.caches import make_dynamic_cache, make_encoder_decoder_cache, make_static_cache

BATCH, SEQ, PAST, TOTAL, ENCODER = "batch", "seq", "past_seq", "total_seq", "encoder_seq"
HEIGHT, WIDTH = "height", "width"

IMAGE_SIZE = 32
MAX_VOCAB = 1000
MAX_POSITIONS = 128

# (attribute names, small value); attributes absent or not holding an int are left alone.
_SMALL_INTS: tuple[tuple[tuple[str, ...], int], ...] = (
    (("num_attention_heads", "encoder_attention_heads", "decoder_attention_heads", "n_head",
      "num_heads"), 4),
    (("num_key_value_heads",), 2),
    (("hidden_size", "d_model", "n_embd", "embedding_size"), 64),
    (("head_dim", "d_kv"), 16),
    (("intermediate_size", "d_ff", "encoder_ffn_dim", "decoder_ffn_dim"), 128),
    (("image_size",), IMAGE_SIZE),
    (("patch_size",), 8),
    (("max_source_positions",), 32),
)
_LAYERS = ("num_hidden_layers", "num_layers", "n_layer", "encoder_layers", "decoder_layers",
           "num_decoder_layers")
_POSITIONS = ("max_position_embeddings", "n_positions", "max_target_positions")
_PER_LAYER_LISTS = ("layer_types", "mlp_layer_types")


@dataclass(frozen=True)
class Sizes:
    """Example sizes of the inputs; keep them >= 2 so that torch.export does not specialize them."""

    batch_size: int = 2
    seq_len: int = 3
    past_len: int = 5
    encoder_seq_len: int = 7

    @property
    def total_len(self) -> int:
        """Attention-mask length of a decoder step: cached plus new tokens."""
        return self.past_len + self.seq_len


Inputs = tuple[dict[str, Any], dict[str, Any]]


@dataclass(frozen=True)
class _Task:
    name: str
    mapping: str  # name of the model_type -> class name mapping in transformers' modeling_auto
    auto_class: str
    make_inputs: Callable[[torch.nn.Module, Sizes, str], Inputs]


def get_untrained_model_with_inputs(
    config_or_model_id: Any,
    model_kwargs: dict[str, Any] | None = None,
    inputs_kwargs: dict[str, Any] | None = None,
    n_layers: int = 2,
    batch_size: int = 2,
    seed: int = 0,
) -> dict[str, Any]:
    """Build a tiny untrained model from a config, a config dict or a locally cached model id.

    The config is copied and shrunk to ``n_layers`` layers, then ``model_kwargs`` overrides
    its attributes.  ``inputs_kwargs`` may hold ``task``, ``cls_cache`` (``"DynamicCache"`` or,
    for text generation, ``"StaticCache"``) and the fields of :class:`Sizes`.  The model is
    built after ``torch.manual_seed(seed)``, in eval mode.

    Returns ``dict(model, inputs, dynamic_shapes, config, task)``: ``dynamic_shapes`` is keyed
    like ``inputs`` and names the axes ``batch``, ``seq``, ``past_seq``, ``total_seq``,
    ``encoder_seq``, ``height``, ``width``; a cache gets one dict per flattened tensor.
    """
    options = {"batch_size": batch_size, **(inputs_kwargs or {})}
    forced_task = options.pop("task", None)
    cls_cache = options.pop("cls_cache", "DynamicCache")
    sizes = Sizes(**options)
    config = _shrink(_resolve_config(config_or_model_id), n_layers, sizes)
    for name, value in (model_kwargs or {}).items():
        setattr(config, name, value)
    task = _task(forced_task or detect_task(config))
    caches = ["DynamicCache"] + (["StaticCache"] if task.name == "text-generation" else [])
    if cls_cache not in caches:
        raise ValueError(f"cls_cache must be one of {caches} for {task.name!r}, not {cls_cache!r}")
    torch.manual_seed(seed)
    model = getattr(transformers, task.auto_class).from_config(config).eval()
    inputs, dynamic_shapes = task.make_inputs(model, sizes, cls_cache)
    return dict(model=model, inputs=inputs, dynamic_shapes=dynamic_shapes, config=model.config,
                task=task.name)


def detect_task(config: Any) -> str:
    """The task of ``config.architectures[0]`` if transformers knows it, else of the model type."""
    mappings = {name: getattr(modeling_auto, task.mapping) for name, task in _TASKS.items()}
    architecture = (config.architectures or [None])[0]
    for name, mapping in mappings.items():
        if any(architecture in _as_tuple(classes) for classes in mapping.values()):
            return name
    for name, mapping in mappings.items():
        if config.model_type in mapping:
            return name
    raise ValueError(f"no supported task for model_type={config.model_type!r}, "
                     f"architectures={config.architectures!r}; pass inputs_kwargs=dict(task=...)")


def _task(name: str) -> _Task:
    if name not in _TASKS:
        raise ValueError(f"unsupported task {name!r}, expected one of {sorted(_TASKS)}")
    return _TASKS[name]


def _as_tuple(names: str | tuple[str, ...]) -> tuple[str, ...]:
    return names if isinstance(names, tuple) else (names,)


def _resolve_config(config_or_model_id: Any) -> Any:
    """A private copy of the configuration, never the caller's object."""
    if isinstance(config_or_model_id, transformers.PretrainedConfig):
        return copy.deepcopy(config_or_model_id)
    if isinstance(config_or_model_id, dict):
        kwargs = dict(config_or_model_id)
        if "model_type" not in kwargs:
            raise ValueError("a config dict needs a 'model_type', e.g. dict(model_type='llama')")
        return transformers.AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    try:
        return transformers.AutoConfig.from_pretrained(config_or_model_id, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"the config of {config_or_model_id!r} could not be resolved offline (it is not in the "
            f"local Hugging Face cache); pass a config object or a dict with 'model_type' instead"
        ) from e


def _shrink(config: Any, n_layers: int, sizes: Sizes) -> Any:
    """Make ``config`` tiny in place and return it."""
    resolved: dict[str, int] = {}
    for name, value in _small_values(config, n_layers, sizes).items():
        real = config.attribute_map.get(name, name)  # the first value wins for aliases
        if isinstance(getattr(config, real, None), int):
            resolved.setdefault(real, value)
    for name, value in resolved.items():
        setattr(config, name, value)
    _shrink_lists(config, n_layers)
    _clamp_token_ids(config)
    return config


def _small_values(config: Any, n_layers: int, sizes: Sizes) -> dict[str, int]:
    """Target values by attribute name, aliases not yet resolved."""
    small = dict.fromkeys(_LAYERS, n_layers)
    for names, value in _SMALL_INTS:
        small.update(dict.fromkeys(names, value))
    needed = max(sizes.total_len, sizes.encoder_seq_len)
    for name in _POSITIONS:
        if isinstance(getattr(config, name, None), int):
            small[name] = max(needed, min(getattr(config, name), MAX_POSITIONS))
    if isinstance(getattr(config, "vocab_size", None), int):
        small["vocab_size"] = min(config.vocab_size, MAX_VOCAB)
    return small


def _shrink_lists(config: Any, n_layers: int) -> None:
    """Per-layer lists keep ``n_layers`` entries; convolution stages get one narrow block each."""
    for name in _PER_LAYER_LISTS:
        if isinstance(getattr(config, name, None), list):
            setattr(config, name, getattr(config, name)[:n_layers])
    if isinstance(getattr(config, "depths", None), list):
        config.depths = [1] * len(config.depths)
    if isinstance(getattr(config, "hidden_sizes", None), list):
        config.hidden_sizes = [16 * 2**i for i in range(len(config.hidden_sizes))]


def _clamp_token_ids(config: Any) -> None:
    """Special token ids beyond the shrunk vocabulary become its last token."""
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int):
        return
    for name in [n for n in config.to_dict() if n.endswith("_token_id")]:
        value = getattr(config, name)
        if isinstance(value, int) and value >= vocab:
            setattr(config, name, vocab - 1)
        elif isinstance(value, list):
            setattr(config, name, [min(v, vocab - 1) for v in value])


# inputs ---------------------------------------------------------------------------------------


def _accepts(model: torch.nn.Module, name: str) -> bool:
    return name in inspect.signature(model.forward).parameters


def _cache_name(model: torch.nn.Module) -> str:
    """The argument the model takes its cache by: ``cache`` from transformers 5.24 on (the old
    ``past_key_values`` warns there), ``past_key_values`` before."""
    return "cache" if _accepts(model, "cache") else "past_key_values"


def _token_ids(config: Any, batch: int, length: int) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (batch, length), dtype=torch.int64)


def _decoder_dims(config: Any) -> tuple[int, int, int]:
    """(layers, key/value heads, head dimension) of the (decoder) attention."""
    layers = _first(config, "decoder_layers", "num_decoder_layers", "num_hidden_layers")
    heads = _first(config, "decoder_attention_heads", "num_key_value_heads", "num_attention_heads")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return layers, heads, head_dim


def _first(config: Any, *names: str) -> int:
    return next(v for v in (getattr(config, n, None) for n in names) if v is not None)


def _kv_pairs(config: Any, batch: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    layers, heads, head_dim = _decoder_dims(config)
    shape = (batch, heads, length, head_dim)
    return [(torch.randn(shape), torch.randn(shape)) for _ in range(layers)]


def _cache_shapes(n_pairs: int, axes: dict[int, str]) -> list[dict[int, str]]:
    return [dict(axes) for _ in range(2 * n_pairs)]


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _causal_lm_inputs(model: torch.nn.Module, sizes: Sizes, cls_cache: str) -> Inputs:
    """One decoding step of ``seq_len`` tokens after ``past_len`` cached ones."""
    batch, past = sizes.batch_size, sizes.past_len
    positions = torch.arange(past, sizes.total_len, dtype=torch.int64)
    inputs: dict[str, Any] = dict(
        input_ids=_token_ids(model.config, batch, sizes.seq_len),
        attention_mask=torch.ones((batch, sizes.total_len), dtype=torch.int64),
        position_ids=positions.repeat(batch, 1),
    )
    shapes: dict[str, Any] = dict(
        input_ids={0: BATCH, 1: SEQ},
        attention_mask={0: BATCH, 1: TOTAL},
        position_ids={0: BATCH, 1: SEQ},
    )
    if not past:
        return inputs, shapes
    pairs, cache = _kv_pairs(model.config, batch, past), _cache_name(model)
    if cls_cache == "StaticCache":
        inputs[cache] = make_static_cache(pairs, _round_up(sizes.total_len, 16))
        shapes[cache] = _cache_shapes(len(pairs), {0: BATCH})
        if _accepts(model, "cache_position"):
            inputs["cache_position"] = positions
            shapes["cache_position"] = {0: SEQ}
    else:
        inputs[cache] = make_dynamic_cache(pairs)
        shapes[cache] = _cache_shapes(len(pairs), {0: BATCH, 2: PAST})
    return inputs, shapes


def _encoder_inputs(model: torch.nn.Module, sizes: Sizes, cls_cache: str) -> Inputs:
    """Token ids, attention mask and token type ids if the model takes them; images if no ids."""
    if not _accepts(model, "input_ids"):
        return _image_inputs(model, sizes, cls_cache)
    input_ids = _token_ids(model.config, sizes.batch_size, sizes.seq_len)
    inputs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
    if _accepts(model, "token_type_ids"):
        inputs["token_type_ids"] = torch.zeros_like(input_ids)
    return inputs, {name: {0: BATCH, 1: SEQ} for name in inputs}


def _encoder_decoder_cache(config: Any, sizes: Sizes, encoder_len: int) -> tuple[Any, list[Any]]:
    """Self-attention cache of ``past_len`` tokens, cross-attention cache of ``encoder_len``."""
    self_pairs = _kv_pairs(config, sizes.batch_size, sizes.past_len)
    cross_pairs = _kv_pairs(config, sizes.batch_size, encoder_len)
    cache = make_encoder_decoder_cache(
        make_dynamic_cache(self_pairs), make_dynamic_cache(cross_pairs)
    )
    shapes = [_cache_shapes(len(self_pairs), {0: BATCH, 2: PAST}),
              _cache_shapes(len(cross_pairs), {0: BATCH, 2: ENCODER})]
    return cache, shapes


def _seq2seq_inputs(model: torch.nn.Module, sizes: Sizes, cls_cache: str) -> Inputs:
    """Encoder tokens plus one decoder step with an :class:`EncoderDecoderCache`."""
    batch, encoder_len = sizes.batch_size, sizes.encoder_seq_len
    inputs: dict[str, Any] = dict(
        input_ids=_token_ids(model.config, batch, encoder_len),
        attention_mask=torch.ones((batch, encoder_len), dtype=torch.int64),
        decoder_input_ids=_token_ids(model.config, batch, sizes.seq_len),
    )
    shapes: dict[str, Any] = dict(
        input_ids={0: BATCH, 1: ENCODER}, attention_mask={0: BATCH, 1: ENCODER},
        decoder_input_ids={0: BATCH, 1: SEQ},
    )
    if sizes.past_len:
        cache = _cache_name(model)
        inputs[cache], shapes[cache] = _encoder_decoder_cache(model.config, sizes, encoder_len)
    return inputs, shapes


def _speech_inputs(model: torch.nn.Module, sizes: Sizes, cls_cache: str) -> Inputs:
    """Whisper-like: log-mel features plus one decoder step.

    The number of frames stays static: Whisper requires ``2 * max_source_positions`` of them.
    """
    config: Any = model.config  # a transformers config: its attributes depend on the model
    batch = sizes.batch_size
    encoder_len = config.max_source_positions  # two stride-2 convolutions: frames = 2 * positions
    inputs: dict[str, Any] = dict(
        input_features=torch.randn((batch, config.num_mel_bins, 2 * encoder_len)),
        decoder_input_ids=_token_ids(config, batch, sizes.seq_len),
    )
    shapes: dict[str, Any] = dict(input_features={0: BATCH}, decoder_input_ids={0: BATCH, 1: SEQ})
    if sizes.past_len:
        cache = _cache_name(model)
        inputs[cache], shapes[cache] = _encoder_decoder_cache(config, sizes, encoder_len)
    return inputs, shapes


def _image_inputs(model: torch.nn.Module, sizes: Sizes, cls_cache: str) -> Inputs:
    """Square images; height and width stay static when the config fixes ``image_size``."""
    config: Any = model.config
    side = getattr(config, "image_size", IMAGE_SIZE)
    pixel_values = torch.randn((sizes.batch_size, config.num_channels, side, side))
    axes = {0: BATCH} if hasattr(config, "image_size") else {0: BATCH, 2: HEIGHT, 3: WIDTH}
    return dict(pixel_values=pixel_values), dict(pixel_values=axes)


# Detection order matters: seq2seq models also appear in the masked/causal LM mappings,
# encoders in the causal LM one.
_TASKS: dict[str, _Task] = {
    task.name: task
    for task in (
        _Task("automatic-speech-recognition", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
              "AutoModelForSpeechSeq2Seq", _speech_inputs),
        _Task("text2text-generation", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
              "AutoModelForSeq2SeqLM", _seq2seq_inputs),
        _Task("image-classification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
              "AutoModelForImageClassification", _image_inputs),
        _Task("fill-mask", "MODEL_FOR_MASKED_LM_MAPPING_NAMES", "AutoModelForMaskedLM",
              _encoder_inputs),
        _Task("text-generation", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM",
              _causal_lm_inputs),
        _Task("feature-extraction", "MODEL_MAPPING_NAMES", "AutoModel", _encoder_inputs),
    )
}
