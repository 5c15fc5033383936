"""Code written for torch.onnx.InputObserver or yobx's observer runs unchanged on ours.

The expectations are the peers' own unit tests (torch ``test/onnx/exporter/test_input_observer.py``,
yobx ``unittests/torch/test_input_observer.py``), rewritten in our style. Where we deliberately
differ, the test says so and docs/api.md's "Coming from torch.onnx / onnx-diagnostic / yobx" lists it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from pytest_exportobs import InputObserver, ObserverError, string_type  # noqa: E402

DYN = torch.export.Dim.DYNAMIC
Call = tuple[tuple[Any, ...], dict[str, Any]]


def observe(model: torch.nn.Module, calls: Sequence[Call], observer: InputObserver | None = None,
            store_n_calls: int = 3) -> InputObserver:
    observer = observer if observer is not None else InputObserver()
    with torch.no_grad(), observer(model, store_n_calls=store_n_calls):
        for args, kwargs in calls:
            model(*args, **kwargs)
    return observer


def shapes_of(tree: Any) -> Any:
    return string_type(tree, with_shape=True)


class Add(torch.nn.Module):
    def forward(self, x, y):
        return x + y


class Optional4(torch.nn.Module):
    def forward(self, x, y, z=None, w=None):
        r = x + y
        if z is not None:
            r = r + z
        if w is not None:
            r = r + w
        return r


class TwoOptional(torch.nn.Module):
    def forward(self, x=None, y=None):
        return x if y is None else (y if x is None else x + y)


def optional4_calls() -> list[Call]:
    return [
        ((torch.randn(5, n), torch.randn(1, n)), dict(w=torch.randn(1, n), z=torch.randn(5, n)))
        for n in (6, 7, 8, 9)
    ]


# -- torch.onnx.InputObserver's surface --------------------------------------------------------


def test_errors_are_value_errors_and_runtime_errors() -> None:
    assert issubclass(ObserverError, ValueError) and issubclass(ObserverError, RuntimeError)
    with pytest.raises(RuntimeError, match=re.escape("No inputs were captured")):
        InputObserver().infer_dynamic_shapes()


def test_is_empty_until_a_call_is_recorded() -> None:
    observer = InputObserver()
    assert observer.is_empty()
    observe(Add(), [((torch.randn(3, 4), torch.randn(3, 4)), {})], observer)
    assert not observer.is_empty()


def test_a_method_the_model_lacks_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="Add does not have a method 'nonexistent'"):
        with InputObserver()(Add(), method_name="nonexistent"):
            pass


def test_infer_arguments_completes_a_dict_or_a_tuple_of_new_inputs() -> None:
    observer = observe(Optional4(), optional4_calls())
    completed = observer.infer_arguments(dict(w=torch.randn(1, 6), z=torch.randn(5, 6)))
    assert shapes_of(completed) == "dict(x:T1s5x0,y:T1s1x0,z:T1s5x6,w:T1s1x6)"
    completed = observer.infer_arguments((torch.randn(5, 6), torch.randn(1, 6)))
    assert shapes_of(completed) == "dict(x:T1s5x6,y:T1s1x6,z:T1s5x0,w:T1s1x0)"


def test_infer_arguments_by_index_fills_an_absent_input_with_an_empty_tensor() -> None:
    calls = [((torch.randn(5, 6),), {})] + [((torch.randn(n - 1, n), torch.randn(1, n)), {}) for n in (7, 8, 9)]
    observer = observe(TwoOptional(), calls)
    assert observer.infer_dynamic_shapes() == ({0: DYN, 1: DYN}, {1: DYN})
    assert shapes_of(observer.infer_arguments(0)) == "(T1s5x6,T1s1x0)"
    assert shapes_of(observer.infer_arguments(index=0)) == "(T1s5x6,T1s1x0)"  # the seed's keyword
    assert shapes_of(observer.infer_arguments(0, flat=True)) == "#2[T1s5x6,T1s1x0]"


@pytest.mark.parametrize("wrong", ["invalid_string", 1.5, [1]], ids=["str", "float", "list"])
def test_infer_arguments_of_a_wrong_type_is_a_value_error(wrong) -> None:
    observer = observe(Add(), [((torch.randn(5, 6), torch.randn(1, 6)), {})])
    with pytest.raises(ValueError, match=f"Unexpected type {type(wrong).__name__} for index_or_args_or_kwargs"):
        observer.infer_arguments(wrong)


def test_as_args_kwargs_with_star_args_and_star_kwargs() -> None:
    class Model(torch.nn.Module):
        def forward(self, a, *args, **kwargs):
            return a - args[0] * args[1] + kwargs["x"] - kwargs["y"]

    calls = [
        ((torch.randn(n, n + 1), torch.randn(n, n + 1), torch.randn(n, n + 1)),
         dict(x=torch.randn(n, n + 1), y=torch.randn(1, n + 1)))
        for n in (5, 7)
    ]
    observer = observe(Model(), calls)
    assert observer.infer_dynamic_shapes() == {
        "a": {0: DYN, 1: DYN},
        "args": ({0: DYN, 1: DYN}, {0: DYN, 1: DYN}),
        "kwargs": {"x": {0: DYN, 1: DYN}, "y": {1: DYN}},
    }
    with pytest.raises(RuntimeError, match=re.escape("use infer_arguments(as_args_kwargs=True)")):
        observer.infer_arguments()
    args, kwargs = observer.infer_arguments(as_args_kwargs=True)
    assert (shapes_of(args), shapes_of(kwargs)) == ("(T1s5x6,T1s5x6,T1s5x6)", "dict(x:T1s5x6,y:T1s1x6)")


def test_star_kwargs_nest_under_their_parameter_name() -> None:
    class Model(torch.nn.Module):
        def forward(self, x, **kwargs):
            return x + kwargs["y"]

    observer = observe(Model(), [((), dict(x=torch.randn(n - 1, n), y=torch.randn(1, n))) for n in (6, 7, 8)])
    assert observer.infer_dynamic_shapes() == dict(x={0: DYN, 1: DYN}, kwargs=dict(y={1: DYN}))
    assert list(observer.infer_arguments()) == ["x", "y"]


def test_an_index_out_of_range_is_also_a_runtime_error() -> None:
    observer = observe(Add(), [((torch.randn(5, 6), torch.randn(1, 6)), {})])
    with pytest.raises(RuntimeError, match="index 1 out of range: 1 recorded calls"):
        observer.infer_arguments(1)


def test_a_positional_none_and_value_if_missing_by_position() -> None:
    class Model(torch.nn.Module):
        def forward(self, input_ids=None, pixel_values=None, attention_mask=None, past_key_values=None):
            return input_ids

    ones = lambda *shape: torch.ones(shape, dtype=torch.int64)  # noqa: E731
    calls = [((ones(1, 28), ones(1, 3, 112, 112), ones(1, 28)), {})] + [
        ((ones(1, 1), None, ones(1, past + 1), torch.rand(1, 1, past, 32)), {}) for past in (28, 29)
    ]
    no_image = torch.empty((0, 3, 112, 112), dtype=torch.int64)
    observer = observe(Model(), calls, InputObserver(value_if_missing={1: no_image}))
    assert observer.infer_dynamic_shapes(set_batch_dimension_for=True) == (
        {0: DYN, 1: DYN}, {0: DYN}, {0: DYN, 1: DYN}, {0: DYN, 2: DYN},
    )
    assert shapes_of(observer.infer_arguments()) == "(T7s1x1,T7s0x3x112x112,T7s1x29,T1s1x1x28x32)"


def test_a_registered_custom_class_flattens_to_a_list() -> None:
    from torch.utils import _pytree

    class Pairs:
        def __init__(self, keys, values):
            self.data = list(zip(keys, values))

    def flatten(pairs):
        return [t for pair in pairs.data for t in pair], [f"{k}_{i}" for i in range(len(pairs.data)) for k in "kv"]

    class Model(torch.nn.Module):
        def forward(self, x, custom=None):
            return x if custom is None else x + sum(a + b for a, b in custom.data)

    def pairs(n: int) -> Pairs:
        return Pairs([torch.randn(n - 1, n), torch.randn(1, n)], [torch.randn(1, n), torch.randn(n - 1, n)])

    def flatten_with_keys(pairs):
        leaves, names = flatten(pairs)
        return [(_pytree.MappingKey(n), t) for n, t in zip(names, leaves)], names

    _pytree.register_pytree_node(
        Pairs, flatten, lambda leaves, _: Pairs(leaves[::2], leaves[1::2]), flatten_with_keys_fn=flatten_with_keys
    )
    try:
        observer = observe(Model(), [((torch.randn(5, 6),), {}), ((torch.randn(6, 7), pairs(7)), {}),
                                     ((torch.randn(7, 8), pairs(8)), {})])
        assert observer.infer_dynamic_shapes() == (
            {0: DYN, 1: DYN}, [{0: DYN, 1: DYN}, {1: DYN}, {1: DYN}, {0: DYN, 1: DYN}],
        )
    finally:
        _pytree._deregister_pytree_node(Pairs)


def test_calls_mixing_positional_and_keyword_arguments_are_inferred_where_the_peers_refuse() -> None:
    calls = [((), dict(y=torch.randn(5, 6))), ((torch.randn(5, 7), torch.randn(5, 7)), {}),
             ((), dict(y=torch.randn(5, 8))), ((torch.randn(5, 9), torch.randn(5, 9)), {})]
    observer = observe(TwoOptional(), calls, store_n_calls=4)
    assert observer.infer_dynamic_shapes() == {"x": {1: DYN}, "y": {1: DYN}}  # torch: RuntimeError
    assert shapes_of(observer.infer_arguments()) == "dict(x:T1s5x7,y:T1s5x7)"


# -- no call has every input ---------------------------------------------------------------------


def test_no_call_with_every_input_is_the_error_the_peers_raise() -> None:
    calls = [((), dict(x=torch.randn(5, 6)))] + [((), dict(y=torch.randn(1, 7)))] * 3
    observer = observe(TwoOptional(), calls)
    message = (
        "At least one call to the observed model must contain all the named arguments, to tell the "
        "shapes of the inputs the others lack: call 0 lacks y; call 1 lacks x"
    )
    for infer in (observer.infer_dynamic_shapes, observer.infer_arguments):
        with pytest.raises(RuntimeError, match=re.escape(message)):
            infer()


def test_each_call_lacking_a_different_input_is_an_error_not_a_zero_size_example() -> None:
    calls = [((), dict(x=torch.randn(n, 6), y=torch.randn(n, 6), **{k: torch.randn(n, 6)}))
             for n, k in ((2, "z"), (3, "w"))]
    with pytest.raises(ValueError, match="call 0 lacks w; call 1 lacks z"):
        observe(Optional4(), calls).infer_arguments()


# -- remove_inputs -------------------------------------------------------------------------------


def test_remove_inputs_forgets_them_in_every_call() -> None:
    observer = observe(Optional4(), [((), dict(x=torch.randn(n - 1, n), y=torch.randn(1, n), z=torch.randn(n - 1, n),
                                               w=torch.randn(1, n))) for n in (6, 7, 8)])
    assert observer.remove_inputs(["z", "w"]) == 6
    assert observer.infer_dynamic_shapes() == dict(x={0: DYN, 1: DYN}, y={1: DYN})
    assert list(observer.infer_arguments()) == ["x", "y"]
    assert observer.remove_inputs(["totally_unknown"]) == 0


def test_remove_an_input_by_position_passes_the_next_ones_by_name() -> None:
    observer = observe(Optional4(), [((torch.randn(n, n), torch.randn(1, n), torch.randn(n, n)), {}) for n in (2, 3)])
    assert observer.remove_inputs([1]) == 2
    assert observer.observations[0].args == (observer.observations[0].args[0],)
    assert list(observer.observations[0].kwargs) == ["z"]
    assert observer.infer_dynamic_shapes() == {"x": {0: DYN, 1: DYN}, "z": {0: DYN, 1: DYN}}


def test_remove_inputs_refuses_variadics_and_empty_observers() -> None:
    with pytest.raises(RuntimeError, match="No input was captured"):
        InputObserver().remove_inputs(["x"])

    class Model(torch.nn.Module):
        def forward(self, x, **kwargs):
            return x

    observer = observe(Model(), [((), dict(x=torch.randn(2), y=torch.randn(2)))])
    with pytest.raises(ValueError, match="Cannot remove variadic argument 'kwargs'"):
        observer.remove_inputs(["kwargs"])
    assert observer.remove_inputs(["y"]) == 1


# -- check_discrepancies ---------------------------------------------------------------------------


def test_check_discrepancies_takes_torch_keywords_and_an_onnx_program(tmp_path) -> None:
    pytest.importorskip("onnxruntime")
    model = Optional4().eval()
    observer = observe(model, optional4_calls())
    program = torch.onnx.export(
        model, (), kwargs=observer.infer_arguments(),
        dynamic_shapes=observer.infer_dynamic_shapes(set_batch_dimension_for=True), dynamo=True, verbose=False,
    )
    rows = observer.check_discrepancies(program, atol=1e-4, rtol=0.1, progress_bar=False, skip_none=True)
    assert [(r["index"], r["SUCCESS"], r["n"], r["n_inputs"], r["n_none"], r["n_empty"]) for r in rows] == [
        (0, True, 30, 4, 0, 0), (1, True, 35, 4, 0, 0), (2, True, 40, 4, 0, 0),
    ]
    assert max(r["abs"] for r in rows) < 1e-5


# -- dim_names: yobx's forms ------------------------------------------------------------------------


def test_dim_names_per_input_give_strings_and_name_the_other_axes() -> None:
    calls = [((torch.randn(n - 1, n), torch.randn(1, n)), {}) for n in (6, 8, 9)]
    observer = observe(Add(), calls)
    assert observer.infer_dynamic_shapes(dim_names={"x": {0: "batch", 1: "seq"}}) == (
        {0: "batch", 1: "seq"}, {1: "y_dim_1"},
    )
    assert observer.infer_dynamic_shapes(dim_names={0: {0: "batch", 1: "seq"}}) == (
        {0: "batch", 1: "seq"}, {1: "y_dim_1"},
    )


def test_dim_names_per_input_with_keywords_and_a_cache_like_nest() -> None:
    calls = [((torch.randn(n - 1, n), torch.randn(1, n)), dict(z=torch.randn(n - 1, n))) for n in (6, 7, 8)]
    observer = observe(Optional4(), calls)
    assert observer.infer_dynamic_shapes(dim_names={"x": {0: "batch"}, "z": {0: "batch", 1: "seq"}}) == dict(
        x={0: "batch", 1: "x_dim_1"}, y={1: "y_dim_1"}, z={0: "batch", 1: "seq"},
    )


def test_dim_names_llm_spells_our_roles_as_llm_runtimes_do() -> None:
    class LLM(torch.nn.Module):
        def forward(self, input_ids, attention_mask):
            return torch.cat([input_ids, attention_mask], dim=1)

    calls = [((torch.randint(0, 9, (b, s)), torch.ones(b, s + 1, dtype=torch.int64)), {}) for b, s in ((2, 6), (3, 8))]
    observer = observe(LLM(), calls)
    assert observer.infer_dynamic_shapes(dim_names="llm") == (
        {0: "batch_size", 1: "sequence_length"}, {0: "batch_size", 1: "total_sequence_length"},
    )
    with pytest.raises(ValueError, match="dim_names='long': expected None, True, 'llm' or a dict"):
        observer.infer_dynamic_shapes(dim_names="long")
    named = observer.infer_dynamic_shapes(dim_names=True)  # ours: shared torch.export.Dim objects
    assert [d.__name__ for d in (*named[0].values(), *named[1].values())] == ["batch", "seq", "batch", "total_seq"]


# -- onnx-diagnostic: ModelInputs, all_dynamic_shape_from_inputs, use_dyn_not_str ------------------


@pytest.fixture
def make_dynamic_cache():
    pytest.importorskip("transformers")
    from pytest_exportobs import make_dynamic_cache

    return make_dynamic_cache


def test_model_inputs_without_inputs_or_with_one_set() -> None:
    from pytest_exportobs import ModelInputs

    assert ModelInputs(Add(), []).guess_dynamic_shapes() == ((), {})
    x, y = torch.randn(5, 6), torch.randn(1, 6)
    inputs = ModelInputs(Add(), [(x, y)])
    assert string_type(inputs.inputs, with_shape=True) == "#1[((T1s5x6,T1s1x6),{})]"
    assert inputs.guess_dynamic_shapes() == (({}, {}), {})
    assert inputs.guess_dynamic_shapes(auto=True) == (({0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO},) * 2, {})
    assert (inputs.full_name, inputs.module_name_type) == ("main:Add", "type(main)=Add")


@pytest.mark.parametrize("bad", [{}, [[]], "x"], ids=["dict", "list-in-list", "str"])
def test_model_inputs_of_a_wrong_type_are_a_value_error(bad) -> None:
    from pytest_exportobs import ModelInputs

    with pytest.raises(ValueError):
        ModelInputs(Add(), bad)


def test_model_inputs_args_and_kwargs() -> None:
    from pytest_exportobs import ModelInputs

    inputs = [((torch.randn(5, 6),), dict(y=torch.randn(1, 6))), ((torch.randn(7, 8),), dict(y=torch.randn(1, 8)))]
    assert ModelInputs(Add(), inputs).guess_dynamic_shapes() == (({0: DYN, 1: DYN},), {"y": {1: DYN}})


def test_model_inputs_for_star_kwargs_nest_under_kwargs_once_moved() -> None:
    from pytest_exportobs import ModelInputs

    class Model(torch.nn.Module):
        def forward(self, **kwargs):
            return kwargs["x"].abs()

    inputs = ModelInputs(Model(), [((), {"x": torch.randn(5, 6)}), ((), {"x": torch.randn(6, 6)})])
    shapes = inputs.guess_dynamic_shapes()
    assert shapes == ((), {"x": {0: DYN}})
    args, kwargs, moved = inputs.move_to_kwargs(*inputs.inputs[0], shapes)
    assert (args, list(kwargs), moved) == ((), ["x"], ((), {"kwargs": {"x": {0: DYN}}}))
    from pytest_exportobs import export_patches

    with export_patches():  # torch 2.13 rejects the nested ``kwargs`` shapes without it
        program = torch.export.export(Model(), args, kwargs=kwargs, dynamic_shapes=moved[1])
    assert program.module()(x=torch.randn(9, 6)).shape == (9, 6)


def test_model_inputs_from_the_inputs_alone_with_caches_and_no_registration(make_dynamic_cache) -> None:
    from pytest_exportobs import ModelInputs

    def step(past: int, with_cache: bool = True) -> dict[str, Any]:
        cache = make_dynamic_cache([(torch.rand(1, 1, past, 96), torch.rand(1, 1, past, 96))])
        seq = 1 if past else 8
        return dict(cache_position=torch.arange(seq), input_ids=torch.randint(10, size=(1, seq)),
                    **(dict(past_key_values=cache) if with_cache else {}),
                    attention_mask=torch.ones((1, past + seq), dtype=torch.int64))

    shapes = ModelInputs(None, [((), step(0, with_cache=False)), ((), step(8)), ((), step(9))]).guess_dynamic_shapes()
    assert shapes == ((), {"cache_position": {0: DYN}, "input_ids": {1: DYN},
                           "past_key_values": [{2: DYN}, {2: DYN}], "attention_mask": {1: DYN}})
    assert list(shapes[1]) == ["cache_position", "input_ids", "past_key_values", "attention_mask"]


def test_model_inputs_of_caches_whose_keys_and_values_differ(make_dynamic_cache) -> None:
    from pytest_exportobs import ModelInputs

    class Model(torch.nn.Module):
        def forward(self, cache=None):
            return cache

    cache = make_dynamic_cache([(torch.randn(2, 3, 5, 6), torch.randn(2, 3, 5, 6))] * 2)
    other = make_dynamic_cache([(torch.randn(2, 3, 1, 6), torch.randn(2, 3, 6, 6))] * 2)
    expected = ((), {"cache": [{2: DYN}] * 4})
    assert ModelInputs(Model(), [dict(cache=cache), dict(cache=other)]).guess_dynamic_shapes() == expected
    assert ModelInputs(None, [{}, dict(cache=cache), dict(cache=other)]).guess_dynamic_shapes() == expected


def test_all_dynamic_shapes_of_tensors_and_caches_without_registration(make_dynamic_cache) -> None:
    from pytest_exportobs import all_dynamic_shape_from_inputs

    assert all_dynamic_shape_from_inputs((torch.randn(5, 6), 3, torch.randn(1, 6))) == (
        {0: "d_0_0", 1: "d_0_1"}, None, {0: "d_1_0", 1: "d_1_1"},
    )
    cache = make_dynamic_cache([(torch.ones(2, 2), torch.ones(2, 2) * 2)])
    assert all_dynamic_shape_from_inputs(cache) == [{0: "d_0_0", 1: "d_0_1"}, {0: "d_1_0", 1: "d_1_1"}]
    auto = torch.export.Dim.AUTO
    assert all_dynamic_shape_from_inputs([torch.randn(5, 6)], dim_prefix=auto) == [{0: auto, 1: auto}]
    assert all_dynamic_shape_from_inputs(cache, dim_prefix=DYN) == [{0: DYN, 1: DYN}] * 2


def test_use_dyn_not_str_makes_string_dims_dynamic() -> None:
    from pytest_exportobs import use_dyn_not_str

    batch = torch.export.Dim("batch")
    shapes = dict(input_ids={0: batch, 1: "seq"}, past_key_values=[{0: "batch", 2: "past"}], flag=None)
    assert use_dyn_not_str(shapes) == dict(input_ids={0: batch, 1: DYN}, past_key_values=[{0: DYN, 2: DYN}], flag=None)
    assert use_dyn_not_str(({0: "b"},), torch.export.Dim.AUTO) == ({0: torch.export.Dim.AUTO},)


def test_model_inputs_auto_string_names_dims_after_their_place(make_dynamic_cache) -> None:
    from pytest_exportobs import ModelInputs

    class Model(torch.nn.Module):
        def forward(self, cache, z):
            return z

    def cache(batch: int, seq: int, dim: int) -> Any:
        return make_dynamic_cache([(torch.randn(2, 4, 3, 7), torch.randn(batch, 4, seq, dim))] * 2)

    inputs = [(cache(2, 3, 7), torch.randn(1, 1, 1, 7)), (cache(3, 4, 8), torch.randn(1, 1, 1, 8))]
    assert ModelInputs(Model(), inputs).guess_dynamic_shapes(auto="dim") == (
        (
            [{}, {0: "dim_0I_1o0", 2: "dim_0I_1o2", 3: "dim_0I_1o3"},
             {}, {0: "dim_0I_3o0", 2: "dim_0I_3o2", 3: "dim_0I_3o3"}],
            {3: "dim_1I3"},
        ),
        {},
    )
    keywords = [dict(b=torch.randn(2, n), a=(torch.randn(n),)) for n in (3, 4)]
    assert ModelInputs(None, keywords).guess_dynamic_shapes(auto="dd") == (
        (), {"b": {1: "dd_1I1"}, "a": ({0: "dd_0I_0t0"},)},
    )


def test_a_hybrid_cache_growing_between_calls_gets_the_dims_of_its_length(make_dynamic_cache) -> None:
    """yobx's ``test_infer_dynamic_shapes_missing_pixels``: a prefill without a cache, then decode
    steps with a cache of a sliding-window layer (its window by default the length of its keys,
    282 then 283) and a full one; ``pixel_values`` only at prefill."""
    import transformers

    from pytest_exportobs import register_flattening_functions

    class Model(torch.nn.Module):
        def forward(self, input_ids=None, pixel_values=None, attention_mask=None, position_ids=None,
                    past_key_values=None, token_type_ids=None, cache_position=None):
            return input_ids

    layers = [transformers.cache_utils.DynamicSlidingWindowLayer, transformers.cache_utils.DynamicLayer]

    def step(past: int) -> dict[str, Any]:
        seq = 1 if past else 282
        ones = dict(input_ids=torch.ones((1, seq), dtype=torch.int64),
                    attention_mask=torch.ones((1, past + seq), dtype=torch.int64),
                    position_ids=torch.ones((1, seq), dtype=torch.int64),
                    token_type_ids=torch.ones((1, seq), dtype=torch.int64),
                    cache_position=torch.ones((seq,), dtype=torch.int64))
        if not past:
            return dict(ones, pixel_values=torch.ones((1, 3, 896, 896), dtype=torch.int64))
        pairs = [(torch.rand((1, 1, past, 32)), torch.rand((1, 1, past, 32))) for _ in layers]
        return dict(ones, past_key_values=make_dynamic_cache(pairs, cls_layers=layers))

    model = Model()
    observer = InputObserver(value_if_missing=dict(pixel_values=torch.empty((0, 3, 896, 896), dtype=torch.int64)))
    with register_flattening_functions(), observer(model):
        for past in (0, 282, 283):
            model(**step(past))
    with register_flattening_functions():
        shapes = observer.infer_dynamic_shapes(set_batch_dimension_for=True)
    assert shapes == {
        "input_ids": {0: DYN, 1: DYN}, "pixel_values": {0: DYN}, "attention_mask": {0: DYN, 1: DYN},
        "position_ids": {0: DYN, 1: DYN}, "past_key_values": [{0: DYN, 2: DYN}] * 4,
        "token_type_ids": {0: DYN, 1: DYN}, "cache_position": {0: DYN},
    }
