"""Pooling the observations of xdist workers, in process: two workers' stores in one directory,
the names one process would give, exclusive claims, bounded absorption, silent workers."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils import _pytree

from pytest_exportobs.core.cache_pytrees import register_flattening_functions
from pytest_exportobs.core.caches import make_dynamic_cache
from pytest_exportobs.observe.store import MAX_OBSERVATIONS, MAX_ORDINARY, ObserveOptions, SessionStore, identity
from pytest_exportobs.observe.transfer import FOREIGN_INSTANCE, pooled_names
from pytest_exportobs.plugin import pooling, relay
from pytest_exportobs.plugin.pooling import Pool, admit, mark_down


def observe(store: SessionStore, module: torch.nn.Module, *batches: int, test: str = "test") -> None:
    """One test per batch, named ``<test>[<batch>]``."""
    for batch in batches:
        with store.observe(module, type(module).__qualname__, ObserveOptions(), f"{test}[{batch}]"):
            module(torch.randn(batch, module.in_features))


def collection_order(*tests: str) -> Callable[[str], int]:
    """The position of each test's node id, as a worker reads it from the session's items."""
    return {test: index for index, test in enumerate(tests)}.__getitem__


def worker(directory: Path, name: str) -> Pool:
    admit(directory, name)  # as the controller does when it starts the worker
    return Pool(directory, name)


def test_two_workers_pool_their_calls_and_each_model_is_checked_once(tmp_path: Path) -> None:
    torch.manual_seed(0)
    gw0, gw1 = worker(tmp_path, "gw0"), worker(tmp_path, "gw1")
    store0, store1 = SessionStore(), SessionStore()
    shared0, shared1 = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)  # one model, built on each worker
    wide = torch.nn.Linear(8, 2)  # only on gw1: same class name, other parameters
    observe(store0, shared0, 2, 3, test="test_a")
    observe(store1, shared1, 3, 5, test="test_b")  # batch 3 again: one signature
    observe(store1, wide, 4, test="test_c")
    assert sorted(store1.groups) == [f"Linear[{identity(shared1)}]", f"Linear[{identity(wide)}]"]
    assert sorted(store0.groups) == ["Linear"]  # gw0 saw one Linear: unsuffixed there

    gw0.offer(store0)
    gw1.offer(store1)
    assert gw0.wait() == gw1.wait() == []
    order = collection_order("test_a[2]", "test_a[3]", "test_b[3]", "test_b[5]", "test_c[4]")
    claims0 = gw0.claims(store0, order)
    first = [next(claims0)]  # gw0 checks it before it asks for another
    second = list(gw1.claims(store1, order))
    assert list(claims0) == []  # nothing left to take from gw1

    shared_name, wide_name = f"Linear[{identity(shared0)}]", f"Linear[{identity(wide)}]"
    assert [g.name for g in first] == [shared_name]  # claimed by the first to ask
    assert [g.name for g in second] == [wide_name]  # the shared model was claimed already
    assert store0.renamed == {"Linear": shared_name}  # what gw0's tests recorded -> the pooled name
    group = first[0]
    assert group.module is shared0
    calls = [(tuple(o.args[0].shape), o.instance == id(shared0), o.calls) for o in group.recorder.observations]
    assert calls == [((2, 4), True, 1), ((3, 4), True, 2), ((5, 4), False, 1)]
    # a call of another worker travels without its outputs: no reference here
    assert [o.outputs is None for o in group.recorder.observations] == [False, False, True]
    assert group.sources == ["test_a[2]", "test_a[3]", "test_b[3]", "test_b[5]"]
    assert not group.is_reference_valid(FOREIGN_INSTANCE, group.recorder.observations[2].weights_digest)


def test_absorbed_calls_keep_the_session_bound_and_caches_round_trip(tmp_path: Path) -> None:
    gw0, gw1 = worker(tmp_path, "gw0"), worker(tmp_path, "gw1")
    store0, store1 = SessionStore(), SessionStore()
    model0, model1 = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    # gw1 ran the first tests of the suite, gw0 the later ones: as one process, gw1's calls come first
    observe(store1, model1, *range(100, 100 + MAX_OBSERVATIONS), test="test_early")
    with store1.observe(model1, "Linear", ObserveOptions(), "test_sequences"):
        model1(torch.randn(2, 7, 4))  # a new input structure: information gw0 lacks
    observe(store0, model0, *range(2, 2 + MAX_OBSERVATIONS), test="test_late")
    assert store0.groups["Linear"].recorder.num_obs() == MAX_ORDINARY  # one axis varied: ordinary calls only
    gw0.offer(store0)
    gw1.offer(store1)
    gw0.wait()
    order = collection_order(*(f"test_early[{b}]" for b in range(100, 100 + MAX_OBSERVATIONS)), "test_sequences",
                             *(f"test_late[{b}]" for b in range(2, 2 + MAX_OBSERVATIONS)))
    (group,) = gw0.claims(store0, order)
    shapes = [tuple(o.args[0].shape) for o in group.recorder.observations]
    # gw1's first 24 tests fill the ordinary room, its new structure adds information, and of gw0's
    # only the batch equal to the features (a new pattern of equal sizes)
    assert shapes == [(b, 4) for b in range(100, 100 + MAX_ORDINARY)] + [(2, 7, 4), (4, 4)]
    # checked on gw1's instance, as one process would (the earliest test observed it): every call another's
    assert [o.instance == FOREIGN_INSTANCE for o in group.recorder.observations] == [True] * 26
    every_call = 2 * MAX_OBSERVATIONS + 1  # those each worker's bound kept and those it stored nothing for
    assert (group.recorder.counts.stored, group.recorder.counts.dropped) == (26, every_call - 26)
    assert group.module is not model0 and torch.equal(group.module.weight, model1.weight)
    assert group.sources[0] == "test_early[100]" and group.sources[-1] == "test_late[33]"


class Opaque:
    """An argument whose flattening fails: the call runs, but cannot be recorded."""

    def __init__(self, scale: float) -> None:
        self.scale = scale


def _refuse_to_flatten(obj: Opaque) -> Any:
    raise TypeError("cannot flatten Opaque")


class ScaledLinear(torch.nn.Linear):
    def forward(self, x: torch.Tensor, opaque: Opaque | None = None) -> torch.Tensor:
        return super().forward(x) * (1.0 if opaque is None else opaque.scale)


def test_the_claiming_worker_counts_every_call_each_worker_saw_and_why_some_were_not_recorded(
    tmp_path: Path,
) -> None:
    gw0, gw1 = worker(tmp_path, "gw0"), worker(tmp_path, "gw1")
    store0, store1 = SessionStore(), SessionStore()
    model0, model1 = ScaledLinear(4, 2), ScaledLinear(4, 2)
    observe(store0, model0, 2, test="test_a")
    gw0.save(store0)  # as after each test: the later calls of batch 2 are in no saved file
    observe(store0, model0, 2, 2, test="test_b")
    observe(store1, model1, *range(3, 3 + MAX_OBSERVATIONS + 5), test="test_c")  # more than its bound keeps
    _pytree.register_pytree_node(Opaque, _refuse_to_flatten, lambda leaves, context: Opaque(*leaves))
    try:
        with store1.observe(model1, "ScaledLinear", ObserveOptions(), "test_d"):
            assert model1(torch.ones(1, 4), Opaque(0.0)).abs().sum() == 0  # the call runs unrecorded
    finally:
        _pytree._deregister_pytree_node(Opaque)
    gw0.offer(store0)
    gw1.offer(store1)
    gw0.wait()
    order = collection_order("test_a[2]", "test_b[2]", *(f"test_c[{b}]" for b in range(3, 3 + MAX_OBSERVATIONS + 5)),
                             "test_d")
    (group,) = gw0.claims(store0, order)

    counts = group.recorder.counts
    assert sum(vars(counts).values()) == 3 + (MAX_OBSERVATIONS + 5) + 1  # gw0's three calls, gw1's
    assert (counts.stored, counts.duplicates, counts.failed) == (MAX_ORDINARY, 2, 1)
    assert group.recorder.observations[0].calls == 3  # batch 2: once before gw0's save, twice after
    assert group.recorder.errors == ["TypeError: cannot flatten Opaque"]


class CacheReader(torch.nn.Module):
    def forward(self, x: torch.Tensor, cache: object) -> torch.Tensor:
        return x + cache.layers[0].keys.sum()


def test_a_crashed_workers_saved_calls_are_checked_on_a_live_worker_with_the_module_it_saved(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    gw0, gw1 = worker(tmp_path, "gw0"), worker(tmp_path, "gw1")
    cache = make_dynamic_cache([(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))])
    reader, store0 = CacheReader(), SessionStore()
    with register_flattening_functions():
        with store0.observe(reader, "CacheReader", ObserveOptions(), "test_read"):
            reader(torch.randn(1, 4), cache)
        gw0.save(store0)  # after its test, as the worker does
        with store0.observe(reader, "CacheReader", ObserveOptions(), "test_crashing"):
            reader(torch.randn(5, 4), cache)  # the worker dies in this test: never saved
    mark_down(tmp_path, "gw0")
    gw1.offer(None)
    assert gw1.wait() == []
    with register_flattening_functions():
        (group,) = gw1.claims(None, collection_order("test_read", "test_crashing"))
    assert group.name == "CacheReader" and group.module is not reader
    assert type(group.module) is CacheReader and group.identity == identity(reader)
    (call,) = group.recorder.observations
    assert call.instance == FOREIGN_INSTANCE and tuple(call.args[0].shape) == (1, 4)
    assert type(call.args[1]).__name__ == "DynamicCache"
    torch.testing.assert_close(call.args[1].layers[0].keys, cache.layers[0].keys)
    assert group.sources == ["test_read"]
    assert gw1.renames() == {"gw0": {"CacheReader": "CacheReader"}}


def test_a_module_that_cannot_be_saved_is_named_in_a_note(tmp_path: Path) -> None:
    class Local(torch.nn.Linear):  # defined in a function: pickle cannot find it again
        pass

    pool, store = worker(tmp_path, "gw0"), SessionStore()
    observe(store, Local(4, 2), 2)
    pool.save(store)
    (note,) = pool.notes
    name = "test_a_module_that_cannot_be_saved_is_named_in_a_note.<locals>.Local"  # the group: its qualname
    assert note.startswith(f"exportobs: {name} could not be saved for the other workers (")
    assert f"Can't pickle local object '{name}'" in note
    assert note.endswith("): a crash of gw0 would lose it")


def test_a_model_asked_for_hidden_states_is_saved_and_rebuilt_without_transformers_own_hooks(
        tmp_path: Path) -> None:
    """transformers installs closures as forward hooks the first time a call asks for hidden
    states: the record leaves them out, the original keeps them, the rebuilt model installs them
    again and computes what the original does."""
    transformers = pytest.importorskip("transformers")
    from models import tiny_llama_config

    torch.manual_seed(0)
    model = transformers.LlamaModel(tiny_llama_config()).eval()
    ids = torch.randint(0, 100, (2, 5))
    store, gw0, gw1 = SessionStore(), worker(tmp_path, "gw0"), worker(tmp_path, "gw1")
    with store.observe(model, "llama", ObserveOptions(), "test_states"):
        expected = model(ids, output_hidden_states=True).hidden_states
    hooks = sum(len(m._forward_hooks) for m in model.modules())
    assert hooks > 0 and model._output_capturing_hooks_installed
    gw0.save(store)
    assert gw0.notes == []
    assert sum(len(m._forward_hooks) for m in model.modules()) == hooks and model._output_capturing_hooks_installed
    mark_down(tmp_path, "gw0")
    gw1.offer(None)
    (group,) = gw1.claims(None, collection_order("test_states"))
    assert group.module is not model and "_output_capturing_hooks_installed" not in vars(group.module)
    rebuilt_states = group.module(ids, output_hidden_states=True).hidden_states
    assert len(rebuilt_states) == len(expected) == 3
    for got, want in zip(rebuilt_states, expected):
        torch.testing.assert_close(got, want)


def test_a_worker_that_went_down_is_not_waited_for_and_a_silent_one_only_until_the_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gw0, _ = worker(tmp_path, "gw0"), worker(tmp_path, "gw1")
    worker(tmp_path, "gw2")
    gw0.offer(None)
    mark_down(tmp_path, "gw1")  # crashed: the controller says so
    now = iter([0.0, 1.0, pooling.WAIT_SECONDS + 1])
    monkeypatch.setattr(pooling, "_POLL_SECONDS", 0.0)
    assert gw0.wait(clock=lambda: next(now)) == [
        f"exportobs: worker(s) gw2 wrote no manifest within {pooling.WAIT_SECONDS:g} s; "
        "the models were checked with the calls they had saved"]
    assert list(gw0.claims(None, collection_order())) == []


def test_pooled_names_split_a_base_name_only_when_several_identities_share_it() -> None:
    assert pooled_names([("lm", "A-1"), ("Bert", "B-2"), ("lm", "A-1"), ("Bert", "B-3")]) == {
        ("lm", "A-1"): "lm", ("Bert", "B-2"): "Bert[B-2]", ("Bert", "B-3"): "Bert[B-3]"}


def remote(directory: Path, name: str, roots: list[str] | None = None) -> relay.Relay:
    """A worker on another host: the controller admits it, it writes nothing in ``directory``."""
    admit(directory, name)
    return relay.Relay(name, roots or [])


def relayed(directory: Path, worker: str, properties: list[tuple[str, object]]) -> list[tuple[str, object]]:
    """What the controller does with a remote worker's test report: its saves written into the
    pool, the report's other properties left."""
    report = pytest.TestReport("test", ("test.py", 0, "test"), {}, "passed", None, "teardown",
                               user_properties=properties)
    pooling.write_saves(directory, worker, relay.taken_relays(report))
    return report.user_properties


