"""Observing leaves the module intact: copies, pickles, ``state_dict``, torch.compile, tracing and
nested observers behave as without observation, and the module and its class are exactly as
before once the last observer leaves."""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import pickle
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from pytest_exportobs import InputObserver  # noqa: E402
from pytest_exportobs.observe.recorder import CallCounts  # noqa: E402

from models import MLP, Scorer  # noqa: E402

X = torch.randn(3, 8)


def layout(model: torch.nn.Module) -> tuple[dict[str, int], dict[str, int]]:
    """What observing must leave as it was: the instance's and its class's attributes."""
    return {k: id(v) for k, v in vars(model).items()}, {k: id(v) for k, v in vars(type(model)).items()}


def mlp() -> MLP:
    torch.manual_seed(0)
    return MLP().eval()


def saved(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def test_a_deep_copy_computes_with_its_own_weights_and_is_not_observed() -> None:
    model, observer = mlp(), InputObserver()
    with observer(model):
        twin = copy.deepcopy(model)
        with torch.no_grad():
            twin.l2.bias.add_(1.0)
        got = twin(X)
        model(X)
    torch.testing.assert_close(got, model(X) + 1.0)
    assert "forward" not in vars(twin)
    assert observer.counts == CallCounts(stored=1)


def test_pickles_and_state_dicts_are_those_of_the_unobserved_module() -> None:
    model = mlp()
    expected = (saved(model), pickle.dumps(model), model.state_dict())
    with InputObserver()(model):
        model(X)
        got = (saved(model), pickle.dumps(model), model.state_dict())
    assert got[:2] == expected[:2]
    assert got[2].keys() == expected[2].keys()
    assert all(torch.equal(got[2][k], v) for k, v in expected[2].items())


def scaled(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x * factor


def test_an_own_forward_attribute_is_copied_and_pickled_as_the_original() -> None:
    model = mlp()
    own = functools.partial(scaled, factor=2.0)
    model.forward = own
    expected = saved(model)
    observer = InputObserver()
    with observer(model):
        twin = copy.deepcopy(model)
        assert saved(model) == expected
        torch.testing.assert_close(model(X), X * 2.0)
    assert type(vars(twin)["forward"]) is functools.partial and vars(twin)["forward"] is not own
    assert vars(model)["forward"] is own
    assert observer.num_obs() == 1


def test_torch_compile_with_fullgraph_traces_the_model_unobserved() -> None:
    torch.compiler.reset()
    model, observer = mlp(), InputObserver()
    expected = model(X)
    with observer(model):
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        torch.testing.assert_close(compiled(X), expected)
        model(X)
    assert observer.counts == CallCounts(stored=1)  # the eager call only
    torch.testing.assert_close(compiled(X), expected)


@pytest.mark.filterwarnings("ignore:`torch.jit.trace:DeprecationWarning")
def test_torch_export_and_jit_trace_in_a_block_see_the_model_and_are_not_recorded() -> None:
    model, observer = mlp(), InputObserver()
    expected_code = torch.jit.trace(model, X, check_trace=False).code
    with observer(model):
        exported = torch.export.export(model, (X,))
        traced = torch.jit.trace(model, X, check_trace=False)  # its check would call the model eagerly
    assert traced.code == expected_code
    torch.testing.assert_close(exported.module()(X), model(X))
    assert observer.counts == CallCounts()


def test_overlapping_observers_both_record_and_unwind_in_any_order() -> None:
    """The marker's block ends before ``watch()``'s (at teardown): exits are not nested."""
    model = mlp()
    before = layout(model)
    first, second = InputObserver(), InputObserver()
    with contextlib.ExitStack() as first_block, contextlib.ExitStack() as second_block:
        first_block.enter_context(first(model))
        model(torch.randn(2, 8))
        second_block.enter_context(second(model))
        model(torch.randn(3, 8))
        first_block.close()
        model(torch.randn(4, 8))
    assert layout(model) == before
    assert [o.args[0].shape[0] for o in first.observations] == [2, 3]
    assert [o.args[0].shape[0] for o in second.observations] == [3, 4]


def test_one_observer_entered_twice_records_each_call_once() -> None:
    model, observer = mlp(), InputObserver()
    with observer(model), observer(model):
        model(X)
        model(X)
    assert observer.counts == CallCounts(stored=1, duplicates=1)
    assert "forward" not in vars(model)


def test_direct_forward_calls_and_other_methods_are_observed() -> None:
    model = Scorer()
    forward, encode = InputObserver(), InputObserver()
    with forward(model), encode(model, method_name="encode"):
        model.forward(torch.randn(2, 16))
        model(torch.randn(3, 16))
        model.encode(torch.randn(4, 16))
    assert [o.args[0].shape[0] for o in forward.observations] == [2, 3]
    assert [o.args[0].shape[0] for o in encode.observations] == [4]


def test_other_instances_and_subclasses_are_not_observed() -> None:
    class Wider(MLP):
        pass

    model, other, sub = mlp(), MLP(), Wider()
    before = layout(sub), vars(MLP).copy()
    observer, sub_observer = InputObserver(), InputObserver()
    with observer(model), sub_observer(sub):
        other(X)
        sub(torch.randn(2, 8))
        model(torch.randn(5, 8))
    assert [o.args[0].shape[0] for o in observer.observations] == [5]
    assert [o.args[0].shape[0] for o in sub_observer.observations] == [2]
    assert (layout(sub), vars(MLP).copy()) == before


def test_a_submodule_is_no_method_to_observe() -> None:
    model = mlp()
    with pytest.raises(ValueError, match=r"^MLP.l1 is no method of the class: it cannot be observed$"):
        with InputObserver()(model, method_name="l1"):
            pass
    assert "l1" in model._modules and "l1" not in vars(model)


def test_the_class_is_restored_when_the_block_raises() -> None:
    model = mlp()
    before = layout(model)
    with pytest.raises(KeyboardInterrupt), InputObserver()(model):
        model(X)
        raise KeyboardInterrupt
    assert layout(model) == before


def test_a_method_someone_else_replaced_meanwhile_is_left_to_them(monkeypatch: pytest.MonkeyPatch) -> None:
    def replaced(self: MLP, x: torch.Tensor) -> torch.Tensor:
        return x

    with InputObserver()(mlp()):
        monkeypatch.setattr(MLP, "forward", replaced)
    assert MLP.forward is replaced


def test_twenty_thousand_calls_store_one_copy_and_count_the_rest() -> None:
    model, observer = mlp(), InputObserver()
    inputs = [torch.randn(2, 8) for _ in range(4)]
    with torch.no_grad(), observer(model):
        for i in range(20_000):
            model(inputs[i % 4])
    assert observer.counts == CallCounts(stored=1, duplicates=19_999)
    assert observer.observations[0].calls == 20_000
