"""Group naming, splitting and the memory bound of the session store."""

from __future__ import annotations

import pytest
import torch

from pytest_exportobs.observe.store import MAX_OBSERVATIONS, ObserveOptions, SessionStore, identity


def observe(store: SessionStore, module: torch.nn.Module, default_name: str, *sizes: int, **options) -> str:
    with store.observe(module, default_name, ObserveOptions(**options), "test") as group:
        for size in sizes:
            module(torch.randn(size, module.in_features))
    return group.name


def test_one_default_name_for_two_different_models_is_split_with_a_suffix() -> None:
    store = SessionStore()
    small, large = torch.nn.Linear(4, 2), torch.nn.Linear(8, 2)
    observe(store, small, "model", 2)
    observe(store, large, "model", 3)
    observe(store, torch.nn.Linear(4, 2), "model", 5)  # same class and shapes as `small`
    assert sorted(store.groups) == sorted([f"model[{identity(small)}]", f"model[{identity(large)}]"])
    assert store.groups[f"model[{identity(small)}]"].recorder.num_obs() == 2
    assert identity(small).startswith("Linear-") and len(identity(small)) == len("Linear-") + 6


def test_an_explicit_name_covering_two_models_is_an_error() -> None:
    store = SessionStore()
    observe(store, torch.nn.Linear(4, 2), "a", 2, name="lm")
    with pytest.raises(ValueError, match="name 'lm' already covers a Linear-.* model; this one is Linear-"):
        observe(store, torch.nn.Linear(8, 2), "b", 2, name="lm")


def test_the_first_instance_is_kept_and_later_ones_are_references_to_recompute() -> None:
    store = SessionStore()
    first, second = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    observe(store, first, "model", 2)
    observe(store, second, "model", 3)
    group = store.groups["model"]
    assert group.module is first
    valid = [group.is_reference_valid(o.instance, o.weights_version) for o in group.recorder.observations]
    assert valid == [True, False]


def test_observations_per_model_are_bounded_over_the_session() -> None:
    store = SessionStore()
    module = torch.nn.Linear(4, 2)
    starts = range(0, 2 * MAX_OBSERVATIONS, 3)
    for start in starts:
        observe(store, module, "model", start + 1, start + 2, start + 3)
    observer = store.groups["model"].recorder
    assert observer.num_obs() == MAX_OBSERVATIONS
    assert observer.counts.dropped == 3 * len(starts) - MAX_OBSERVATIONS


def test_a_value_that_is_no_module_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="'model' is a int, not a torch.nn.Module"):
        SessionStore().group_for(3, "model", ObserveOptions())


def test_unknown_marker_options_are_named() -> None:
    with pytest.raises(TypeError, match=r"where: unknown argument\(s\) \['colour'\]"):
        ObserveOptions.from_kwargs({"colour": "red"}, "where")
