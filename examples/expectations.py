"""What an expert's hand-written export says of each model of this project, decided without the
plugin, and the deployment inputs (sizes the tests never used) each passing model must serve.
The plugin's own test suite (tests/examples/test_examples.py) checks both; this file is not a test.

``HELD_OUT[name](model)`` returns keyword calls holding every input a deployment may feed (a
mask, positions, cache positions); each must run on one of the model's ONNX graphs (the one
taking most of those inputs, which inputs depends on the transformers version) and match eager
given the same inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
import zoo
from transformers.modeling_outputs import BaseModelOutput

from pytest_exportobs import make_dynamic_cache, make_encoder_decoder_cache

Call = dict[str, Any]
TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5


@dataclass(frozen=True)
class Expected:
    """The verdict, the failing stages (one per transformers version where they differ) and
    kind, and the axes that must be dynamic (``input: axes``) in every graph taking that input."""

    verdict: str
    stages: tuple[str, ...] = ()
    kind: str | None = None
    dynamic: dict[str, tuple[int, ...]] = field(default_factory=dict)
    relations: tuple[str, ...] = ()


def _ids(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, zoo.VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _cache(model: torch.nn.Module, batch: int, past: int) -> Any:
    config = model.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layers = config.num_hidden_layers
    return make_dynamic_cache(
        [(torch.randn(batch, heads, past, head_dim), torch.randn(batch, heads, past, head_dim))] * layers
    )


def decoder_calls(model: torch.nn.Module) -> list[Call]:
    """A prefill on an empty cache, a decode step and a chunk after a cache, at unseen sizes."""
    return [
        {
            "input_ids": _ids(batch, seq, seed=batch), "past_key_values": _cache(model, batch, past),
            "attention_mask": torch.ones(batch, past + seq, dtype=torch.int64),
            "position_ids": torch.arange(past, past + seq).expand(batch, seq).clone(),
            "cache_position": torch.arange(past, past + seq),
        }
        for batch, seq, past in [(3, 4, 0), (5, 1, 7), (2, 3, 3)]
    ]


def static_cache_calls(model: torch.nn.Module) -> list[Call]:
    """Calls at other batch sizes and new-token counts, on the model's max_cache_len."""
    from pytest_exportobs import get_untrained_model_with_inputs

    return [
        get_untrained_model_with_inputs(
            model.config, inputs_kwargs=dict(cls_cache="StaticCache", batch_size=b, seq_len=s)
        )["inputs"]
        for b, s in [(4, 2), (1, 5)]
    ]


def qwen2_calls(model: torch.nn.Module) -> list[Call]:
    ids, labelled = _ids(4, 11), _ids(2, 5, seed=1)
    return [
        {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
        {"input_ids": labelled, "attention_mask": torch.ones_like(labelled), "labels": labelled},
    ]


def moe_calls(model: torch.nn.Module) -> list[Call]:
    """Batches and lengths the test never used: other tokens pick other experts."""
    return [{"input_ids": _ids(4, 11, seed=2)}, {"input_ids": _ids(1, 3, seed=3)}]


def encoder_calls(model: torch.nn.Module) -> list[Call]:
    ids = _ids(3, 14)
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    return [{"input_ids": ids, "attention_mask": mask}]


def bert_calls(model: torch.nn.Module) -> list[Call]:
    ids = _ids(4, 20)
    return [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}]


def text_encoder_calls(model: torch.nn.Module) -> list[Call]:
    return [
        {"input_ids": torch.randint(0, 300, (1, 7))},
        {"input_ids": torch.randint(0, 300, (2, 9)), "token_type_ids": torch.ones(2, 9, dtype=torch.int64)},
    ]


def pooler_calls(model: torch.nn.Module) -> list[Call]:
    return [{"x": torch.randn(5, 9, 16)}, {"x": torch.randn(3, 4, 16), "mask": torch.tensor([[1, 1, 0, 0]] * 3)}]


def seq2seq_calls(encoder_length: int | None) -> Callable[[torch.nn.Module], list[Call]]:
    """A first decoder step (no cache) and a later one, on encoder outputs of unseen sizes (of
    ``encoder_length`` when the model needs that one)."""

    def calls(model: torch.nn.Module) -> list[Call]:
        config = model.config
        found = []
        for batch, past in [(3, 0), (2, 3)]:
            length = encoder_length or 9
            call: Call = {
                "decoder_input_ids": _ids(batch, 1, seed=past),
                "encoder_outputs": BaseModelOutput(last_hidden_state=torch.randn(batch, length, config.d_model)),
                "attention_mask": torch.ones(batch, length, dtype=torch.int64),
                "cache_position": torch.arange(past, past + 1),
            }
            if past:
                heads = getattr(config, "num_heads", None) or config.decoder_attention_heads
                head_dim = config.d_model // heads
                self_pairs = [(torch.randn(batch, heads, past, head_dim),) * 2] * config.num_hidden_layers
                cross = [(torch.randn(batch, heads, length, head_dim),) * 2] * config.num_hidden_layers
                call["past_key_values"] = make_encoder_decoder_cache(
                    make_dynamic_cache(self_pairs), make_dynamic_cache(cross)
                )
            found.append(call)
        return found

    return calls


def images(shape: tuple[int, ...], name: str = "pixel_values") -> Callable[[torch.nn.Module], list[Call]]:
    return lambda model: [{name: torch.randn(*shape)}]


