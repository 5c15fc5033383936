"""Pytree registration of the transformers caches and the make_*_cache builders."""

from __future__ import annotations

import sys

import pytest

torch = pytest.importorskip("torch")

import torch.utils._pytree as pytree  # noqa: E402
from torch.export import Dim  # noqa: E402

from pytest_exportobs.core.cache_pytrees import register_flattening_functions  # noqa: E402
from pytest_exportobs.core.caches import (  # noqa: E402
    make_dynamic_cache,
    make_encoder_decoder_cache,
    make_static_cache,
)
from pytest_exportobs.core.trees import spec_children  # noqa: E402

from models import cache_argument, tiny_llama_config  # noqa: E402

DYN = Dim.DYNAMIC


@pytest.fixture
def cache_utils():
    return pytest.importorskip("transformers.cache_utils")


def kv_pairs(n_layers=2, batch=2, heads=3, seq=5, head_dim=4):
    return [
        (torch.randn(batch, heads, seq, head_dim), torch.randn(batch, heads, seq, head_dim))
        for _ in range(n_layers)
    ]


def flat(pairs):
    return [t for pair in pairs for t in pair]


def assert_same_tensors(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        assert a.shape == e.shape
        torch.testing.assert_close(a, e, rtol=0, atol=0)


# -- flatten / unflatten --------------------------------------------------------------------


def test_dynamic_cache_flattens_to_keys_and_values_in_layer_order(cache_utils):
    pairs = kv_pairs()
    with register_flattening_functions():
        leaves, spec = pytree.tree_flatten(make_dynamic_cache(pairs))
        rebuilt = pytree.tree_unflatten(leaves, spec)
    assert all(leaf is tensor for leaf, tensor in zip(leaves, flat(pairs), strict=True))
    assert spec.context == ["key_0", "value_0", "key_1", "value_1"]
    assert type(rebuilt) is cache_utils.DynamicCache
    assert len(rebuilt.layers) == 2
    assert_same_tensors(flat((layer.keys, layer.values) for layer in rebuilt.layers), flat(pairs))
    assert rebuilt.get_seq_length() == 5


def test_dynamic_cache_key_paths_name_the_tensors(cache_utils):
    with register_flattening_functions():
        paths = [
            path for path, _ in pytree.tree_flatten_with_path(make_dynamic_cache(kv_pairs(1)))[0]
        ]
    assert [pytree.keystr(p) for p in paths] == [".key_0", ".value_0"]


@pytest.mark.parametrize("kind", ["no layers", "layers not filled yet"])
def test_empty_dynamic_cache_has_no_leaves(cache_utils, kind):
    from transformers import LlamaConfig

    config = LlamaConfig(
        num_hidden_layers=2
    )  # generate() passes DynamicCache(config=...) at prefill
    cache = (
        cache_utils.DynamicCache()
        if kind == "no layers"
        else cache_utils.DynamicCache(config=config)
    )
    with register_flattening_functions():
        leaves, spec = pytree.tree_flatten(cache)
        rebuilt = pytree.tree_unflatten(leaves, spec)
    assert leaves == []
    assert type(rebuilt) is cache_utils.DynamicCache
    assert rebuilt.layers == []
    assert rebuilt.get_seq_length() == 0


def test_encoder_decoder_cache_flattens_self_then_cross_attention(cache_utils):
    self_pairs, cross_pairs = kv_pairs(seq=5), kv_pairs(seq=7)
    cache = make_encoder_decoder_cache(
        make_dynamic_cache(self_pairs), make_dynamic_cache(cross_pairs)
    )
    with register_flattening_functions():
        leaves, spec = pytree.tree_flatten(cache)
        rebuilt = pytree.tree_unflatten(leaves, spec)
    assert spec.context == ["self_attention_cache", "cross_attention_cache"]
    assert [child.type for child in spec_children(spec)] == [cache_utils.DynamicCache] * 2
    assert all(
        leaf is tensor
        for leaf, tensor in zip(leaves, flat(self_pairs) + flat(cross_pairs), strict=True)
    )
    assert type(rebuilt) is cache_utils.EncoderDecoderCache
    assert rebuilt.self_attention_cache.get_seq_length() == 5
    assert rebuilt.cross_attention_cache.get_seq_length() == 7
    assert_same_tensors([rebuilt.cross_attention_cache.layers[1].values], [cross_pairs[1][1]])


def test_static_cache_holds_the_pairs_then_zeros_and_round_trips(cache_utils):
    pairs = kv_pairs(seq=3)
    cache = make_static_cache(pairs, max_cache_len=8)
    with register_flattening_functions():
        leaves, spec = pytree.tree_flatten(cache)
        rebuilt = pytree.tree_unflatten(leaves, spec)
    assert spec.context == ["key_0", "value_0", "key_1", "value_1"]
    assert [leaf.shape for leaf in leaves] == [torch.Size([2, 3, 8, 4])] * 4
    assert_same_tensors([leaf[:, :, :3] for leaf in leaves], flat(pairs))
    assert all(not leaf[:, :, 3:].any() for leaf in leaves)
    assert type(rebuilt) is cache_utils.StaticCache
    assert [layer.max_cache_len for layer in rebuilt.layers] == [8, 8]
    assert_same_tensors(flat((layer.keys, layer.values) for layer in rebuilt.layers), leaves)
    assert int(cache.get_seq_length()) == int(rebuilt.get_seq_length()) == 3


OTHER_STATIC_CACHES = [
    "SlidingWindowCache",
    "HybridCache",
]  # classes of their own in transformers 4.57


def other_static_cache(cache_utils, name):
    cls = getattr(cache_utils, name, cache_utils.StaticCache)
    if cls is cache_utils.StaticCache:
        pytest.skip(f"{name} is no class of its own in this transformers")
    return cls


def test_registers_the_cache_classes_of_the_installed_transformers(cache_utils):
    names = ["DynamicCache", "EncoderDecoderCache", "StaticCache", *OTHER_STATIC_CACHES]
    classes = [getattr(cache_utils, n) for n in names if hasattr(cache_utils, n)]
    with register_flattening_functions():
        assert all(cls in pytree.SUPPORTED_NODES for cls in classes)
    assert not any(cls in pytree.SUPPORTED_NODES for cls in classes)


@pytest.mark.parametrize("name", OTHER_STATIC_CACHES)
def test_other_static_caches_round_trip_as_their_own_class(cache_utils, name):
    from transformers import LlamaConfig

    cls = other_static_cache(cache_utils, name)
    cache = cls(
        config=LlamaConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=64),
        max_cache_len=6,
    )
    cache.early_initialization(
        batch_size=2, num_heads=4, head_dim=16, dtype=torch.float32, device="cpu"
    )
    cache.update(
        torch.ones(2, 4, 2, 16), torch.ones(2, 4, 2, 16), 0, {"cache_position": torch.arange(2)}
    )
    with register_flattening_functions():
        leaves, spec = pytree.tree_flatten(cache)
        rebuilt = pytree.tree_unflatten(leaves, spec)
    assert type(rebuilt) is cls
    assert [leaf.shape for leaf in leaves] == [torch.Size([2, 4, 6, 16])] * 4
    assert_same_tensors(flat((layer.keys, layer.values) for layer in rebuilt.layers), leaves)
    assert int(rebuilt.get_seq_length()) == 2


