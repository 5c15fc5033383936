"""Group naming, splitting and the memory bound of the session store."""

from __future__ import annotations

import pytest
import torch

from pytest_exportobs.observe.recorder import CallCounts
from pytest_exportobs.observe.store import MAX_OBSERVATIONS, MAX_ORDINARY, ObserveOptions, SessionStore, identity

from models import TiedHead


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
    valid = [group.is_reference_valid(o.instance, o.weights_digest) for o in group.recorder.observations]
    assert valid == [True, False]


def shapes_of(store: SessionStore) -> list[tuple[int, ...]]:
    return [tuple(o.args[0].shape) for o in store.groups["model"].recorder.observations]


def test_observations_per_model_are_bounded_over_the_session() -> None:
    store = SessionStore()
    module = torch.nn.Linear(4, 2)
    starts = range(10, 10 + 2 * MAX_OBSERVATIONS, 3)
    for start in starts:  # sizes 10, 11, ...: no call adds information after the first two
        observe(store, module, "model", start, start + 1, start + 2)
    observer = store.groups["model"].recorder
    assert observer.num_obs() == MAX_ORDINARY
    assert observer.counts.dropped == 3 * len(starts) - MAX_ORDINARY


class Concat(torch.nn.Module):
    """Takes any number of tensors: each number is another input structure."""

    in_features = 4

    def forward(self, *parts: torch.Tensor) -> torch.Tensor:
        return torch.cat(parts, dim=-1)


def test_calls_that_add_information_are_kept_beyond_the_ordinary_bound() -> None:
    store = SessionStore()
    module = Concat()
    for start in range(10, 10 + 3 * MAX_ORDINARY, 3):
        observe(store, module, "model", start, start + 1, start + 2)
    recorder = store.groups["model"].recorder
    dropped = recorder.counts.dropped
    with store.observe(module, "model", ObserveOptions(), "test"):
        module(torch.randn(100, 4))  # nothing new
        module(torch.randn(4, 4))  # batch equal to the features: a new pattern of sizes
        module(torch.randn(1, 4))  # batch 1
        module(torch.randn(2, 5, 4))  # a new structure (rank 3) ...
        module(torch.randn(2, 6, 4))  # ... whose second axis varies
        module(torch.randn(2, 7, 4))  # again: nothing new
    assert shapes_of(store)[MAX_ORDINARY:] == [(4, 4), (1, 4), (2, 5, 4), (2, 6, 4)]
    assert recorder.counts.dropped == dropped + 2
    with store.observe(module, "model", ObserveOptions(), "test"):
        for parts in range(2, 2 + MAX_OBSERVATIONS):  # new structures fill the room left, and no more
            module(*[torch.randn(3, 4)] * parts)
    assert recorder.num_obs() == MAX_OBSERVATIONS
    assert recorder.counts.dropped == dropped + 2 + MAX_OBSERVATIONS - (MAX_OBSERVATIONS - MAX_ORDINARY - 4)


def test_a_call_names_the_test_of_the_innermost_open_observer() -> None:
    store, model = SessionStore(), torch.nn.Linear(4, 2)
    with store.observe(model, "model", ObserveOptions(), "t.py::test_outer") as group:
        model(torch.randn(2, 4))
        with store.observe(model, "model", ObserveOptions(), "t.py::test_inner"):
            model(torch.randn(3, 4))
        model(torch.randn(5, 4))  # the inner observer is closed: the outer's call again
    assert [(o.args[0].shape[0], o.source) for o in group.recorder.observations] == [
        (2, "t.py::test_outer"), (3, "t.py::test_inner"), (5, "t.py::test_outer")]
    assert group.sources == ["t.py::test_outer", "t.py::test_inner"]


def test_a_value_that_is_no_module_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="'model' is a int, not a torch.nn.Module"):
        SessionStore().group_for(3, "model", ObserveOptions())


def test_unknown_marker_options_are_named() -> None:
    with pytest.raises(TypeError, match=r"where: unknown argument\(s\) \['colour'\]"):
        ObserveOptions.from_kwargs({"colour": "red"}, "where")


