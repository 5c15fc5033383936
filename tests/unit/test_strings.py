"""string_type: the onnx-diagnostic one-line description of inputs and outputs."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pytest_exportobs.core.string_type import string_type  # noqa: E402

from models import cache_argument  # noqa: E402


def test_seed_expectations():
    assert string_type((torch.randn(2, 6), torch.randn(1, 6)), with_shape=True) == "(T1s2x6,T1s1x6)"
    assert (
        string_type(dict(a=torch.zeros(1, 10, dtype=torch.int64)), with_shape=True)
        == "dict(a:T7s1x10)"
    )
    assert (
        string_type([torch.zeros(1, 4, 10, 32)] * 2, with_shape=True)
        == "#2[T1s1x4x10x32,T1s1x4x10x32]"
    )


@pytest.mark.parametrize(
    ("dtype", "onnx_name"),
    [
        (torch.float32, "FLOAT"),
        (torch.uint8, "UINT8"),
        (torch.int8, "INT8"),
        (torch.int16, "INT16"),
        (torch.int32, "INT32"),
        (torch.int64, "INT64"),
        (torch.bool, "BOOL"),
        (torch.float16, "FLOAT16"),
        (torch.float64, "DOUBLE"),
        (torch.bfloat16, "BFLOAT16"),
        (torch.complex64, "COMPLEX64"),
    ],
)
def test_element_types_are_onnx_numbers(dtype, onnx_name):
    onnx = pytest.importorskip("onnx")
    code = getattr(onnx.TensorProto, onnx_name)
    assert string_type(torch.zeros(2, 3, dtype=dtype), with_shape=True) == f"T{code}s2x3"


def test_without_shape_tensors_give_their_rank():
    assert string_type((torch.zeros(2, 3), torch.tensor(1))) == "(T1r2,T7r0)"
    assert string_type(torch.tensor(1.5), with_shape=True) == "T1s"


def test_containers_and_scalars():
    assert string_type((1, 2.5, True, "a", None)) == "(int,float,bool,str,None)"
    assert string_type((torch.zeros(1),), with_shape=True) == "(T1s1,)"
    assert string_type({}) == "{}"
    assert string_type({0: torch.zeros(1), 1: 2}, with_shape=True) == "{0:T1s1,1:int}"
    assert string_type([[1, 2], (3, [])]) == "#2[#2[int,int],(int,#0[])]"
    assert string_type(list(range(25))) == "#25[int,...]"
    assert string_type(tuple(range(25))) == "#25(int,...)"


def test_with_min_max_numbers_show_their_value():
    assert (
        string_type((5, 2.5, False, "s"), with_min_max=True) == "(int=5,float=2.5,bool=False,str)"
    )


def test_with_min_max_tensors_show_min_max_mean():
    t = torch.tensor([[1.0, 3.0], [2.0, 6.0]])
    assert string_type(t, with_shape=True, with_min_max=True) == "T1s2x2[1.0,6.0:A3.0]"
    assert string_type(torch.tensor([0, 4]), with_min_max=True) == "T7r1[0,4:A2.0]"
    assert string_type(torch.tensor([True, False]), with_min_max=True) == "T9r1[False,True:A0.5]"
    assert string_type(torch.tensor(2.5), with_shape=True, with_min_max=True) == "T1s=2.5"
    assert string_type(torch.zeros(0, 10), with_shape=True, with_min_max=True) == "T1s0x10[empty]"
    nan = torch.tensor([1.0, math.nan, 3.0])
    assert string_type(nan, with_shape=True, with_min_max=True) == "T1s3[1.0,3.0:A2.0N1nans]"
    assert string_type(torch.full((2,), math.nan), with_min_max=True) == "T1r1[N2nans]"


def test_tensors_whose_values_cannot_be_read_show_no_statistics():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.zeros(2, 3)
    meta = torch.zeros(2, device="meta")
    assert string_type([fake, meta], with_shape=True, with_min_max=True) == "#2[F1s2x3,T1s2]"


def test_numpy_arrays():
    np = pytest.importorskip("numpy")
    assert (
        string_type(np.zeros((2, 3), dtype=np.int64), with_shape=True, with_min_max=True)
        == "A7s2x3[0,0:A0.0]"
    )
    assert string_type(np.array(["a"])) == "ndarray"


def test_dynamic_shapes():
    dims = {0: torch.export.Dim.DYNAMIC, 1: torch.export.Dim("batch"), 2: torch.export.Dim.AUTO}
    assert string_type(dims) == "{0:DYNAMIC,1:Dim(batch),2:AUTO}"
    assert string_type([torch.export.Dim.DYNAMIC]) == "#1[DYNAMIC]"
    assert string_type(torch.export.Dim("batch") * 2) == "DerivedDim"
    batch = torch.export.Dim("batch")
    shapes = dict(input_ids={0: batch, 1: "seq"}, past_key_values=[[{0: batch, 2: "seq"}]])
    assert string_type(shapes) == (
        "dict(input_ids:{0:Dim(batch),1:DYN(seq)},past_key_values:#1[#1[{0:Dim(batch),2:DYN(seq)}]])"
    )
    assert string_type({0: "seq", 1: 3}) == "{0:str,1:int}"  # not dynamic shapes


def test_unknown_objects_give_their_class_name():
    class Thing:
        def __repr__(self):
            raise RuntimeError("never called")

    assert (
        string_type([Thing(), torch.nn.Linear(2, 2), slice(1, 2)], with_min_max=True)
        == "#3[Thing(...),Linear(...),slice]"
    )
    assert string_type(object(), ignore=True, verbose=0) == "object(...)"


def test_an_object_describing_a_tensor_shows_its_fields():
    class VirtualTensor:  # as the peers describe an input without its data
        def __init__(self, name, dtype, shape):
            self.name, self.dtype, self.shape = name, dtype, shape

    described = VirtualTensor("input_ids", torch.int64, ("batch", "seq"))
    assert string_type(described) == "VirtualTensor(name='input_ids', dtype=int64, shape=('batch', 'seq'))"
    assert string_type([described], with_shape=True) == (
        "#1[VirtualTensor(name='input_ids', dtype=int64, shape=('batch', 'seq'))]")


def test_devices_and_dtypes_show_their_value():
    assert string_type([torch.float32, torch.device("cpu")]) == "#2[dtype(torch.float32),device(cpu)]"
    assert string_type(torch.zeros(2, 3), with_shape=True, with_device=True) == "CT1s2x3"


def test_sets_as_onnx_diagnostic_shows_them():
    assert string_type({1, 2, 3}) == "{int,int,int}"
    assert string_type({1, 2, 3}, with_min_max=True) == "{int=1,int=2,int=3}"
    assert string_type(set()) == "{}"
    assert string_type(set(range(15))) == "{...}"
    assert string_type(set(range(15)), with_shape=True) == "{...}#15"
    assert string_type(set(range(15)), with_min_max=True) == "{...}#15[0,14:A7.0]"


def test_long_sequences_of_numbers_with_min_max_are_summarised():
    assert string_type(list(range(25)), with_min_max=True) == "#25[int=0,...][0,24:12.0]"
    assert string_type(tuple(range(25)), with_min_max=True) == "#25(int=0,...)[0,24:A[12.0]]"
    assert string_type([True] * 100, with_min_max=True) == "#100[bool=True,...][True,True:1.0]"
    assert string_type((4.5,) * 100, with_min_max=True) == "#100(float=4.5,...)[4.5,4.5:A[4.5]]"
    assert string_type([4] * 5, with_min_max=True, limit=3) == "#5[int=4,...][4,4:4.0]"


def test_dataclasses_skip_none_fields():
    import dataclasses

    @dataclasses.dataclass
    class Output:
        logits: torch.Tensor
        loss: torch.Tensor | None = None
        extra: int = 3

    assert (
        string_type(Output(torch.zeros(1, 2)), with_shape=True) == "Output(logits:T1s1x2,extra:int)"
    )


# -- transformers -----------------------------------------------------------------------------


@pytest.fixture
def caches():
    pytest.importorskip("transformers")
    from pytest_exportobs.core.caches import (
        make_dynamic_cache,
        make_encoder_decoder_cache,
        make_static_cache,
    )

    pairs = [(torch.zeros(1, 4, 10, 32), torch.zeros(1, 4, 10, 32))] * 2
    return make_dynamic_cache, make_encoder_decoder_cache, make_static_cache, pairs


DYNAMIC_2_LAYERS = (
    "DynamicCache(key_cache=#2[T1s1x4x10x32,T1s1x4x10x32],"
    " value_cache=#2[T1s1x4x10x32,T1s1x4x10x32])"
)


def test_dynamic_cache(caches):
    make_dynamic_cache, _, _, pairs = caches
    assert string_type(make_dynamic_cache(pairs), with_shape=True) == DYNAMIC_2_LAYERS
    assert string_type(make_dynamic_cache([])) == "DynamicCache(key_cache=#0[], value_cache=#0[])"


def test_dynamic_cache_before_its_first_update(caches):
    from transformers import LlamaConfig
    from transformers.cache_utils import DynamicCache

    fresh = DynamicCache(config=LlamaConfig(num_hidden_layers=2))
    assert string_type(fresh) == "DynamicCache(key_cache=#0[], value_cache=#0[])"


def test_encoder_decoder_cache(caches):
    make_dynamic_cache, make_encoder_decoder_cache, _, pairs = caches
    cache = make_encoder_decoder_cache(make_dynamic_cache(pairs), make_dynamic_cache(pairs[:1]))
    assert string_type(cache) == (
        "EncoderDecoderCache(self_attention_cache="
        "DynamicCache(key_cache=#2[T1r4,T1r4], value_cache=#2[T1r4,T1r4]),"
        " cross_attention_cache=DynamicCache(key_cache=#1[T1r4], value_cache=#1[T1r4]))"
    )


def test_static_cache(caches):
    _, _, make_static_cache, pairs = caches
    assert string_type(make_static_cache(pairs, max_cache_len=16), with_shape=True) == (
        "StaticCache(key_cache=#2[T1s1x4x16x32,T1s1x4x16x32],"
        " value_cache=#2[T1s1x4x16x32,T1s1x4x16x32])"
    )


def test_cache_of_mixed_layers_and_a_layer(caches):
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    make_dynamic_cache, _, _, pairs = caches
    cache = make_dynamic_cache(pairs, cls_layers=[DynamicLayer, DynamicSlidingWindowLayer])
    assert string_type(cache, with_shape=True) == (
        "DynamicCache(DynamicLayer(T1s1x4x10x32, T1s1x4x10x32),"
        " DynamicSlidingWindowLayer(T1s1x4x10x32, T1s1x4x10x32))"
    )
    assert string_type(cache.layers[0]) == "DynamicLayer(keys=T1r4, values=T1r4)"


def test_model_output(caches):
    from transformers.modeling_outputs import CausalLMOutputWithPast

    make_dynamic_cache, _, _, pairs = caches
    cache = cache_argument()  # the output's field is named as the models' argument
    output = CausalLMOutputWithPast(**{"logits": torch.zeros(1, 3, 100), cache: make_dynamic_cache(pairs)})
    shown = string_type(output, with_shape=True)
    assert shown == f"CausalLMOutputWithPast(logits:T1s1x3x100,{cache}:{DYNAMIC_2_LAYERS})"


# -- properties -------------------------------------------------------------------------------

_shapes = st.lists(st.integers(0, 4), max_size=4)
_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=3),
    _shapes.map(lambda shape: torch.zeros(shape)),
)
_trees = st.recursive(
    _leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(st.text("ab", min_size=1, max_size=2), children, max_size=3),
    ),
    max_leaves=12,
)


@given(_trees, st.booleans(), st.booleans())
def test_never_raises_and_balances_brackets(tree, with_shape, with_min_max):
    text = string_type(tree, with_shape=with_shape, with_min_max=with_min_max)
    for open_, close in ("()", "[]", "{}"):
        assert text.count(open_) == text.count(close)


@given(_shapes)
def test_shape_is_spelled_out(shape):
    assert string_type(torch.zeros(shape), with_shape=True) == "T1s" + "x".join(map(str, shape))