def test_a_sliding_window_cache_round_trips_with_its_layer_classes(cache_utils):
    from transformers import MistralConfig

    cache = cache_utils.DynamicCache(config=MistralConfig(num_hidden_layers=1, sliding_window=4))
    cache.update(torch.ones(1, 2, 3, 8), torch.ones(1, 2, 3, 8), 0)
    with register_flattening_functions():
        leaves, spec = pytree.tree_flatten(cache)
        rebuilt = pytree.tree_unflatten(leaves, spec)
    (layout,) = spec.context.layers
    assert (layout.cls, layout.arguments, layout.fields) == (
        "DynamicSlidingWindowLayer", (("sliding_window", 4),), ("keys", "values"))
    assert [type(layer) for layer in rebuilt.layers] == [cache_utils.DynamicSlidingWindowLayer]
    assert (rebuilt.layers[0].sliding_window, rebuilt.get_seq_length()) == (4, 3)


def test_make_dynamic_cache_with_mixed_layer_classes_round_trips(cache_utils):
    classes = [cache_utils.DynamicLayer, cache_utils.DynamicSlidingWindowLayer]
    pairs = kv_pairs(seq=6)
    cache = make_dynamic_cache(pairs, cls_layers=classes, cls_kwargs=[{}, dict(sliding_window=12)])
    assert [type(layer) for layer in cache.layers] == classes
    assert cache.layers[1].sliding_window == 12
    default = make_dynamic_cache(pairs, cls_layers=["DynamicLayer", "DynamicSlidingWindowLayer"])
    assert default.layers[1].sliding_window == 6  # the length of the keys
    with register_flattening_functions():
        leaves, spec = pytree.tree_flatten(cache)
        paths = [pytree.keystr(p) for p, _ in pytree.tree_flatten_with_path(cache)[0]]
        rebuilt = pytree.tree_unflatten(leaves, spec)
    assert paths == [".key_0", ".value_0", ".key_1", ".value_1"]
    assert [type(layer) for layer in rebuilt.layers] == classes
    assert rebuilt.layers[1].sliding_window == 12
    assert_same_tensors(leaves, flat(pairs))


