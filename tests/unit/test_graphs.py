"""Which calls one exported graph serves, and what the graphs are called."""

from __future__ import annotations

from typing import Any

import torch

from pytest_exportobs import InputObserver
from pytest_exportobs.engine.planning import can_serve, plan_graphs, split_off


class Inputs(torch.nn.Module):
    def forward(self, **inputs: Any) -> torch.Tensor:
        return torch.zeros(1)


def plans_of(calls: list[dict[str, Any]]) -> list[tuple[str, list[int], list[str], dict[str, Any]]]:
    observer, model = InputObserver(), Inputs()
    with observer(model):
        for call in calls:
            model(**call)
    aligned = observer.aligned(mixed_constants=True)
    return [(p.name, p.calls, sorted(p.slots), p.constants) for p in plan_graphs(aligned)]


def ids(*shape: int) -> torch.Tensor:
    return torch.randint(3, 100, shape)


def test_calls_with_and_without_labels_need_two_graphs() -> None:
    calls = [{"input_ids": ids(2, 5), "labels": ids(2, 5)}, {"input_ids": ids(3, 4)}, {"input_ids": ids(1, 7)}]
    assert plans_of(calls) == [
        ("without labels", [1, 2], ["input_ids"], {}),
        ("with labels", [0], ["input_ids", "labels"], {}),
    ]


def test_an_absent_mask_or_cache_is_stood_in_one_graph_takes_them_all() -> None:
    from pytest_exportobs import make_dynamic_cache

    cache = make_dynamic_cache([(torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8))])
    calls = [{"input_ids": ids(2, 5)},
             {"input_ids": ids(2, 1), "attention_mask": torch.ones(2, 6), "past_key_values": cache}]
    assert plans_of(calls) == [("", [0, 1], ["attention_mask", "input_ids", "past_key_values"], {})]


def test_calls_with_other_constants_are_planned_apart_and_named_by_them() -> None:
    calls = [{"input_ids": ids(2, 5), "use_cache": True}, {"input_ids": ids(2, 4), "use_cache": True},
             {"input_ids": ids(3, 4)}]
    assert plans_of(calls) == [
        ("use_cache=True", [0, 1], ["input_ids"], {"use_cache": True}),
        ("use_cache default", [2], ["input_ids"], {}),
    ]


def test_a_graph_serves_calls_lacking_only_arguments_with_a_stand_in() -> None:
    observer, model = InputObserver(), Inputs()
    with observer(model):
        model(input_ids=ids(2, 5), attention_mask=torch.ones(2, 5), labels=ids(2, 5))
        model(input_ids=ids(2, 5))
        model(input_ids=ids(2, 5), labels=ids(2, 5))
    aligned = observer.aligned()
    everything = frozenset({"input_ids", "attention_mask", "labels"})
    assert [can_serve(aligned, everything, i) for i in range(3)] == [True, False, True]
    plan = plan_graphs(aligned)[0]
    assert [(p.calls, sorted(p.slots)) for p in split_off(aligned, plan, [2])] == [([2], ["input_ids", "labels"])]
