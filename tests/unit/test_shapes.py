"""ShapeModel: dimension variables, relations, names, renderers and the safe export example."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch.utils import _pytree  # noqa: E402

from pytest_exportobs import InputObserver, ShapeModel, string_type  # noqa: E402
from pytest_exportobs.core.text import format_dims  # noqa: E402

from models import cache_argument, example_arguments  # noqa: E402

DYN = torch.export.Dim.DYNAMIC
NO_RELATION_NOTE = "one observed call: no relation between dimensions can be inferred"


# -- helpers ---------------------------------------------------------------------------------


class Inputs(torch.nn.Module):
    """Takes any keyword inputs: the shape model only looks at their names and shapes."""

    def forward(self, **inputs):
        return len(inputs)


class TextModel(torch.nn.Module):
    def forward(self, input_ids, attention_mask):
        return input_ids * attention_mask


def observed(model: torch.nn.Module, calls: Sequence[dict[str, Any]]) -> InputObserver:
    observer = InputObserver()
    with torch.no_grad(), observer(model, store_n_calls=len(calls)):
        for kwargs in calls:
            model(**kwargs)
    return observer


def shape_model(calls: Sequence[dict[str, Any]], model: torch.nn.Module | None = None, **options: Any) -> ShapeModel:
    return ShapeModel.from_aligned(observed(model or Inputs(), calls).aligned(), **options)


def describe(shapes: ShapeModel) -> str:
    """``input_ids{0:batch,1:seq} ...``: the dims as reports show them."""
    return format_dims(shapes.to_json()["dims"])


def zeros(*shape: int) -> torch.Tensor:
    return torch.zeros(shape)


def text(batch: int, seq: int) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.arange(batch * seq).reshape(batch, seq) % 10,
        "attention_mask": torch.ones(batch, seq, dtype=torch.int64),
    }


def dim_names(dynamic_shapes: Any) -> Any:
    """``dynamic_shapes`` with every ``torch.export.Dim`` replaced by its name."""
    return _pytree.tree_map(lambda d: d.__name__ if isinstance(d, torch.export.Dim) else d, dynamic_shapes)


def dims_in(dynamic_shapes: Any) -> list[Any]:
    return [d for d in _pytree.tree_leaves(dynamic_shapes) if isinstance(d, torch.export.Dim)]


def shapes_of(tree: Any) -> list[tuple[int, ...]]:
    return [tuple(t.shape) for t in _pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


# -- tiny Llama: prefill and decode at two batch sizes ---------------------------------------

LLAMA_AXES = [
    {0: "batch", 1: "seq"},  # input_ids
    {0: "batch", 1: "total_seq"},  # attention_mask
    *[{0: "batch", 2: "past_seq"}] * 4,  # k0, v0, k1, v1
]


def llama_description() -> str:
    """The tiny Llama's dims as reports show them, its cache under the argument name its
    ``forward`` takes it by (``cache`` from transformers 5.24 on, ``past_key_values`` before)."""
    cache = cache_argument()
    return " ".join(
        [
            "input_ids{0:batch,1:seq}",
            "attention_mask{0:batch,1:total_seq}",
            *(f"{cache}.{kind}_{i}{{0:batch,2:past_seq}}" for i in (0, 1) for kind in ("key", "value")),
        ]
    )


@pytest.fixture(scope="module")
def llama_observer(tiny_llama) -> InputObserver:
    """Prefill (no cache) then one decode step, for a batch of 2 (prompt 5) and of 3 (prompt 4)."""
    from pytest_exportobs import register_flattening_functions

    observer = InputObserver()
    with torch.no_grad(), register_flattening_functions(), observer(tiny_llama, store_n_calls=4):
        for batch, prompt in ((2, 5), (3, 4)):
            prefill = text(batch, prompt)
            cache = getattr(tiny_llama(**prefill), cache_argument())
            tiny_llama(**{"input_ids": prefill["input_ids"][:, -1:],
                          "attention_mask": torch.ones(batch, prompt + 1, dtype=torch.int64), cache_argument(): cache})
    return observer


@pytest.fixture(scope="module")
def llama_shapes(llama_observer) -> ShapeModel:
    return ShapeModel.from_aligned(llama_observer.aligned())


def test_llama_one_batch_one_past_length_and_total_is_past_plus_seq(llama_observer, llama_shapes) -> None:
    assert llama_observer.num_obs() == 4
    assert llama_shapes.leaf_axes() == LLAMA_AXES
    assert describe(llama_shapes) == llama_description()
    assert [str(r) for r in llama_shapes.relations] == ["total_seq = past_seq + seq"]
    assert llama_shapes.notes == []
    # The prefill has no cache: its stand-in counts a past length of 0.
    assert llama_shapes.bounds() == {"batch": (2, 3), "seq": (1, 5), "total_seq": (4, 6), "past_seq": (0, 5)}
    assert llama_shapes.to_json() == {
        "dims": {name: {str(d): v for d, v in axes.items()}
                 for name, axes in zip(llama_shapes.aligned.leaf_names, LLAMA_AXES)},
        "relations": ["total_seq = past_seq + seq"],
        "bounds": {"batch": [2, 3], "seq": [1, 5], "total_seq": [4, 6], "past_seq": [0, 5]},
        "notes": [],
    }


def test_llama_named_dims_are_one_export_dim_per_name(llama_observer) -> None:
    shapes = llama_observer.infer_dynamic_shapes(dim_names=True)
    assert dim_names(shapes) == {
        "input_ids": {0: "batch", 1: "seq"},
        "attention_mask": {0: "batch", 1: "total_seq"},
        cache_argument(): [{0: "batch", 2: "past_seq"}] * 4,
    }
    by_name: dict[str, set[int]] = {}
    for dim in dims_in(shapes):
        by_name.setdefault(dim.__name__, set()).add(id(dim))
    assert {name: len(ids) for name, ids in by_name.items()} == {"batch": 1, "seq": 1, "total_seq": 1, "past_seq": 1}
    # Without names, the seed form: Dim.DYNAMIC on the same axes.
    assert llama_observer.infer_dynamic_shapes() == {
        "input_ids": {0: DYN, 1: DYN},
        "attention_mask": {0: DYN, 1: DYN},
        cache_argument(): [{0: DYN, 2: DYN}] * 4,
    }


@pytest.mark.parametrize(
    ("overrides", "input_ids", "attention_mask", "relation"),
    [
        ({"seq": "new_tokens"}, {0: "batch", 1: "new_tokens"}, {0: "batch", 1: "total_seq"},
         "total_seq = new_tokens + past_seq"),
        ({"attention_mask:1": "kv_len", "batch": "b"}, {0: "b", 1: "seq"}, {0: "b", 1: "kv_len"},
         "kv_len = past_seq + seq"),
    ],
    ids=["by-variable-name", "by-axis"],
)
def test_llama_dim_names_override_names(llama_observer, overrides, input_ids, attention_mask, relation) -> None:
    named = dim_names(llama_observer.infer_dynamic_shapes(dim_names=overrides))
    assert (named["input_ids"], named["attention_mask"]) == (input_ids, attention_mask)
    shapes = ShapeModel.from_aligned(llama_observer.aligned(), dim_names=overrides)
    assert [str(r) for r in shapes.relations] == [relation]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"sequence": "s"}, "dim_names keys ['sequence'] name no dynamic dimension; known names: "
                            "['batch', 'past_seq', 'seq', 'total_seq'], known axes: ['attention_mask:0', "),
        ({"seq": "past_seq"}, "dim_names {'seq': 'past_seq'} gives the name(s) ['past_seq'] to several "
                              "independent dimensions; names after overriding: "
                              "['batch', 'past_seq', 'total_seq', 'past_seq']"),
    ],
    ids=["unknown-key", "two-variables-one-name"],
)
def test_llama_bad_dim_names_are_value_errors(llama_observer, overrides, message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        llama_observer.infer_dynamic_shapes(dim_names=overrides)


def test_llama_example_is_synthesized_with_every_dynamic_size_at_least_2(
    tiny_llama, llama_observer, llama_shapes
) -> None:
    from pytest_exportobs import register_flattening_functions

    # Prefills have an empty cache, decode steps one new token: no recorded call is safe.
    assert [llama_shapes.small_variables(i) for i in range(4)] == [["past_seq"], ["seq"], ["past_seq"], ["seq"]]
    assert llama_shapes.safe_call() is None
    args, kwargs = example_arguments(llama_shapes)
    assert args == ()
    # The first decode call, seq and past_seq raised to their largest recorded sizes.
    assert string_type(kwargs, with_shape=True) == (
        f"dict(input_ids:T7s2x5,attention_mask:T7s2x10,{cache_argument()}:DynamicCache("
        "key_cache=#2[T1s2x2x5x16,T1s2x2x5x16], value_cache=#2[T1s2x2x5x16,T1s2x2x5x16]))"
    )
    assert torch.equal(kwargs["attention_mask"], torch.ones(2, 10, dtype=torch.int64))
    recorded_ids = [o.kwargs["input_ids"] for o in llama_observer.observations]
    low, high = min(int(t.min()) for t in recorded_ids), max(int(t.max()) for t in recorded_ids)
    assert low <= int(kwargs["input_ids"].min()) and int(kwargs["input_ids"].max()) <= high
    with torch.no_grad(), register_flattening_functions():
        assert tiny_llama(**kwargs).logits.shape == (2, 5, 100)


# -- variables -------------------------------------------------------------------------------


def test_dims_equal_in_one_call_only_stay_two_variables() -> None:
    shapes = shape_model([{"x": zeros(3), "y": zeros(3)}, {"x": zeros(4), "y": zeros(5)},
                          {"x": zeros(6), "y": zeros(2)}])
    assert shapes.leaf_axes() == [{0: "x_dim0"}, {0: "y_dim0"}]
    assert shapes.bounds() == {"x_dim0": (3, 6), "y_dim0": (2, 5)}


def test_dims_equal_in_every_call_and_varying_are_one_variable() -> None:
    shapes = shape_model([{"x": zeros(3, 7), "y": zeros(3)}, {"x": zeros(4, 7), "y": zeros(4)}])
    assert [(v.name, v.axes, v.values) for v in shapes.variables] == [("batch", [(0, 0), (1, 0)], [3, 4])]
    assert describe(shapes) == "x{0:batch} y{0:batch}"


def test_a_sum_is_a_relation_when_its_terms_vary_independently() -> None:
    calls = [{"x": zeros(a, b), "y": zeros(a + b)} for a, b in ((3, 4), (5, 2), (2, 2))]
    shapes = shape_model(calls)
    assert [str(r) for r in shapes.relations] == ["y_dim0 = x_dim0 + x_dim1"]
    assert shapes.bounds() == {"x_dim0": (2, 5), "x_dim1": (2, 4), "y_dim0": (4, 7)}


@pytest.mark.parametrize(
    "sizes",
    [
        [(2, 3, 5), (4, 6, 10)],  # the terms grow together: the sum is not pinned down
        [(2, 5, 8), (3, 5, 9), (4, 5, 10)],  # y = x + 6 with z constant: v = u + c is never inferred
    ],
    ids=["terms-proportional", "offset-only"],
)
def test_no_relation_without_independent_evidence(sizes) -> None:
    shapes = shape_model([{"x": zeros(a), "z": zeros(b), "y": zeros(c)} for a, b, c in sizes])
    assert shapes.relations == [] and shapes.notes == []


def test_a_single_call_relates_nothing_and_says_so() -> None:
    shapes = shape_model([{"x": zeros(3, 4), "y": zeros(7)}], set_batch_dimension_for=True)
    assert shapes.leaf_axes() == [{0: "batch"}, {0: "batch_2"}]  # forced first dims are batches, not merged
    assert shapes.relations == []
    assert shapes.notes == [NO_RELATION_NOTE]


@pytest.mark.parametrize(
    ("calls", "description"),
    [
        (
            [{"input_ids": zeros(2, 5), "pixel_values": zeros(1, 3, 16, 20)},
             {"input_ids": zeros(3, 6), "pixel_values": zeros(4, 3, 24, 32)},
             {"input_ids": zeros(4, 2), "pixel_values": zeros(2, 3, 8, 8)}],
            "input_ids{0:batch,1:seq} pixel_values{0:batch_2,2:height,3:width}",
        ),
        (
            [{"x": zeros(2, 5), "input_features": zeros(2, 80, 30)},
             {"x": zeros(3, 6), "input_features": zeros(3, 80, 50)}],
            "x{0:batch,1:x_dim1} input_features{0:batch,2:frames}",
        ),
        (
            [{"input_ids": zeros(2, 5), "cache_position": zeros(5)},
             {"input_ids": zeros(2, 1), "cache_position": zeros(1)}],
            "input_ids{1:seq} cache_position{0:seq}",
        ),
    ],
    ids=["images", "audio", "cache-position"],
)
def test_default_names_follow_the_input_roles(calls, description) -> None:
    assert describe(shape_model(calls)) == description


def test_non_tensor_leaves_get_no_dynamic_shape() -> None:
    calls = [{"x": {"t": zeros(n), "k": 3, "none": None}} for n in (2, 3)]
    shapes = shape_model(calls)
    assert shapes.to_dynamic_shapes() == {"inputs": {"x": {"t": {0: DYN}, "k": None, "none": None}}}
    assert shapes.to_axis_names() == {"inputs": {"x": {"t": {0: "x_t_dim0"}, "k": None, "none": None}}}


# -- named dims and export -------------------------------------------------------------------


def test_named_dims_tie_equal_axes_in_torch_export() -> None:
    model = TextModel()
    observer = observed(model, [text(2, 5), text(3, 7)])
    shapes = observer.infer_dynamic_shapes(dim_names=True)
    assert dim_names(shapes) == {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}}
    assert (shapes["input_ids"][0] is shapes["attention_mask"][0]
            and shapes["input_ids"][1] is shapes["attention_mask"][1])

    program = torch.export.export(model, (), kwargs=observer.infer_arguments(), dynamic_shapes=shapes)
    assert len(program.range_constraints) == 2  # one symbol per name
    inputs = text(4, 9)
    assert torch.equal(program.module()(**inputs), model(**inputs))
    with pytest.raises(Exception, match="attention_mask"):  # tied: the mask must follow input_ids
        program.module()(input_ids=inputs["input_ids"], attention_mask=torch.ones(4, 8, dtype=torch.int64))


# -- the export example ----------------------------------------------------------------------


def test_a_recorded_call_with_every_size_at_least_2_is_the_example() -> None:
    calls = [text(2, 5), text(3, 7)]
    shapes = shape_model(calls, TextModel())
    assert shapes.safe_call() == 0
    args, kwargs = example_arguments(shapes)
    assert args == () and list(kwargs) == ["input_ids", "attention_mask"]
    assert all(torch.equal(kwargs[k], calls[0][k]) for k in kwargs)


def test_a_forced_batch_seen_as_1_only_is_dynamic_and_synthesized_as_2() -> None:
    calls = [text(1, 5), text(1, 7)]
    observer = observed(TextModel(), calls)
    assert observer.infer_dynamic_shapes(set_batch_dimension_for=True) == {
        "input_ids": {0: DYN, 1: DYN}, "attention_mask": {0: DYN, 1: DYN},
    }
    shapes = ShapeModel.from_aligned(observer.aligned(), set_batch_dimension_for=True)
    assert describe(shapes) == "input_ids{0:batch,1:seq} attention_mask{0:batch,1:seq}"
    assert shapes.bounds() == {"batch": (1, 1), "seq": (5, 7)}
    assert shapes.safe_call() is None and shapes.small_variables(0) == ["batch"]

    args, kwargs = example_arguments(shapes)
    assert args == () and shapes_of(kwargs) == [(2, 5), (2, 5)]
    assert torch.equal(kwargs["attention_mask"], torch.ones(2, 5, dtype=torch.int64))
    assert kwargs["input_ids"].dtype == torch.int64
    assert 0 <= int(kwargs["input_ids"].min()) and int(kwargs["input_ids"].max()) <= 9


def test_without_forcing_a_constant_batch_stays_static() -> None:
    shapes = shape_model([text(1, 5), text(1, 7)], TextModel())
    assert describe(shapes) == "input_ids{1:seq} attention_mask{1:seq}"
    assert shapes.safe_call() == 0  # batch 1 is static: nothing to specialize


def test_merging_a_variable_torch_proved_equal_moves_its_axes_in_a_new_model() -> None:
    shapes = shape_model([{"x": zeros(3, 4), "y": zeros(5)}, {"x": zeros(6, 2), "y": zeros(7)}])
    merged = shapes.merged("y_dim0", into="x_dim0")
    assert merged.leaf_axes() == [{0: "x_dim0", 1: "x_dim1"}, {0: "x_dim0"}]
    assert merged.merged("unknown", into="x_dim0") is merged  # torch named a dim we do not have
    assert [v.name for v in merged.variables] == ["x_dim0", "x_dim1"]
    assert shapes.leaf_axes() == [{0: "x_dim0", 1: "x_dim1"}, {0: "y_dim0"}]  # the inferred model is intact
    assert [v.axes for v in shapes.variables] == [[(0, 0)], [(0, 1)], [(1, 0)]]


def test_a_graph_refines_its_own_projection_never_the_inferred_model() -> None:
    shapes = shape_model([{"x": zeros(3, 4), "y": zeros(5)}, {"x": zeros(6, 2), "y": zeros(7)}])
    projected = shapes.project([0, 1], {"x", "y"})
    assert projected.without("x_dim1").merged("y_dim0", into="x_dim0").leaf_axes() == [{0: "x_dim0"}, {0: "x_dim0"}]
    assert shapes.leaf_axes() == projected.leaf_axes() == [{0: "x_dim0", 1: "x_dim1"}, {0: "y_dim0"}]
    with pytest.raises(dataclasses.FrozenInstanceError):
        shapes.variables = []  # type: ignore[misc]


def test_recorded_bounds_leave_out_the_zero_of_an_empty_stand_in() -> None:
    calls = [{"x": zeros(2, 3)}, {"x": zeros(2, 1), "past": zeros(2, 3)}, {"x": zeros(3, 1), "past": zeros(3, 4)}]
    shapes = shape_model(calls)
    assert shapes.bounds()["past_dim1"] == (0, 4)
    assert shapes.bounds(recorded_only=True)["past_dim1"] == (3, 4)