def test_a_mixed_layer_cache_structure_saves_as_json_and_loads_back(cache_utils):
    """A repro saves its input tree with treespec_dumps: layer classes and windows survive."""
    classes = [cache_utils.DynamicSlidingWindowLayer, cache_utils.DynamicLayer]
    cache = make_dynamic_cache(kv_pairs(seq=5), cls_layers=classes, cls_kwargs=[dict(sliding_window=8), {}])
    with register_flattening_functions():
        leaves, spec = pytree.tree_flatten({"past_key_values": cache})
        loaded = pytree.treespec_loads(pytree.treespec_dumps(spec))
        rebuilt = pytree.tree_unflatten(leaves, loaded)["past_key_values"]
    assert loaded == spec
    assert [type(layer) for layer in rebuilt.layers] == classes
    assert rebuilt.layers[0].sliding_window == 8


@pytest.fixture
def tiny_mamba(cache_utils):
    """A 2-layer Mamba: its cache holds a LinearAttentionLayer per layer (transformers 5)."""
    if not hasattr(cache_utils, "LinearAttentionLayer"):
        pytest.skip("this transformers has no linear-attention cache layers")
    import transformers

    torch.manual_seed(0)
    config = transformers.MambaConfig(vocab_size=50, hidden_size=16, state_size=4, num_hidden_layers=2, conv_kernel=3)
    return transformers.MambaForCausalLM(config).eval()


def test_a_state_space_cache_round_trips_with_its_states_and_decodes_as_the_original(tiny_mamba, cache_utils):
    ids = torch.randint(0, 50, (2, 5))
    with torch.no_grad():
        cache = tiny_mamba(ids, use_cache=True).cache_params
        with register_flattening_functions():
            leaves, spec = pytree.tree_flatten(cache)
            paths = [pytree.keystr(p) for p, _ in pytree.tree_flatten_with_path(cache)[0]]
            rebuilt = pytree.tree_unflatten([t.clone() for t in leaves], spec)  # the step updates states in place
            loaded = pytree.treespec_loads(pytree.treespec_dumps(pytree.tree_structure({"cache_params": cache})))
        step = ids[:, -1:]
        expected = tiny_mamba(step, cache_params=cache, use_cache=True).logits
        actual = tiny_mamba(step, cache_params=rebuilt, use_cache=True).logits
    assert paths == [".conv_state_0", ".recurrent_state_0", ".conv_state_1", ".recurrent_state_1"]
    assert [tuple(t.shape) for t in leaves] == [(2, 32, 3), (2, 32, 4)] * 2  # (batch, 2*hidden, kernel | state)
    assert [type(layer) for layer in rebuilt.layers] == [cache_utils.LinearAttentionLayer] * 2
    assert [(layer.has_previous_state, layer.conv_kernel_size) for layer in rebuilt.layers] == [({0: True}, {0: 3})] * 2
    assert loaded.children()[0].context == spec.context
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_a_state_space_cache_before_its_first_step_flattens_to_no_tensor_and_keeps_its_layers(tiny_mamba, cache_utils):
    cache = cache_utils.DynamicCache(config=tiny_mamba.config)
    with register_flattening_functions():
        leaves, spec = pytree.tree_flatten(cache)
        rebuilt = pytree.tree_unflatten(leaves, spec)
    assert leaves == []
    assert [type(layer) for layer in rebuilt.layers] == [cache_utils.LinearAttentionLayer] * 2
    assert rebuilt.layers[0].has_previous_state == {0: False}