def test_a_remote_workers_calls_travel_on_its_reports_and_a_local_worker_checks_its_model(tmp_path: Path) -> None:
    torch.manual_seed(0)
    local, far = worker(tmp_path, "gw0"), remote(tmp_path, "gw1", roots=["tests"])
    store0, store1 = SessionStore(), SessionStore()
    model0, model1, only_far = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2), torch.nn.Linear(6, 2)
    observe(store0, model0, 2, test="test_a")
    observe(store1, model1, 3, test="test_b")
    properties: list[tuple[str, object]] = [("metric", 1)]
    far.save(store1, properties)  # after test_b: on its teardown report
    (save,) = [value for key, value in properties if key == relay.RELAY_PROPERTY]
    assert sorted(save) == ["calls", "first", "key", "order", "record", "roots"]  # type: ignore[arg-type]
    assert {type(value) for value in save.values()} <= {list, int, bytes}  # type: ignore[union-attr]
    assert relayed(tmp_path, "gw1", properties) == [("metric", 1)]
    observe(store1, model1, 5, test="test_c")  # sent with the worker's output, as it goes down
    observe(store1, only_far, 7, test="test_d")
    relay.write_offer(tmp_path, "gw1", far.offer(store1))
    mark_down(tmp_path, "gw1")

    local.offer(store0)
    assert local.wait() == []
    order = collection_order("test_a[2]", "test_b[3]", "test_c[5]", "test_d[7]")
    claimed = list(local.claims(store0, order))
    shared_name, far_name = f"Linear[{identity(model0)}]", f"Linear[{identity(only_far)}]"
    assert [g.name for g in claimed] == [shared_name, far_name]  # its own, then the one no local worker holds
    shared, rebuilt = claimed
    assert shared.module is model0 and [tuple(o.args[0].shape) for o in shared.recorder.observations] == [
        (2, 4), (3, 4), (5, 4)]
    assert type(rebuilt.module) is torch.nn.Linear and rebuilt.module is not only_far
    torch.testing.assert_close(rebuilt.module.weight, only_far.weight)
    assert list(pooling.Pool(tmp_path, "controller").claims(None, order)) == []  # nothing left for it
    assert local.renames() == {}  # gw1 wrote a manifest (through the controller): not a crashed worker
    assert pooling.Pool(tmp_path, "controller").renames(["gw1"]) == {  # what its tests recorded -> pooled
        "gw1": {shared_name: shared_name, far_name: far_name, "Linear": shared_name}}