def test_a_decoding_loop_at_two_batch_sizes_in_one_test_keeps_each_new_size_pattern(tiny_llama) -> None:
    store = SessionStore()
    with torch.no_grad(), store.observe(tiny_llama, "llama", ObserveOptions(), "test") as group:
        for batch in (2, 3):
            input_ids = torch.randint(0, 100, (batch, 5))
            out = tiny_llama(input_ids=input_ids)
            for _ in range(2):
                out = tiny_llama(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=out.past_key_values)
    stored = [(tuple(o.kwargs["input_ids"].shape), o.kwargs.get("past_key_values") is not None)
              for o in group.recorder.observations]
    # the first three calls; then the prefill and the decode step whose batch is new to them
    assert stored == [((2, 5), False), ((2, 1), True), ((2, 1), True), ((3, 5), False), ((3, 1), True)]
    assert group.recorder.counts == CallCounts(stored=5, dropped=1)


def test_models_of_one_class_and_shapes_but_another_config_are_two_groups() -> None:
    from transformers import BertConfig, BertForSequenceClassification

    def bert(problem_type: str) -> torch.nn.Module:
        config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=20, num_labels=3, problem_type=problem_type)
        return BertForSequenceClassification(config).eval()

    single, multi, single_again = bert("single_label_classification"), bert("multi_label_classification"), \
        bert("single_label_classification")
    store = SessionStore()
    groups = [store.group_for(m, "BertForSequenceClassification", ObserveOptions())
              for m in (single, multi, single_again)]
    assert groups[0] is groups[2] is not groups[1]
    assert sorted(store.groups) == sorted(f"BertForSequenceClassification[{identity(m)}]" for m in (single, multi))


def trained(store: SessionStore, name: str) -> torch.nn.Linear:
    """A Linear observed while a test trains it one step (its gradients set)."""
    module = torch.nn.Linear(4, 2)
    with store.observe(module, name, ObserveOptions(), "test"):
        module(torch.randn(3, 4)).sum().backward()
    return module


def test_a_model_only_the_store_holds_is_put_away_without_its_gradients() -> None:
    """A test's model that nothing else holds is packed after the test, its gradients dropped;
    one a fixture still holds keeps them until that reference goes, and every kept model loses
    them once the tests are over."""
    store = SessionStore()
    trained(store, "dropped")
    held = trained(store, "held")
    store.put_away()
    assert store.groups["dropped"].kept.packed
    assert store.groups["dropped"].module.weight.grad is None
    assert not store.groups["held"].kept.packed
    assert held.weight.grad is not None and held.bias.grad is not None  # a fixture may still read them
    store.put_away()
    assert held.weight.grad is not None  # still reachable: looked at again at the next release
    del held
    store.put_away()
    assert store.groups["held"].kept.packed and store.groups["held"].module.weight.grad is None
    kept = trained(store, "kept to the end")
    store.release_gradients()
    assert kept.weight.grad is None and kept.bias.grad is None


def test_a_packed_model_leaves_memory_and_comes_back_as_observed() -> None:
    """Packed, the module's objects are freed (the garbage collector no longer walks them), its
    weights' storages kept as they are; read again, it is an equal module on the same storages,
    its tied weights still one, and the calls recorded on it are still the reference, while a
    call made on another instance is not."""
    import gc
    import weakref

    store = SessionStore()
    module = TiedHead()
    with store.observe(module, "tied", ObserveOptions(), "test") as group:
        expected = module(torch.tensor([[1, 2, 3]]))
    other = TiedHead()
    with store.observe(other, "tied", ObserveOptions(), "test"):
        other(torch.tensor([[4, 5]]))
    state = {name: tensor.clone() for name, tensor in module.state_dict().items()}
    memory = module.embed.weight.data_ptr()
    gone = weakref.ref(module)
    del module, other
    tracked = len(gc.get_objects())
    store.put_away()
    assert group.kept.packed and gone() is None
    assert len(gc.get_objects()) < tracked - 20  # the module, its submodules, their dicts and parameters
    aside = group.kept._storages  # what the collector still walks: one untyped storage per memory block
    assert len(aside) == 2 and all(type(s) is torch.UntypedStorage for s in aside)  # the tied weight, the buffer
    assert group.model_class == "models.TiedHead" and not group.kept.on_meta and group.kept.packed
    first, second = group.recorder.observations
    assert group.is_reference_valid(first.instance, first.weights_digest)
    assert not group.is_reference_valid(second.instance, second.weights_digest)
    unpacked = group.module
    assert type(unpacked) is TiedHead and unpacked.head.weight is unpacked.embed.weight
    assert {n: t for n, t in unpacked.state_dict().items()}.keys() == state.keys()
    for name, tensor in unpacked.state_dict().items():
        torch.testing.assert_close(tensor, state[name], rtol=0, atol=0)
    assert group.weights["head.weight"].data_ptr() == group.weights["embed.weight"].data_ptr()
    assert group.weights["embed.weight"].data_ptr() == unpacked.embed.weight.data_ptr()
    assert unpacked.embed.weight.data_ptr() == memory  # the same storage: never copied
    torch.testing.assert_close(unpacked(torch.tensor([[1, 2, 3]])), expected, rtol=0, atol=0)
    assert group.is_reference_valid(first.instance, first.weights_digest)  # the digest as packed