def test_a_hybrid_layer_holds_its_keys_values_and_states(cache_utils):
    if not hasattr(cache_utils, "LinearAttentionAndFullAttentionLayer"):
        pytest.skip("this transformers has no hybrid cache layers")
    layer = cache_utils.LinearAttentionAndFullAttentionLayer()
    layer.update(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4))
    layer.update_conv_state(torch.ones(1, 6, 3))
    layer.update_recurrent_state(torch.ones(1, 6, 5))
    cache = cache_utils.DynamicCache()
    cache.layers.append(layer)
    with register_flattening_functions():
        paths = [pytree.keystr(p) for p, _ in pytree.tree_flatten_with_path(cache)[0]]
        rebuilt = pytree.tree_unflatten(*pytree.tree_flatten(cache))
    assert paths == [".key_0", ".value_0", ".conv_state_0", ".recurrent_state_0"]
    (copy,) = rebuilt.layers
    assert (copy.get_seq_length(), tuple(copy.conv_states[0].shape), tuple(copy.recurrent_states[0].shape)) == (
        3, (1, 6, 3), (1, 6, 5))


def test_make_dynamic_cache_takes_a_flat_list_and_any_rank_from_two(cache_utils):
    key, value = torch.ones(2, 2), torch.ones(3, 4, 5)
    cache = make_dynamic_cache([key, value])
    assert [(layer.keys, layer.values) for layer in cache.layers] == [(key, value)]
    with register_flattening_functions():
        assert pytree.tree_flatten(cache)[0] == [key, value]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(cls_layers="StaticLayer"), "'StaticLayer' is no DynamicLayer class"),
        (dict(cls_layers=["DynamicLayer"]), "2 layers, 1 classes in cls_layers and 2 in cls_kwargs"),
        (dict(cls_kwargs={}), "cls_kwargs needs cls_layers"),
    ],
)
def test_bad_layer_classes_are_rejected(cache_utils, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_dynamic_cache(kv_pairs(), **kwargs)


def test_flattening_a_static_cache_before_its_first_update_is_a_clear_error(cache_utils):
    from transformers import LlamaConfig

    cache = cache_utils.StaticCache(config=LlamaConfig(num_hidden_layers=1), max_cache_len=4)
    with register_flattening_functions(), pytest.raises(TypeError, match="layer 0 is empty"):
        pytree.tree_flatten(cache)


# -- registration -----------------------------------------------------------------------------


def test_registration_is_removed_after_the_block(cache_utils):
    assert cache_utils.DynamicCache not in pytree.SUPPORTED_NODES
    with register_flattening_functions():
        assert cache_utils.DynamicCache in pytree.SUPPORTED_NODES
        assert "transformers.cache_utils.DynamicCache" in pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE
    assert cache_utils.DynamicCache not in pytree.SUPPORTED_NODES
    assert "transformers.cache_utils.DynamicCache" not in pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE


def test_registration_is_removed_when_the_block_raises(cache_utils):
    with pytest.raises(RuntimeError, match="boom"), register_flattening_functions():
        raise RuntimeError("boom")
    assert cache_utils.DynamicCache not in pytree.SUPPORTED_NODES



def test_with_optree_queued_registrations_leave_with_the_block(cache_utils, monkeypatch):
    """Until torch imports its C++ pytree, each registration is queued for it: a queued copy per
    block would each register the class again when the import comes ("already registered")."""
    monkeypatch.setattr(pytree, "_cxx_pytree_exists", True)
    monkeypatch.setattr(pytree, "_cxx_pytree_imported", False)
    monkeypatch.setattr(pytree, "_cxx_pytree_pending_imports", [])
    for _ in range(2):
        with register_flattening_functions():
            queued = [args[0] for args, _ in pytree._cxx_pytree_pending_imports]
            assert cache_utils.DynamicCache in queued and cache_utils.EncoderDecoderCache in queued
    queued = [args[0] for args, _ in pytree._cxx_pytree_pending_imports]
    assert not [cls for cls in queued if cls.__module__ == cache_utils.__name__]  # transformers' outputs stay


def test_with_optree_imported_a_class_registers_again_in_the_next_block(cache_utils):
    optree = pytest.importorskip("optree")
    import torch.utils._cxx_pytree  # noqa: F401  # as dynamo imports it

    pairs = kv_pairs()
    for _ in range(2):
        with register_flattening_functions():
            leaves, _ = torch.utils._cxx_pytree.tree_flatten(make_dynamic_cache(pairs))
            assert len(leaves) == 4
    leaves = optree.tree_leaves(make_dynamic_cache(pairs), namespace="torch", none_is_leaf=True)
    assert len(leaves) == 1  # a leaf again


@pytest.fixture
def someone_elses_dynamic_cache(cache_utils):
    def flatten(cache):
        return [], None

    pytree.register_pytree_node(
        cache_utils.DynamicCache,
        flatten,
        lambda values, context: None,
        serialized_type_name="other.DynamicCache",
    )
    yield flatten
    pytree._deregister_pytree_node(cache_utils.DynamicCache)


def test_a_class_registered_by_someone_else_is_left_alone(cache_utils, someone_elses_dynamic_cache):
    with register_flattening_functions():
        assert (
            pytree.SUPPORTED_NODES[cache_utils.DynamicCache].flatten_fn
            is someone_elses_dynamic_cache
        )
        assert cache_utils.StaticCache in pytree.SUPPORTED_NODES
    assert (
        pytree.SUPPORTED_NODES[cache_utils.DynamicCache].flatten_fn is someone_elses_dynamic_cache
    )
    assert cache_utils.StaticCache not in pytree.SUPPORTED_NODES


def test_nested_blocks_unregister_when_the_outermost_exits(cache_utils):
    with register_flattening_functions():
        with register_flattening_functions():
            assert cache_utils.DynamicCache in pytree.SUPPORTED_NODES
        assert cache_utils.DynamicCache in pytree.SUPPORTED_NODES
        with register_flattening_functions():
            assert len(pytree.tree_flatten(make_dynamic_cache(kv_pairs()))[0]) == 4
        assert cache_utils.DynamicCache in pytree.SUPPORTED_NODES
    assert cache_utils.DynamicCache not in pytree.SUPPORTED_NODES


def test_an_inner_block_registers_what_an_outer_one_did_not(cache_utils):
    with register_flattening_functions(patch_transformers=False):
        assert cache_utils.DynamicCache not in pytree.SUPPORTED_NODES
        with register_flattening_functions():
            assert cache_utils.DynamicCache in pytree.SUPPORTED_NODES
        assert cache_utils.DynamicCache not in pytree.SUPPORTED_NODES


def test_without_transformers_the_block_does_nothing(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes transformers unimportable
    before = dict(pytree.SUPPORTED_NODES)
    with register_flattening_functions():
        assert pytree.SUPPORTED_NODES == before
    assert pytree.SUPPORTED_NODES == before


# -- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pairs", "error", "message"),
    [
        ("abc", TypeError, "pairs must be a list"),
        ([torch.zeros(1, 1, 1, 1)], TypeError, r"pairs\[0\] must be a \(key, value\) pair"),
        (
            [(torch.zeros(1, 1, 1, 1), 1.0)],
            TypeError,
            r"pairs\[0\] must hold two tensors, not Tensor, float",
        ),
        (
            [(torch.zeros(4), torch.zeros(4, 4))],
            ValueError,
            r"pairs\[0\]: keys and values need 2 dimensions or more, got \(4,\) and \(4, 4\)",
        ),
    ],
)
def test_bad_pairs_are_rejected(cache_utils, pairs, error, message):
    with pytest.raises(error, match=message):
        make_dynamic_cache(pairs)
    with pytest.raises(error):
        make_static_cache(pairs, max_cache_len=8)


@pytest.mark.parametrize(
    ("pairs", "message"),
    [
        ([(torch.zeros(1, 2, 3), torch.zeros(1, 2, 3))], r"\(batch, heads, seq, head_dim\)"),
        ([(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 5, 4))], r"\(1, 2, 3, 4\) and \(1, 2, 5, 4\)"),
    ],
)
def test_static_cache_needs_4d_keys_and_values_of_one_length(cache_utils, pairs, message):
    with pytest.raises(ValueError, match=message):
        make_static_cache(pairs, max_cache_len=8)