def test_when_every_worker_is_remote_the_controller_claims_every_model(tmp_path: Path) -> None:
    gw0, gw1 = remote(tmp_path, "gw0"), remote(tmp_path, "gw1")
    store0, store1 = SessionStore(), SessionStore()
    model0, model1 = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    observe(store0, model0, 2, 3, test="test_a")
    observe(store1, model1, 5, test="test_b")
    for name, side, store in (("gw0", gw0, store0), ("gw1", gw1, store1)):
        relay.write_offer(tmp_path, name, side.offer(store))
        mark_down(tmp_path, name)
    (group,) = pooling.Pool(tmp_path, "controller").claims(
        None, collection_order("test_a[2]", "test_a[3]", "test_b[5]"))
    assert group.name == "Linear" and group.sources == ["test_a[2]", "test_a[3]", "test_b[5]"]
    assert [(tuple(o.args[0].shape), o.instance) for o in group.recorder.observations] == [
        ((2, 4), FOREIGN_INSTANCE), ((3, 4), FOREIGN_INSTANCE), ((5, 4), FOREIGN_INSTANCE)]
    assert pooling.claimed(tmp_path) == {"Linear": "controller"}


def test_a_worker_sees_the_pool_only_where_the_controller_wrote_its_token(tmp_path: Path) -> None:
    token = pooling.open_pool(tmp_path / "pool")
    here = {"workerid": "gw0", pooling.POOL_KEY: str(tmp_path / "pool"), pooling.TOKEN_KEY: token}
    assert pooling.sees(here)
    assert not pooling.sees({**here, pooling.TOKEN_KEY: "another session's"})
    assert not pooling.sees({**here, pooling.POOL_KEY: str(tmp_path / "elsewhere")})
    assert not pooling.sees({"workerid": "gw0"})  # a controller that named none


