"""get_untrained_model_with_inputs: tiny offline models whose inputs run, export and match ONNX."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils import _pytree

transformers = pytest.importorskip("transformers")

from pytest_exportobs.api.untrained import get_untrained_model_with_inputs  # noqa: E402
from pytest_exportobs.core.cache_pytrees import register_flattening_functions  # noqa: E402

from models import cache_argument  # noqa: E402

B, S, P, E = 2, 3, 5, 7  # default batch, new tokens, cached tokens, encoder tokens
VOCAB, HIDDEN = 1000, 64
SELF_KV = {0: "batch", 2: "past_seq"}
CROSS_KV = {0: "batch", 2: "encoder_seq"}
CACHE = cache_argument()  # the argument a model takes its cache by

# name -> (config, task, expected output shapes)
CASES: dict[str, tuple[Any, str, dict[str, tuple[int, ...]]]] = {
    "llama": (transformers.LlamaConfig(), "text-generation", {"logits": (B, S, VOCAB)}),
    "llama-dict": (dict(model_type="llama"), "text-generation", {"logits": (B, S, VOCAB)}),
    "gpt2": (transformers.GPT2Config(), "text-generation", {"logits": (B, S, VOCAB)}),
    "qwen2": (transformers.Qwen2Config(), "text-generation", {"logits": (B, S, VOCAB)}),
    "bert": (transformers.BertConfig(), "fill-mask", {"logits": (B, S, VOCAB)}),
    "bert-model": (
        transformers.BertConfig(architectures=["BertModel"]),
        "feature-extraction",
        {"last_hidden_state": (B, S, HIDDEN), "pooler_output": (B, HIDDEN)},
    ),
    "t5": (
        transformers.T5Config(),
        "text2text-generation",
        {"logits": (B, S, VOCAB), "encoder_last_hidden_state": (B, E, HIDDEN)},
    ),
    "whisper": (
        transformers.WhisperConfig(),
        "automatic-speech-recognition",
        {"logits": (B, S, VOCAB), "encoder_last_hidden_state": (B, 32, HIDDEN)},
    ),
    "vit": (transformers.ViTConfig(), "image-classification", {"logits": (B, 2)}),
    "resnet": (transformers.ResNetConfig(), "image-classification", {"logits": (B, 2)}),
}
EXPORTED = ["llama", "llama-dict", "gpt2", "qwen2", "bert", "bert-model", "vit", "resnet"]


def build(name: str, **kwargs: Any) -> dict[str, Any]:
    return get_untrained_model_with_inputs(CASES[name][0], **kwargs)


def run(model: torch.nn.Module, inputs: dict[str, Any]) -> Any:
    """Eager outputs; the inputs are copied since a forward call updates the cache in place."""
    with torch.no_grad():
        return model(**copy.deepcopy(inputs))


def torch_dims(dynamic_shapes: Any) -> Any:
    """The seed form with names, as torch.export takes it."""
    return _pytree.tree_map(
        lambda x: torch.export.Dim.DYNAMIC if isinstance(x, str) else x, dynamic_shapes
    )


def flat_tensors_and_axes(inputs: Any, dynamic_shapes: Any) -> list[tuple[torch.Tensor, dict]]:
    with register_flattening_functions():
        tensors = _pytree.tree_flatten(inputs)[0]
    axes = _pytree.tree_flatten(
        dynamic_shapes, is_leaf=lambda x: isinstance(x, dict) and all(isinstance(k, int) for k in x)
    )[0]
    assert len(tensors) == len(axes)
    return list(zip(tensors, axes))


@pytest.mark.parametrize("name", list(CASES))
def test_model_runs_on_its_inputs(name):
    _, task, expected = CASES[name]
    result = build(name)
    outputs = run(result["model"], result["inputs"])
    assert result["task"] == task
    assert not result["model"].training
    assert {k: tuple(outputs[k].shape) for k in expected} == expected


@pytest.mark.parametrize("name", list(CASES))
def test_every_named_axis_has_one_size(name):
    result = build(name)
    sizes: dict[str, set[int]] = {}
    for tensor, axes in flat_tensors_and_axes(result["inputs"], result["dynamic_shapes"]):
        for axis, dim_name in axes.items():
            sizes.setdefault(dim_name, set()).add(tensor.shape[axis])
    assert all(len(s) == 1 for s in sizes.values()), sizes
    assert sizes["batch"] == {B}


def test_causal_lm_inputs_and_dynamic_shapes():
    result = build("llama")
    inputs, shapes = result["inputs"], result["dynamic_shapes"]
    assert shapes == {
        "input_ids": {0: "batch", 1: "seq"},
        "attention_mask": {0: "batch", 1: "total_seq"},
        "position_ids": {0: "batch", 1: "seq"},
        CACHE: [SELF_KV] * 4,
    }
    assert inputs["attention_mask"].shape == (B, P + S)
    assert inputs["position_ids"].tolist() == [[5, 6, 7]] * B
    cache = inputs[CACHE]
    assert type(cache).__name__ == "DynamicCache"
    assert cache.get_seq_length() == P
    assert tuple(cache.layers[0].keys.shape) == (B, 2, P, 16)  # 2 kv heads of 64 / 4 heads
    assert getattr(run(result["model"], inputs), CACHE).get_seq_length() == P + S


def test_encoder_inputs_include_token_type_ids():
    shapes = build("bert")["dynamic_shapes"]
    names = ["input_ids", "attention_mask", "token_type_ids"]
    assert shapes == dict.fromkeys(names, {0: "batch", 1: "seq"})


def test_encoder_decoder_cache_shapes():
    t5 = build("t5")["dynamic_shapes"]
    assert t5 == {
        "input_ids": {0: "batch", 1: "encoder_seq"},
        "attention_mask": {0: "batch", 1: "encoder_seq"},
        "decoder_input_ids": {0: "batch", 1: "seq"},
        CACHE: [[SELF_KV] * 4, [CROSS_KV] * 4],
    }
    whisper = build("whisper")
    assert whisper["dynamic_shapes"]["input_features"] == {0: "batch"}  # Whisper fixes the frames
    assert whisper["inputs"]["input_features"].shape == (B, 80, 64)  # num_mel_bins kept


def test_image_axes_are_dynamic_unless_the_config_fixes_the_size():
    resnet = build("resnet")["dynamic_shapes"]
    assert resnet == {"pixel_values": {0: "batch", 2: "height", 3: "width"}}
    assert build("vit")["dynamic_shapes"] == {"pixel_values": {0: "batch"}}
    assert build("vit")["inputs"]["pixel_values"].shape == (B, 3, 32, 32)


def test_config_is_shrunk_on_a_copy():
    config = transformers.WhisperConfig()
    before = config.to_dict()
    shrunk = get_untrained_model_with_inputs(config, n_layers=3)["config"]
    assert config.to_dict() == before
    assert (shrunk.encoder_layers, shrunk.decoder_layers, shrunk.d_model) == (3, 3, HIDDEN)
    assert shrunk.vocab_size == VOCAB
    assert shrunk.decoder_start_token_id < VOCAB and shrunk.pad_token_id < VOCAB
    assert len(build("qwen2")["config"].layer_types) == 2


def test_kwargs_override_config_sizes_and_task():
    result = build(
        "llama",
        model_kwargs=dict(cache_implementation="static", vocab_size=50),
        inputs_kwargs=dict(batch_size=3, seq_len=4, past_len=6, task="feature-extraction"),
    )
    assert result["config"].cache_implementation == "static"
    assert result["task"] == "feature-extraction"
    assert type(result["model"]).__name__ == "LlamaModel"
    assert result["inputs"]["input_ids"].shape == (3, 4)
    assert int(result["inputs"]["input_ids"].max()) < 50


def test_no_cache_without_past():
    inputs = build("llama", inputs_kwargs=dict(past_len=0))["inputs"]
    assert sorted(inputs) == ["attention_mask", "input_ids", "position_ids"]


def test_same_seed_same_model_and_inputs():
    first, second = build("llama"), build("llama")
    assert torch.equal(first["inputs"]["input_ids"], second["inputs"]["input_ids"])
    for a, b in zip(first["model"].parameters(), second["model"].parameters()):
        assert torch.equal(a, b)


def test_unresolvable_model_id_raises_a_clear_error():
    message = "could not be resolved offline.*pass a config object or a dict"
    with pytest.raises(ValueError, match=message) as info:
        get_untrained_model_with_inputs("pytest-exportobs/no-such-model")
    assert isinstance(info.value.__cause__, OSError)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(inputs_kwargs=dict(task="translation")), "unsupported task"),
        (dict(inputs_kwargs=dict(cls_cache="HybridCache")), "cls_cache"),
    ],
)
def test_bad_options_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build("llama", **kwargs)


def test_config_dict_needs_a_model_type():
    with pytest.raises(ValueError, match="model_type"):
        get_untrained_model_with_inputs(dict(hidden_size=8))


def static_named_axes(program: torch.export.ExportedProgram, result: dict[str, Any]) -> list[str]:
    """``input position:axis`` of every named axis the exported program turned into a constant."""
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    user_inputs = [placeholders[name] for name in program.graph_signature.user_inputs]
    named = flat_tensors_and_axes(result["inputs"], result["dynamic_shapes"])
    assert len(user_inputs) == len(named)
    return [
        f"{position}:{axis}" for position, (node, (_, axes)) in enumerate(zip(user_inputs, named))
        for axis in axes if not isinstance(node.meta["val"].shape[axis], torch.SymInt)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("name", [*EXPORTED, "t5", "whisper"])
def test_torch_export_keeps_every_named_axis_dynamic(name):
    result = build(name)
    with register_flattening_functions():
        program = torch.export.export(
            result["model"],
            (),
            kwargs=copy.deepcopy(result["inputs"]),
            dynamic_shapes=torch_dims(result["dynamic_shapes"]),
        )
    assert static_named_axes(program, result) == []


def test_use_dyn_not_str_lets_torch_export_take_the_string_axes():
    from pytest_exportobs import use_dyn_not_str

    result = build("llama")
    assert result["dynamic_shapes"]["input_ids"] == {0: "batch", 1: "seq"}  # the seed's names
    shapes = use_dyn_not_str(result["dynamic_shapes"])
    assert shapes[CACHE] == [{0: torch.export.Dim.DYNAMIC, 2: torch.export.Dim.DYNAMIC}] * 4
    with register_flattening_functions():
        program = torch.export.export(
            result["model"], (), kwargs=copy.deepcopy(result["inputs"]), dynamic_shapes=shapes
        )
    assert static_named_axes(program, result) == []


@pytest.mark.slow
def test_static_cache_exports_to_onnx_and_matches_eager(tmp_path):
    import onnxruntime

    config = transformers.LlamaConfig()
    result = get_untrained_model_with_inputs(
        config,
        model_kwargs=dict(cache_implementation="static"),
        inputs_kwargs=dict(cls_cache="StaticCache"),
    )
    model, inputs = result["model"], result["inputs"]
    assert type(inputs[CACHE]).__name__ == "StaticCache"
    assert result["dynamic_shapes"][CACHE] == [{0: "batch"}] * 4
    with register_flattening_functions():
        program = torch.onnx.export(
            model,
            (),
            kwargs=copy.deepcopy(inputs),
            dynamic_shapes=torch_dims(result["dynamic_shapes"]),
            dynamo=True,
        )
    program.save(tmp_path / "model.onnx")
    session = onnxruntime.InferenceSession(
        tmp_path / "model.onnx", providers=["CPUExecutionProvider"]
    )
    # same weights (same seed), other batch and lengths: the ONNX model must follow
    other = get_untrained_model_with_inputs(
        config,
        model_kwargs=dict(cache_implementation="static"),
        inputs_kwargs=dict(cls_cache="StaticCache", batch_size=3, seq_len=4, past_len=7),
    )["inputs"]
    for feeds in (inputs, other):
        expected = run(model, feeds).logits.numpy()
        with register_flattening_functions():
            flat = [t.numpy() for t in _pytree.tree_flatten(feeds)[0]]
        names = [i.name for i in session.get_inputs()]
        got = session.run(None, dict(zip(names, flat, strict=True)))[0]
        assert got.shape == expected.shape
        np.testing.assert_allclose(got, expected, atol=1e-4)