def test_static_cache_rejects_sequences_longer_than_the_cache(cache_utils):
    with pytest.raises(ValueError, match="max_cache_len=4 is shorter than a sequence of 5"):
        make_static_cache(kv_pairs(seq=5), max_cache_len=4)


def test_encoder_decoder_cache_takes_caches(cache_utils):
    with pytest.raises(
        TypeError, match="cross_attention_cache must be a transformers Cache, not list"
    ):
        make_encoder_decoder_cache(make_dynamic_cache(kv_pairs()), kv_pairs())


def test_make_dynamic_cache_keeps_the_tensors(cache_utils):
    pairs = kv_pairs()
    cache = make_dynamic_cache(pairs)
    assert [(layer.keys, layer.values) for layer in cache.layers] == pairs
    assert cache.layers[0].is_initialized


# -- export -----------------------------------------------------------------------------------


class SumCache(torch.nn.Module):
    """Adds every key, summed over heads and positions, and the cache length to ``x``."""

    def forward(self, x, cache):
        layers = getattr(cache, "self_attention_cache", cache).layers
        return x + sum(layer.keys.sum(dim=(1, 2)) for layer in layers) + cache.get_seq_length()


def _case(kind, batch, seq):
    pairs = kv_pairs(batch=batch, seq=seq)
    if kind == "DynamicCache":
        return make_dynamic_cache(pairs), [{0: DYN, 2: DYN}] * 4
    if kind == "StaticCache":
        return make_static_cache(pairs, max_cache_len=12), [{0: DYN}] * 4
    cross = make_dynamic_cache(kv_pairs(batch=batch, seq=seq + 2))
    return make_encoder_decoder_cache(make_dynamic_cache(pairs), cross), [
        [{0: DYN, 2: DYN}] * 4
    ] * 2