def test_a_remote_workers_import_roots_are_found_under_the_rootdir_or_beside_the_paths_given(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    (pytester.path / "suite" / "tests").mkdir(parents=True)
    config = pytester.parseconfig(str(pytester.path / "suite"))
    monkeypatch.setattr("sys.path", [str(config.rootpath / "suite" / "tests"), "/elsewhere", ""])
    assert relay.import_roots(config) == ["suite/tests", "."]
    # a worker whose rootdir was the copy of ``suite`` (--rsyncdir) sent "tests": here under suite/
    assert relay.import_paths(config, ["tests", "suite/tests", "missing"]) == [
        str(pytester.path / "suite" / "tests")]


def test_a_model_no_checking_worker_holds_is_rebuilt_from_the_instance_the_earliest_test_observed(
    tmp_path: Path,
) -> None:
    """As one process keeps the first instance it observes: gw1 ran the earlier test, its
    instance is checked although gw0's name sorts first."""
    gw0, gw1 = remote(tmp_path, "gw0"), remote(tmp_path, "gw1")
    store0, store1 = SessionStore(), SessionStore()
    late, early = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)  # one identity, other weights
    observe(store0, late, 3, test="test_late")
    observe(store1, early, 2, test="test_early")
    for name, side, store in (("gw0", gw0, store0), ("gw1", gw1, store1)):
        relay.write_offer(tmp_path, name, side.offer(store))
        mark_down(tmp_path, name)
    (group,) = pooling.Pool(tmp_path, "controller").claims(None, collection_order("test_early[2]", "test_late[3]"))
    torch.testing.assert_close(group.module.weight, early.weight)
    assert group.sources == ["test_early[2]", "test_late[3]"]


