"""Role-aware dims (the plugin's shape inference): exact variables, sources and relations."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pytest_exportobs import InputObserver, ShapeModel
from pytest_exportobs.core.text import format_dims
from pytest_exportobs.shapes.inference import DimPolicy

ROLES = DimPolicy(roles=True)


class Inputs(torch.nn.Module):
    """Takes any keyword inputs: shape inference only looks at their names and shapes."""

    def forward(self, **inputs: Any) -> torch.Tensor:
        return torch.zeros(1)


def shapes_of(calls: list[dict[str, Any]], policy: DimPolicy = ROLES) -> ShapeModel:
    observer = InputObserver()
    model = Inputs()
    with observer(model):
        for call in calls:
            model(**call)
    return ShapeModel.from_aligned(observer.aligned(mixed_constants=True), policy=policy)


def summary(shapes: ShapeModel) -> tuple[str, dict[str, str], list[str]]:
    return (
        format_dims(shapes.to_json()["dims"]),
        {v.name: v.source for v in shapes.variables},
        [str(r) for r in shapes.relations],
    )


def ids(*shape: int) -> torch.Tensor:
    return torch.randint(3, 100, shape)


def ones(*shape: int) -> torch.Tensor:
    return torch.ones(shape, dtype=torch.int64)


def cache(batch: int, past: int) -> Any:
    from pytest_exportobs import make_dynamic_cache

    return make_dynamic_cache([(torch.randn(batch, 2, past, 8), torch.randn(batch, 2, past, 8))])


def test_one_encoder_call_makes_batch_and_sequence_dynamic_by_role() -> None:
    assert summary(shapes_of([{"input_ids": ids(2, 9), "attention_mask": ones(2, 9)}])) == (
        "input_ids{0:batch,1:seq} attention_mask{0:batch,1:seq}", {"batch": "role", "seq": "role"}, [],
    )


def test_as_observed_keeps_an_unvaried_call_static() -> None:
    calls = [{"input_ids": ids(2, 9), "attention_mask": ones(2, 9)}]
    assert summary(shapes_of(calls, DimPolicy())) == ("static", {}, [])


def test_a_decode_step_relates_the_mask_to_the_cache_and_the_new_tokens_by_role() -> None:
    calls = [{"input_ids": ids(2, 1), "attention_mask": ones(2, 7), "past_key_values": cache(2, 6)}]
    assert summary(shapes_of(calls)) == (
        "input_ids{0:batch,1:seq} attention_mask{0:batch,1:total_seq} past_key_values.key_0{0:batch,2:past_seq} "
        "past_key_values.value_0{0:batch,2:past_seq}",
        {"batch": "role", "seq": "role", "total_seq": "role", "past_seq": "role"},
        ["total_seq = past_seq + seq"],
    )


def test_a_greedy_loop_at_one_batch_keeps_the_batch_dynamic() -> None:
    calls = [{"input_ids": ids(2, 6)}, *({"input_ids": ids(2, 1), "past_key_values": cache(2, p)} for p in (6, 7, 8))]
    dims, sources, relations = summary(shapes_of(calls))
    assert sources == {"batch": "role", "seq": "observed", "past_seq": "observed"}
    assert dims == ("input_ids{0:batch,1:seq} past_key_values.key_0{0:batch,2:past_seq} "
                    "past_key_values.value_0{0:batch,2:past_seq}")


def test_labels_in_one_call_join_the_sequence_of_the_tokens() -> None:
    calls = [{"input_ids": ids(2, 9), "labels": ids(2, 9)}, {"input_ids": ids(3, 6)}]
    assert summary(shapes_of(calls))[0] == "input_ids{0:batch,1:seq} labels{0:batch,1:seq}"


def test_a_mask_given_in_one_call_joins_the_variables_it_equals() -> None:
    calls = [{"x": torch.randn(3, 5, 16)}, {"x": torch.randn(4, 7, 16)},
             {"x": torch.randn(2, 6, 16), "mask": ones(2, 6)}]
    assert summary(shapes_of(calls)) == (
        "x{0:batch,1:seq} mask{0:batch,1:seq}", {"batch": "observed", "seq": "observed"}, [])


@pytest.mark.parametrize(
    "call, dims, sources",
    [
        ({"tokens": ids(4, 12)}, "tokens{0:batch,1:seq}", {"batch": "role", "seq": "role"}),
        ({"features": torch.randn(4, 12, 32)}, "features{0:batch,1:seq}", {"batch": "role", "seq": "guess"}),
        ({"images": torch.randn(1, 3, 32, 32)}, "images{0:batch,2:height,3:width}",
         {"batch": "role", "height": "guess", "width": "guess"}),
        ({"x": torch.randn(4, 8), "lengths": ids(4)}, "x{0:batch} lengths{0:batch}", {"batch": "role"}),
        ({"x": torch.randn(4, 8), "scale": torch.randn(4)}, "x{0:batch}", {"batch": "role"}),
    ],
    ids=["token-ids", "features", "images", "rank-1 side input", "rank-1 float of the batch's size"],
)
def test_generic_inputs_get_guessed_roles(call: dict[str, Any], dims: str, sources: dict[str, str]) -> None:
    assert summary(shapes_of([call]))[:2] == (dims, sources)


def test_square_images_keep_height_and_width_apart() -> None:
    calls = [{"pixel_values": torch.randn(2, 3, 16, 16)}, {"pixel_values": torch.randn(2, 3, 24, 24)}]
    assert summary(shapes_of(calls))[:2] == (
        "pixel_values{0:batch,2:height,3:width}", {"batch": "role", "height": "observed", "width": "observed"},
    )


def test_declared_dims_are_added_and_pinned_ones_removed() -> None:
    calls = [{"input_ids": ids(2, 9), "scores": torch.randn(2, 5)}]
    policy = DimPolicy(roles=True, dynamic=frozenset({"scores:1"}), static=frozenset({"input_ids:1"}))
    assert summary(shapes_of(calls, policy)) == (
        "input_ids{0:batch} scores{0:batch,1:scores_dim1}", {"batch": "role", "scores_dim1": "declared"}, [],
    )


def test_an_axis_name_that_names_no_input_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"dims 'pixels:2': expected 'input:axis' with an input among \['input_ids'\]"):
        shapes_of([{"input_ids": ids(2, 9)}], DimPolicy(roles=True, dynamic=frozenset({"pixels:2"})))


def test_a_static_cache_length_is_its_allocation_not_a_dynamic_dim() -> None:
    from pytest_exportobs import make_static_cache

    pairs = [(torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8))]
    calls = [{"input_ids": ids(2, 1), "past_key_values": make_static_cache(pairs, max_cache_len=16)}]
    assert summary(shapes_of(calls))[0] == (
        "input_ids{0:batch,1:seq} past_key_values.key_0{0:batch} past_key_values.value_0{0:batch}")


def test_a_graph_without_the_cache_reads_the_total_length_as_the_new_tokens() -> None:
    calls = [
        {"input_ids": ids(2, 1), "attention_mask": ones(2, 7), "past_key_values": cache(2, 6)},
        {"input_ids": ids(3, 1), "attention_mask": ones(3, 9), "past_key_values": cache(3, 8)},
        {"input_ids": ids(2, 5), "attention_mask": ones(2, 5)},
    ]
    joint = shapes_of(calls)
    assert [str(r) for r in joint.relations] == ["total_seq = past_seq + seq"]
    prefill = joint.project([2], {"input_ids", "attention_mask"})
    assert format_dims(prefill.to_json()["dims"]) == "input_ids{0:batch,1:seq} attention_mask{0:batch,1:seq}"
    assert prefill.relations == []
    decode = joint.project([0, 1], {"input_ids", "attention_mask", "past_key_values"})
    assert [str(r) for r in decode.relations] == ["total_seq = past_seq + seq"]


def test_encoder_outputs_roles_are_those_of_their_last_hidden_state() -> None:
    from transformers.modeling_outputs import BaseModelOutput

    def encoded() -> BaseModelOutput:  # beam search expands last_hidden_state only (2 prompts x 2 beams)
        return BaseModelOutput(last_hidden_state=torch.randn(4, 7, 8), hidden_states=(torch.randn(2, 7, 8),),
                               attentions=(torch.randn(2, 2, 7, 7),))

    calls = [{"decoder_input_ids": ids(4, seq), "attention_mask": ones(4, 7), "encoder_outputs": encoded()}
             for seq in (1, 2)]
    assert summary(shapes_of(calls)) == (
        "decoder_input_ids{0:batch,1:seq} attention_mask{0:batch,1:encoder_seq} "
        "encoder_outputs.last_hidden_state{0:batch,1:encoder_seq}",  # no heads axis made dynamic
        {"batch": "role", "seq": "observed", "encoder_seq": "role"}, [],
    )


def test_a_graph_with_no_past_reads_a_free_total_length_as_the_new_tokens() -> None:
    calls = [
        {"input_ids": ids(2, 5), "attention_mask": ones(2, 5)},
        {"input_ids": ids(3, 5), "attention_mask": ones(3, 5)},
        {"input_ids": ids(2, 1), "attention_mask": ones(2, 9)},  # a mask covering tokens the call does not pass
    ]
    joint = shapes_of(calls)
    assert joint.relations == [] and "total_seq" in {v.name for v in joint.variables}
    prefill = joint.project([0, 1], {"input_ids", "attention_mask"})
    assert format_dims(prefill.to_json()["dims"]) == "input_ids{0:batch,1:seq} attention_mask{0:batch,1:seq}"
    whole = joint.project([0, 1, 2], {"input_ids", "attention_mask"})
    assert format_dims(whole.to_json()["dims"]) == "input_ids{0:batch,1:seq} attention_mask{0:batch,1:total_seq}"


def test_the_length_of_embeddings_fed_instead_of_ids_is_the_sequence_and_the_mask_relation_holds() -> None:
    calls = [
        {"input_ids": ids(2, 7), "attention_mask": ones(2, 7)},
        {"inputs_embeds": torch.randn(2, 7, 8), "attention_mask": ones(2, 7)},  # never passed with input_ids
        {"input_ids": ids(3, 1), "attention_mask": ones(3, 10), "past_key_values": cache(3, 9)},
    ]
    joint = shapes_of(calls)
    dims, _, relations = summary(joint)
    assert relations == ["total_seq = past_seq + seq"]
    assert dims.startswith("input_ids{0:batch,1:seq} attention_mask{0:batch,1:total_seq} inputs_embeds{0:batch,1:seq}")
    embeds = joint.project([1], {"inputs_embeds", "attention_mask"})
    assert format_dims(embeds.to_json()["dims"]) == "attention_mask{0:batch,1:seq} inputs_embeds{0:batch,1:seq}"
    assert embeds.relations == []