# a cache's leaves by the name the calls passed it: generate() passes `cache` from transformers 5.24 on
LLM = {"input_ids": (0, 1), "past_key_values.key_0": (0, 2), "cache.key_0": (0, 2)}
EXPECTED: dict[str, Expected] = {
    "llama_greedy": Expected("passed", dynamic=LLM),
    "llama": Expected("passed", dynamic={**LLM, "attention_mask": (0, 1)}, relations=("total_seq = past_seq + seq",)),
    "llama_two_batches": Expected("passed", dynamic={**LLM, "attention_mask": (0, 1)},
                                  relations=("total_seq = past_seq + seq",)),
    "llama_generate": Expected("passed", dynamic={**LLM, "attention_mask": (0, 1)}),
    "static_llama": Expected("passed", dynamic={"input_ids": (0, 1), "past_key_values.key_0": (0,),
                                                "cache.key_0": (0,)}),
    "qwen2": Expected("passed", dynamic={"input_ids": (0, 1), "labels": (0, 1)}),
    "gpt2": Expected("passed", dynamic={**LLM, "attention_mask": (0, 1)}),
    "gemma": Expected("passed", dynamic={**LLM, "attention_mask": (0, 1)}),
    "mistral": Expected("passed", dynamic=LLM),
    "opt": Expected("passed", dynamic={**LLM, "attention_mask": (0, 1)}),
    # transformers 5: grouped_mm experts, translated as transformers' exporter does; 4.57: expert routing
    # is data-dependent
    "qwen2_moe": Expected("passed", dynamic={"input_ids": (0, 1)}) if TRANSFORMERS_5
    else Expected("failed", ("torch.export",), "error"),
    "roberta": Expected("passed", dynamic={"input_ids": (0, 1), "attention_mask": (0, 1)}),
    "bert": Expected("passed", dynamic={"input_ids": (0, 1)}),
    "text_encoder": Expected("passed", dynamic={"input_ids": (0, 1), "token_type_ids": (0, 1)}),
    "pooler": Expected("passed", dynamic={"x": (0, 1), "mask": (0, 1)}),
    "t5": Expected("passed", dynamic={"decoder_input_ids": (0, 1), "encoder_outputs.last_hidden_state": (0, 1)}),
    "whisper": Expected("passed", dynamic={"decoder_input_ids": (0, 1)}),
    "vit": Expected("passed", dynamic={"pixel_values": (0,)}),
    "resnet": Expected("passed", dynamic={"pixel_values": (0,)}),
    "small_cnn": Expected("passed", dynamic={"images": (0, 2, 3)}),
    "unet": Expected("passed", dynamic={"latents": (0, 2, 3)}),
    "tagger": Expected("passed", dynamic={"tokens": (0, 1)}),
    "fixed_batch": Expected("passed"),
    "gated_scorer": Expected("failed", ("torch.export",), "error"),
    "repeat_until_count": Expected("failed", ("torch.export",), "error"),
    "pairwise_head": Expected("failed", ("torch.export",), "specialized"),
}

BUILDERS: dict[str, Callable[[], torch.nn.Module]] = {
    "llama_greedy": zoo.llama, "llama": zoo.llama, "llama_two_batches": zoo.llama, "llama_generate": zoo.llama,
    "static_llama": zoo.static_llama,
    "qwen2": zoo.qwen2, "qwen2_moe": zoo.qwen2_moe,
    "gpt2": zoo.gpt2, "opt": zoo.opt, "gemma": zoo.gemma, "mistral": zoo.mistral, "roberta": zoo.roberta,
    "bert": zoo.bert_classifier, "text_encoder": lambda: zoo.seeded(zoo.TextEncoder),
    "pooler": lambda: zoo.seeded(zoo.MaskedMeanPool), "t5": zoo.t5, "whisper": zoo.whisper, "vit": zoo.vit,
    "resnet": zoo.resnet, "small_cnn": lambda: zoo.seeded(zoo.SmallCNN), "unet": lambda: zoo.seeded(zoo.TinyUNet),
    "tagger": lambda: zoo.seeded(zoo.GRUTagger), "fixed_batch": lambda: zoo.seeded(zoo.FixedBatchNorm),
}

HELD_OUT: dict[str, Callable[[torch.nn.Module], list[Call]]] = {
    "llama_greedy": decoder_calls,
    "llama": decoder_calls,
    "llama_two_batches": decoder_calls,
    "llama_generate": decoder_calls,
    "static_llama": static_cache_calls,
    "qwen2": qwen2_calls,
    **({"qwen2_moe": moe_calls} if TRANSFORMERS_5 else {}),
    "gpt2": decoder_calls,
    "gemma": decoder_calls,
    "mistral": decoder_calls,
    "opt": decoder_calls,
    "roberta": encoder_calls,
    "bert": bert_calls,
    "text_encoder": text_encoder_calls,
    "pooler": pooler_calls,
    "t5": seq2seq_calls(encoder_length=None),
    "whisper": seq2seq_calls(encoder_length=32),
    "vit": images((3, 3, 32, 32)),
    "resnet": images((2, 3, 40, 24)),
    "small_cnn": images((3, 3, 40, 56), "images"),
    "unet": images((1, 4, 20, 28), "latents"),
    "tagger": lambda model: [{"tokens": torch.randint(0, 500, (3, 17))}],
    "fixed_batch": lambda model: [{"x": torch.randn(4, 8)}],
}