def test_a_worker_holding_a_later_instance_checks_the_one_the_earliest_test_observed(tmp_path: Path) -> None:
    """Whichever worker claims a model, it is checked on the instance one process would have kept:
    gw0 claims first but ran the later test, so gw1's instance is rebuilt and gw0's calls join as
    another process's (no outputs, no reference)."""
    torch.manual_seed(0)
    gw0, gw1 = worker(tmp_path, "gw0"), worker(tmp_path, "gw1")
    store0, store1 = SessionStore(), SessionStore()
    late, early = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)  # one identity, other weights
    observe(store0, late, 3, test="test_late")
    observe(store1, early, 2, test="test_early")
    gw0.offer(store0)
    gw1.offer(store1)
    assert gw0.wait() == gw1.wait() == []
    order = collection_order("test_early[2]", "test_late[3]")
    (group,) = gw0.claims(store0, order)
    assert list(gw1.claims(store1, order)) == []
    assert group.module is not late and group.module is not early
    torch.testing.assert_close(group.module.weight, early.weight)
    calls = [(tuple(o.args[0].shape), o.instance, o.outputs is None) for o in group.recorder.observations]
    assert calls == [((2, 4), FOREIGN_INSTANCE, True), ((3, 4), FOREIGN_INSTANCE, True)]
    assert group.sources == ["test_early[2]", "test_late[3]"]
    assert len(store0.groups["Linear"].recorder.observations[0].outputs) == 1  # the worker's own store untouched