def test_torch_export_of_a_dynamic_cache(cache_utils):
    model = SumCache().eval()
    cache, cache_shapes = _case("DynamicCache", batch=2, seq=5)
    with register_flattening_functions():
        program = torch.export.export(
            model, (torch.randn(2, 4), cache), dynamic_shapes=({0: DYN}, cache_shapes)
        )
        x, other = torch.randn(3, 4), _case("DynamicCache", batch=3, seq=7)[0]
        torch.testing.assert_close(program.module()(x, other), model(x, other))
    assert len(program.graph_signature.user_inputs) == 5


@pytest.mark.parametrize("kind", ["DynamicCache", "StaticCache", "EncoderDecoderCache"])
def test_onnx_export_matches_eager_on_other_sizes(cache_utils, kind):
    """The unflattened caches create no tensor: no lifted constant breaks the ONNX export."""
    ort = pytest.importorskip("onnxruntime")
    model = SumCache().eval()
    cache, cache_shapes = _case(kind, batch=2, seq=5)
    with register_flattening_functions():
        program = torch.onnx.export(
            model,
            (torch.randn(2, 4), cache),
            dynamic_shapes=({0: DYN}, cache_shapes),
            dynamo=True,
            verbose=False,
        )
        inputs = (torch.randn(3, 4), _case(kind, batch=3, seq=7)[0])
        feeds = [t.numpy() for t in pytree.tree_flatten(inputs)[0]]
    session = ort.InferenceSession(
        program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    (got,) = session.run(
        None, dict(zip([i.name for i in session.get_inputs()], feeds, strict=True))
    )
    torch.testing.assert_close(torch.from_numpy(got), model(*inputs), atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_tiny_llama_with_a_dynamic_cache_exports_to_onnx(cache_utils):
    ort = pytest.importorskip("onnxruntime")
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(max_position_embeddings=256)).eval()

    cache = cache_argument()

    def inputs(batch, seq, past):
        return {"input_ids": torch.randint(0, 100, (batch, seq)),
                "attention_mask": torch.ones(batch, seq + past, dtype=torch.int64),
                cache: make_dynamic_cache(kv_pairs(2, batch, 2, past, 16))}

    shapes = {"input_ids": {0: DYN, 1: DYN}, "attention_mask": {0: DYN, 1: DYN}, cache: [{0: DYN, 2: DYN}] * 4}
    with register_flattening_functions():
        program = torch.onnx.export(
            model, (), kwargs=inputs(2, 3, 5), dynamic_shapes=shapes, dynamo=True, verbose=False
        )
        other = inputs(3, 4, 7)
        feeds = [
            t.numpy() for t in pytree.tree_flatten(other)[0]
        ]  # before the forward grows the cache
        with torch.no_grad():
            expected = model(**other)
        expected_leaves = pytree.tree_flatten((expected.logits, getattr(expected, cache)))[0]
    session = ort.InferenceSession(
        program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    got = session.run(None, dict(zip([i.name for i in session.get_inputs()], feeds, strict=True)))
    assert [g.shape for g in got] == [(3, 4, 100)] + [(3, 2, 11, 16)] * 4
    for g, e in zip(got, expected_leaves, strict=True):
        torch.testing.assert_close(torch.from_numpy(g), e, atol=1e-4, rtol=1e-4)