def test_a_model_on_the_meta_device_is_packed_and_skipped_without_being_unpacked() -> None:
    """A model built on the meta device for its configuration alone (timm's default-config
    tests) leaves the collector's walk too: packed with no storage aside, it still says it is on
    the meta device, which settles its group without unpacking it."""
    import weakref

    from pytest_exportobs.engine.settled import settled

    store = SessionStore()
    with torch.device("meta"):
        module = TiedHead()
    with store.observe(module, "meta", ObserveOptions(), "test") as group:
        module(torch.tensor([[1, 2, 3]], device="meta"))
    gone = weakref.ref(module)
    del module
    store.put_away()
    assert group.kept.packed and gone() is None and group.kept._storages == []
    result = settled(group)
    assert result is not None and (result.verdict, result.stage) == ("skipped", "observe")
    assert group.kept.packed and group.kept.on_meta  # read as packed
    assert group.module.embed.weight.is_meta and not group.kept.packed and group.kept.on_meta


def test_a_model_pickle_cannot_take_stays_as_it_is() -> None:
    """A module holding a lambda cannot be pickled: it stays in memory, unpacked, its calls the
    reference as before."""
    store = SessionStore()
    module = torch.nn.Linear(4, 2)
    module.scale = lambda x: 2 * x  # pickle cannot take a lambda
    name = observe(store, module, "lambda", 3)
    gone_id = id(module)
    del module
    store.put_away()
    group = store.groups[name]
    assert not group.kept.packed and not group.kept.packable and id(group.module) == gone_id
    observation = group.recorder.observations[0]
    assert group.is_reference_valid(observation.instance, observation.weights_digest)


class Attention(torch.nn.Module):
    """One projection split into ``heads`` heads; ``eps`` a constant of the same graph."""

    def __init__(self, heads: int = 2, eps: float = 1e-6, activation: str = "gelu") -> None:
        super().__init__()
        self.heads, self.eps, self.activation = heads, eps, activation
        self.proj = torch.nn.Linear(8, 8)
        self.dropout = torch.nn.Dropout(0.1)
        self.seen: list[int] = []  # state a model changes as it runs
        self.name_or_path = "/tmp/any-checkpoint"  # where it was loaded from


def test_instances_whose_graphs_differ_are_groups_of_their_own_and_constants_or_state_do_not_split() -> None:
    """Heads, a flag, an activation's name shape the graph; an epsilon is a constant of it, a
    dropout rate is inert in eval mode, a list is state, a checkpoint path is provenance."""
    base = identity(Attention())
    assert identity(Attention(heads=4)) != base
    assert identity(Attention(activation="silu")) != base
    same = Attention(eps=1.0)
    same.dropout.p, same.seen, same.name_or_path = 0.5, [1, 2], "/tmp/another"
    assert identity(same) == base


def test_a_cached_trace_tells_instances_apart_by_the_constants_their_graphs_bake_in() -> None:
    from pytest_exportobs.core.configuration import computation

    assert computation(Attention(eps=1.0)) == computation(Attention())
    assert computation(Attention(eps=1.0), constants=True) != computation(Attention(), constants=True)