def test_a_worker_done_with_its_own_models_takes_the_others_unclaimed_from_the_end_of_their_turn(
    tmp_path: Path,
) -> None:
    """gw1's tests observed three models, gw0's one: once gw0 has checked its own, it takes gw1's
    least observed, rebuilt from what gw1 saved (every call another process's), while gw1 goes
    on from its most observed; each model is checked once."""
    torch.manual_seed(0)
    gw0, gw1 = worker(tmp_path, "gw0"), worker(tmp_path, "gw1")
    store0, store1 = SessionStore(), SessionStore()
    small = torch.nn.Linear(4, 2)
    observe(store0, small, 2, test="test_small")
    most, middle, least = torch.nn.Linear(5, 2), torch.nn.Linear(6, 2), torch.nn.Linear(7, 2)
    observe(store1, most, 1, 2, 3, test="test_most")
    observe(store1, middle, 1, 2, test="test_middle")
    observe(store1, least, 4, test="test_least")
    gw0.offer(store0)
    gw1.offer(store1)
    assert gw0.wait() == gw1.wait() == []
    order = collection_order("test_small[2]", *(f"test_most[{b}]" for b in (1, 2, 3)), "test_middle[1]",
                             "test_middle[2]", "test_least[4]")
    claims0, claims1 = gw0.claims(store0, order), gw1.claims(store1, order)
    name = {id(m): f"Linear[{identity(m)}]" for m in (small, most, middle, least)}
    assert next(claims0).module is small  # its own first
    assert next(claims1).name == name[id(most)]  # gw1 begins its turn
    stolen = next(claims0)
    assert stolen.name == name[id(least)] and stolen.module is not least
    torch.testing.assert_close(stolen.module.weight, least.weight)
    assert [(tuple(o.args[0].shape), o.instance, o.outputs is None) for o in stolen.recorder.observations] == [
        ((4, 7), FOREIGN_INSTANCE, True)]
    assert stolen.sources == ["test_least[4]"]
    assert [g.name for g in claims1] == [name[id(middle)]]
    assert list(claims0) == []
    assert pooling.claimed(tmp_path) == {name[id(small)]: "gw0", name[id(most)]: "gw1", name[id(middle)]: "gw1",
                                         name[id(least)]: "gw0"}


def test_a_rebuilt_group_keeps_the_shapes_and_weights_first_observed(tmp_path: Path) -> None:
    """A model resized after its first calls (resize_token_embeddings) is saved after the test:
    the process that rebuilds it still checks the early calls on the weights they were made with."""
    store, embed = SessionStore(), torch.nn.Embedding(10, 4)
    first = embed.weight.data
    with store.observe(embed, "Embedding", ObserveOptions(), "test_resize"):
        embed(torch.tensor([[1, 9]]))
        embed.weight = torch.nn.Parameter(torch.randn(6, 4))  # smaller: the first call's id 9 is gone
        embed(torch.tensor([[1, 5]]))
    gw0 = remote(tmp_path, "gw0")
    relay.write_offer(tmp_path, "gw0", gw0.offer(store))
    mark_down(tmp_path, "gw0")
    (group,) = pooling.Pool(tmp_path, "controller").claims(None, collection_order("test_resize"))
    assert group.parameters == [("weight", (10, 4), "torch.float32")]
    torch.testing.assert_close(group.weights["weight"], first)
    assert tuple(group.module.weight.shape) == (6, 4)


def test_the_layout_of_a_call_reads_the_same_in_every_process() -> None:
    """xdist workers run with their own hash seeds: a call's layout is matched in another process."""
    from pytest_exportobs.observe.weights import layout_digest

    code = ("from pytest_exportobs.observe.weights import layout_digest;"
            "print(layout_digest([('embed.weight', (10, 4), 'torch.float32')]))")
    seen = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip() for seed in ("1", "2")}
    assert seen == {str(layout_digest([("embed.weight", (10, 4), "torch.float32")]))}
