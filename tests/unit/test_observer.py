"""InputObserver: recording, seed-compatible outputs (checked against torch.onnx.InputObserver),
restoring the observed method, bounded memory and clear errors."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch.utils import _pytree  # noqa: E402

from pytest_exportobs import InputObserver, string_type  # noqa: E402
from pytest_exportobs.observe.recorder import CallCounts  # noqa: E402

from models import cache_argument  # noqa: E402

DYN = torch.export.Dim.DYNAMIC
Call = tuple[tuple[Any, ...], dict[str, Any]]  # (args, kwargs) of one call


# -- helpers ---------------------------------------------------------------------------------


def observe(
    model: torch.nn.Module,
    calls: Sequence[Call],
    observer: InputObserver | None = None,
    store_n_calls: int = 3,
) -> InputObserver:
    """Call ``model`` with every ``(args, kwargs)`` of ``calls`` inside one observer block."""
    observer = observer if observer is not None else InputObserver()
    with torch.no_grad(), observer(model, store_n_calls=store_n_calls):
        for args, kwargs in calls:
            model(*args, **kwargs)
    return observer


def oracle_class() -> type:
    """``torch.onnx.InputObserver`` (torch >= 2.11), the reference implementation."""
    oracle = getattr(torch.onnx, "InputObserver", None)
    if oracle is None:
        pytest.skip("torch.onnx.InputObserver needs torch >= 2.11")
    return oracle


def seed_outputs(observer: Any, **infer_options: Any) -> tuple[int, Any, str]:
    """``num_obs()``, ``infer_dynamic_shapes()`` and the shapes of ``infer_arguments()``."""
    return (
        observer.num_obs(),
        observer.infer_dynamic_shapes(**infer_options),
        string_type(observer.infer_arguments(), with_shape=True),
    )


def n_tensors(tree: Any) -> int:
    return sum(isinstance(t, torch.Tensor) for t in _pytree.tree_leaves(tree))


def export_size_oblivious(model: torch.nn.Module, kwargs: dict, dynamic_shapes: Any) -> Any:
    """``torch.export.export`` as ``torch.onnx.export(dynamo=True)`` runs it: sizes 0 and 1 in
    the example stay dynamic (decode steps have one token, a missing image zero images)."""
    with torch.fx.experimental._config.patch(backed_size_oblivious=True):
        return torch.export.export(model, (), kwargs=kwargs, dynamic_shapes=dynamic_shapes)


def assert_same_outputs(exported: Any, model: torch.nn.Module, kwargs: dict) -> None:
    with torch.no_grad():
        torch.testing.assert_close(exported.module()(**kwargs), model(**kwargs))


# -- models ----------------------------------------------------------------------------------


class AddModel(torch.nn.Module):
    def forward(self, x, y):
        return x + y


class CacheLM(torch.nn.Module):
    """A decoder in miniature: attention over the cached keys/values and the new tokens."""

    heads, head_dim, layers, vocab = 2, 4, 2, 50

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(self.vocab, self.heads * self.head_dim)
        self.head = torch.nn.Linear(self.heads * self.head_dim, self.vocab)

    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids)

    def attend(self, h: torch.Tensor, attention_mask: torch.Tensor | None, past_key_values: Any) -> torch.Tensor:
        batch, seq, _ = h.shape
        q = h.view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        mask = None if attention_mask is None else attention_mask[:, None, None, :].bool()
        for i in range(self.layers):
            k = v = q
            if past_key_values is not None:
                k = torch.cat([past_key_values.layers[i].keys, k], dim=2)
                v = torch.cat([past_key_values.layers[i].values, v], dim=2)
            q = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.head(q.transpose(1, 2).reshape(batch, seq, -1))

    def forward(self, input_ids, attention_mask=None, past_key_values=None):
        return self.attend(self.hidden(input_ids), attention_mask, past_key_values)


class MultimodalLM(CacheLM):
    """Images (``pixel_values``) are given at prefill only; zero images add nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.vision = torch.nn.Linear(3 * 16 * 16, self.heads * self.head_dim)

    def forward(self, input_ids, pixel_values=None, attention_mask=None, past_key_values=None):
        h = self.hidden(input_ids)
        if pixel_values is not None:
            h = h + self.vision(pixel_values.flatten(1)).sum(dim=0)
        return self.attend(h, attention_mask, past_key_values)


class WithOptions(torch.nn.Module):
    """Tensor inputs, a nested optional input and constant options with defaults."""

    def forward(self, x, extra=None, flag=False, scale=1.0, mode="add"):
        y = x * scale
        if extra is not None:
            y = y + extra["t"].sum() * extra.get("k", 1)
        if flag:
            y = -y
        return y + 1 if mode == "add" else y


@pytest.fixture
def cache_tools() -> Iterator[tuple[Callable, Callable]]:
    """``(make_dynamic_cache, register_flattening_functions)``, transformers required."""
    pytest.importorskip("transformers")
    from pytest_exportobs import make_dynamic_cache, register_flattening_functions

    yield make_dynamic_cache, register_flattening_functions


def kv_cache(make_dynamic_cache: Callable, batch: int, past: int, layers: int = 2) -> Any:
    shape = (batch, CacheLM.heads, past, CacheLM.head_dim)
    return make_dynamic_cache([(torch.randn(shape), torch.randn(shape)) for _ in range(layers)])


def ids(batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, CacheLM.vocab, (batch, seq))


def ones(batch: int, seq: int) -> torch.Tensor:
    return torch.ones(batch, seq, dtype=torch.int64)


def prefill_then_decode(
    make_dynamic_cache: Callable, batch: int, prompt: int, steps: int, **prefill: Any
) -> list[Call]:
    """The calls of a greedy generation: the prompt without a cache, then one token per step."""
    calls: list[Call] = [((), dict(input_ids=ids(batch, prompt), **prefill, attention_mask=ones(batch, prompt)))]
    for past in range(prompt, prompt + steps):
        calls.append(((), dict(
            input_ids=ids(batch, 1),
            attention_mask=ones(batch, past + 1),
            past_key_values=kv_cache(make_dynamic_cache, batch, past),
        )))
    return calls


# -- 1. seed scenarios -----------------------------------------------------------------------


ADD_CALLS = [((torch.randn(n - 4, n), torch.randn(1, n)), {}) for n in (6, 7, 8)]


def test_seed_add_model_positional_matches_the_seed_and_the_oracle() -> None:
    torch.manual_seed(0)
    model = AddModel()
    observer = observe(model, ADD_CALLS)

    expected = (3, ({0: DYN, 1: DYN}, {1: DYN}), "(T1s2x6,T1s1x6)")
    assert seed_outputs(observer) == expected
    assert seed_outputs(observe(model, ADD_CALLS, oracle_class()())) == expected

    program = torch.export.export(model, observer.infer_arguments(), dynamic_shapes=observer.infer_dynamic_shapes())
    x, y = torch.randn(5, 9), torch.randn(1, 9)
    torch.testing.assert_close(program.module()(x, y), x + y)


def test_seed_add_model_keywords_give_a_dict_in_signature_order() -> None:
    model = AddModel()
    calls = [((), {"y": y, "x": x}) for (x, y), _ in ADD_CALLS]  # keywords in reverse order
    observer = observe(model, calls)

    count, shapes, arguments = seed_outputs(observer)
    assert (count, shapes, arguments) == (3, {"x": {0: DYN, 1: DYN}, "y": {1: DYN}}, "dict(x:T1s2x6,y:T1s1x6)")
    assert list(shapes) == ["x", "y"] and list(observer.infer_arguments()) == ["x", "y"]
    assert seed_outputs(observe(model, calls, oracle_class()())) == (count, shapes, arguments)

    program = torch.export.export(model, (), kwargs=observer.infer_arguments(), dynamic_shapes=shapes)
    x, y = torch.randn(5, 9), torch.randn(1, 9)
    torch.testing.assert_close(program.module()(x=x, y=y), x + y)


def test_seed_llm_with_dynamic_cache_and_forced_batch(cache_tools) -> None:
    make_dynamic_cache, register_flattening_functions = cache_tools
    torch.manual_seed(0)
    model = CacheLM().eval()
    calls = prefill_then_decode(make_dynamic_cache, batch=2, prompt=5, steps=2)
    with register_flattening_functions():
        observer = observe(model, calls)
        oracle = observe(model, calls, oracle_class()())
        expected = (
            3,
            {
                "input_ids": {0: DYN, 1: DYN},
                "attention_mask": {0: DYN, 1: DYN},
                "past_key_values": [{0: DYN, 2: DYN}] * 4,
            },
            "dict(input_ids:T7s2x1,attention_mask:T7s2x6,past_key_values:DynamicCache("
            "key_cache=#2[T1s2x2x5x4,T1s2x2x5x4], value_cache=#2[T1s2x2x5x4,T1s2x2x5x4]))",
        )
        assert seed_outputs(observer, set_batch_dimension_for=True) == expected
        assert seed_outputs(oracle, set_batch_dimension_for=True) == expected

        program = export_size_oblivious(
            model, observer.infer_arguments(), observer.infer_dynamic_shapes(set_batch_dimension_for=True)
        )
        other = dict(input_ids=ids(3, 1), attention_mask=ones(3, 8), past_key_values=kv_cache(make_dynamic_cache, 3, 7))
        assert_same_outputs(program, model, other)


def test_seed_multimodal_missing_pixel_values_become_an_empty_tensor(cache_tools) -> None:
    make_dynamic_cache, register_flattening_functions = cache_tools
    torch.manual_seed(0)
    model = MultimodalLM().eval()
    calls = prefill_then_decode(make_dynamic_cache, batch=1, prompt=5, steps=2, pixel_values=torch.randn(1, 3, 16, 16))
    missing = {"pixel_values": torch.empty((0, 3, 16, 16))}
    with register_flattening_functions():
        observer = observe(model, calls, InputObserver(value_if_missing=missing))
        oracle = observe(model, calls, oracle_class()(value_if_missing=missing))
        expected = (
            3,
            {
                "input_ids": {1: DYN},
                "pixel_values": {0: DYN},
                "attention_mask": {1: DYN},
                "past_key_values": [{2: DYN}] * 4,
            },
            "dict(input_ids:T7s1x1,pixel_values:T1s0x3x16x16,attention_mask:T7s1x6,past_key_values:DynamicCache("
            "key_cache=#2[T1s1x2x5x4,T1s1x2x5x4], value_cache=#2[T1s1x2x5x4,T1s1x2x5x4]))",
        )
        assert seed_outputs(observer) == expected
        assert seed_outputs(oracle) == expected

        program = export_size_oblivious(model, observer.infer_arguments(), observer.infer_dynamic_shapes())
        with_image = dict(
            input_ids=ids(1, 1), pixel_values=torch.randn(2, 3, 16, 16), attention_mask=ones(1, 9),
            past_key_values=kv_cache(make_dynamic_cache, 1, 8),
        )
        assert_same_outputs(program, model, with_image)


# -- 2. random nests against the oracle ------------------------------------------------------

# A nest template: leaves are (rank, which dims vary); containers are ("list"|"tuple"|"dict", children).
LEAF = st.integers(1, 3).flatmap(lambda r: st.tuples(st.just(r), st.lists(st.booleans(), min_size=r, max_size=r)))
NEST = st.recursive(
    LEAF,
    lambda children: st.one_of(
        st.tuples(st.sampled_from(["list", "tuple"]), st.lists(children, min_size=1, max_size=3)),
        st.tuples(st.just("dict"), st.dictionaries(st.sampled_from("abcd"), children, min_size=1, max_size=3)),
    ),
    max_leaves=5,
)
NAMES = ("a", "b", "c")


class ThreeInputs(torch.nn.Module):
    def forward(self, a, b=None, c=None):
        return a


def build(template: Any, size: Callable[[], int]) -> Any:
    """A nest of zero tensors following ``template``, varying dims sized by ``size()``."""
    if isinstance(template[0], int):
        _, varies = template
        return torch.zeros([size() if v else 3 for v in varies])
    kind, children = template
    if kind == "dict":
        return {k: build(v, size) for k, v in children.items()}
    built = [build(c, size) for c in children]
    return built if kind == "list" else tuple(built)


@pytest.mark.filterwarnings("error::FutureWarning")  # no deprecated pytree API either
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    templates=st.lists(NEST, min_size=1, max_size=3),
    n_calls=st.integers(2, 4),
    by_name=st.booleans(),
    data=st.data(),
)
def test_random_nests_infer_the_dynamic_shapes_of_the_oracle(templates, n_calls, by_name, data) -> None:
    size = lambda: data.draw(st.integers(2, 5), label="size")  # noqa: E731
    values = [[build(t, size) for t in templates] for _ in range(n_calls)]
    calls: list[Call] = [((), dict(zip(NAMES, v))) if by_name else (tuple(v), {}) for v in values]
    # The oracle reads positions in set_batch_dimension_for for positional calls only.
    keys = [*NAMES[: len(templates)], *([] if by_name else range(len(templates)))]
    batch_for = data.draw(st.one_of(st.none(), st.just(True), st.sets(st.sampled_from(keys), min_size=1)))

    oracle = observe(ThreeInputs(), calls, oracle_class()(), store_n_calls=n_calls)
    try:
        expected_nested = oracle.infer_dynamic_shapes(set_batch_dimension_for=batch_for)
        expected_flat = list(oracle.info.infer_dynamic_shapes(set_batch_dimension_for=batch_for, return_flat=True))
    except Exception:  # inputs the oracle rejects are out of the comparison
        assume(False)
    actual = observe(ThreeInputs(), calls, store_n_calls=n_calls).infer_dynamic_shapes(
        set_batch_dimension_for=batch_for)

    # Per-leaf dims of the oracle, in the structure of the arguments themselves.
    first = calls[0][1] if by_name else calls[0][0]
    assert actual == _pytree.tree_unflatten(expected_flat, _pytree.tree_structure(first))
    # The oracle returns one dict per argument, unnested, when every argument holds one tensor.
    if any(n_tensors(v) != 1 for v in values[0]) or all(isinstance(v, torch.Tensor) for v in values[0]):
        assert actual == expected_nested


def test_positions_in_set_batch_dimension_for_also_name_keyword_arguments() -> None:
    calls = [((), {"x": torch.randn(2, n), "y": torch.randn(2, n)}) for n in (3, 4)]
    observer = observe(AddModel(), calls)
    assert observer.infer_dynamic_shapes(set_batch_dimension_for={0}) == {"x": {0: DYN, 1: DYN}, "y": {1: DYN}}
    with pytest.raises(ValueError,
                       match=re.escape("set_batch_dimension_for: no input named 'z'; inputs are ['x', 'y']")):
        observer.infer_dynamic_shapes(set_batch_dimension_for={"z"})


# -- 3. the observed method ------------------------------------------------------------------


class Boom(Exception):
    pass


def raise_in_block(error: BaseException) -> Callable[[torch.nn.Module], None]:
    def body(model: torch.nn.Module) -> None:
        model(torch.ones(2), torch.ones(2))
        raise error

    return body


def raise_in_forward(model: torch.nn.Module) -> None:
    model(torch.ones(2), torch.ones(3))  # shapes do not broadcast: forward raises


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (raise_in_block(Boom("in the with block")), Boom),
        (raise_in_block(KeyboardInterrupt()), KeyboardInterrupt),
        (raise_in_forward, RuntimeError),
    ],
    ids=["exception", "keyboard-interrupt", "forward-raises"],
)
def test_forward_is_the_original_bound_method_after_an_exception(body, error) -> None:
    model = AddModel()
    original = model.forward
    observer = InputObserver()
    with pytest.raises(error):
        with observer(model):
            assert model.forward != original
            body(model)
    assert model.forward == original
    assert "forward" not in vars(model)


def test_a_forward_set_on_the_instance_is_restored_as_it_was() -> None:
    model = AddModel()
    own_forward = lambda x, y: x - y  # noqa: E731
    model.forward = own_forward
    observer = observe(model, [((torch.ones(2), torch.ones(2)), {})])
    assert vars(model)["forward"] is own_forward
    assert observer.num_obs() == 1


def test_nested_observers_on_one_model_both_record_and_unwind() -> None:
    model = AddModel()
    original = model.forward
    outer, inner = InputObserver(), InputObserver()
    with outer(model):
        model(torch.ones(2, 3), torch.ones(1, 3))
        with inner(model):
            model(torch.ones(3, 4), torch.ones(1, 4))
        model(torch.ones(4, 5), torch.ones(1, 5))
    assert (outer.num_obs(), inner.num_obs()) == (3, 1)
    assert outer.infer_dynamic_shapes() == ({0: DYN, 1: DYN}, {1: DYN})
    assert model.forward == original and "forward" not in vars(model)


def test_entering_the_same_observer_again_adds_calls() -> None:
    model = AddModel()
    observer = observe(model, ADD_CALLS[:2], store_n_calls=2)
    observe(model, ADD_CALLS[2:], observer, store_n_calls=2)
    assert observer.num_obs() == 3
    assert observer.infer_dynamic_shapes() == ({0: DYN, 1: DYN}, {1: DYN})


def test_the_signature_is_unchanged_while_observed() -> None:
    model = WithOptions()
    expected = inspect.signature(model.forward)
    with InputObserver()(model):
        assert inspect.signature(model.forward) == expected
        assert list(inspect.signature(model.forward).parameters) == ["x", "extra", "flag", "scale", "mode"]


def test_generate_still_works_and_records_prefill_and_decode(tiny_llama) -> None:
    from pytest_exportobs import register_flattening_functions

    prompt = torch.randint(0, 100, (2, 5))
    expected = tiny_llama.generate(prompt, max_new_tokens=3, do_sample=False)
    observer = InputObserver()
    with observer(tiny_llama):
        generated = tiny_llama.generate(prompt, max_new_tokens=3, do_sample=False)

    assert torch.equal(generated, expected)
    assert observer.num_obs() == 3 and observer.counts == CallCounts(stored=3)
    with register_flattening_functions():
        cache = cache_argument()
        cache_sizes = [n_tensors(o.kwargs.get(cache)) for o in observer.observations]
        assert cache_sizes == [0, 4, 4]  # an empty (or absent) cache at prefill
        shapes = observer.infer_dynamic_shapes()
        assert shapes["input_ids"] == {1: DYN}
        assert shapes[cache] == [{2: DYN}] * 4
        # The prefill gets a stand-in cache with an empty sequence axis.
        prefill = string_type(observer.infer_arguments(0)[cache], with_shape=True)
        assert prefill == "DynamicCache(key_cache=#2[T1s2x2x0x16,T1s2x2x0x16], value_cache=#2[T1s2x2x0x16,T1s2x2x0x16])"
        decode = string_type(observer.infer_arguments()[cache], with_shape=True)
        assert decode == "DynamicCache(key_cache=#2[T1s2x2x5x16,T1s2x2x5x16], value_cache=#2[T1s2x2x5x16,T1s2x2x5x16])"


# -- robustness: observing never changes what the call does ----------------------------------


class Opaque:
    """A pytree node whose flattening fails, like a cache layout the registration does not know."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def _refuse_to_flatten(obj: Opaque) -> Any:
    raise TypeError("cannot flatten Opaque")


@pytest.fixture
def opaque_node() -> Iterator[None]:
    _pytree.register_pytree_node(Opaque, _refuse_to_flatten, lambda leaves, ctx: Opaque(*leaves))
    try:
        yield
    finally:
        _pytree._deregister_pytree_node(Opaque)


class UsesOpaque(torch.nn.Module):
    def forward(self, x, state):
        return x + state.t


def test_a_call_that_cannot_be_recorded_still_runs_and_the_reason_is_kept(opaque_node) -> None:
    model = UsesOpaque()
    observer = InputObserver()
    with observer(model):
        result = model(torch.ones(2), Opaque(torch.ones(2)))
    torch.testing.assert_close(result, torch.full((2,), 2.0))
    assert observer.counts == CallCounts(failed=1)
    assert observer.errors == ["TypeError: cannot flatten Opaque"]
    with pytest.raises(ValueError,
                       match=re.escape("1 call(s) could not be recorded: TypeError: cannot flatten Opaque")):
        observer.infer_dynamic_shapes()


def test_a_model_made_in_inference_mode_is_observed() -> None:
    with torch.inference_mode():
        model = torch.nn.Linear(3, 2)
        observer = observe(model, [((torch.randn(n, 3),), {}) for n in (2, 4)])
    assert observer.num_obs() == 2
    assert observer.infer_dynamic_shapes() == ({0: DYN},)


def test_stored_inputs_are_copies_taken_before_the_call() -> None:
    class InPlace(torch.nn.Module):
        def forward(self, x, y):
            y.mul_(0)  # like a cache updated in place
            return x + y

    x, y = torch.ones(2), torch.full((2,), 3.0)
    observer = observe(InPlace(), [((x, y), {})])
    stored_x, stored_y = observer.observations[0].args
    assert torch.equal(stored_y, torch.full((2,), 3.0)) and torch.equal(y, torch.zeros(2))
    assert stored_x is not x
    assert torch.equal(observer.observations[0].outputs[0], torch.ones(2))


# -- 4. bounded memory -----------------------------------------------------------------------


def test_calls_with_an_already_stored_signature_add_no_copy() -> None:
    first = (torch.randn(2, 3), torch.randn(1, 3))
    calls = [(first, {}), ((torch.randn(2, 3), torch.randn(1, 3)), {}), ((torch.randn(4, 5), torch.randn(1, 5)), {})]
    observer = observe(AddModel(), [*calls, calls[1]])
    assert observer.num_obs() == 2
    assert observer.counts == CallCounts(stored=2, duplicates=2)
    assert [o.calls for o in observer.observations] == [3, 1]
    assert all(torch.equal(a, b) for a, b in zip(observer.observations[0].args, first))


def test_keyword_order_does_not_make_a_new_signature() -> None:
    x, y = torch.randn(2, 3), torch.randn(1, 3)
    observer = observe(AddModel(), [((), {"x": x, "y": y}), ((), {"y": y, "x": x})])
    assert observer.counts == CallCounts(stored=1, duplicates=1)


def test_at_most_store_n_calls_signatures_per_block() -> None:
    model = AddModel()
    distinct = [((torch.randn(n, 2), torch.randn(1, 2)), {}) for n in range(2, 8)]
    observer = observe(model, distinct[:4], store_n_calls=2)
    assert observer.counts == CallCounts(stored=2, dropped=2)
    # A new block stores up to store_n_calls new signatures, duplicates of stored ones still count.
    observe(model, [distinct[0], *distinct[4:]], observer, store_n_calls=1)
    assert observer.counts == CallCounts(stored=3, duplicates=1, dropped=3)
    assert [o.args[0].shape[0] for o in observer.observations] == [2, 3, 6]


def test_store_n_calls_must_be_a_non_negative_int() -> None:
    with pytest.raises(ValueError, match=re.escape("store_n_calls must be a non-negative int, got -1")):
        with InputObserver()(AddModel(), store_n_calls=-1):
            pass


# -- 5. errors and non-tensor inputs ---------------------------------------------------------


def test_no_recorded_call_is_a_clear_error() -> None:
    observer = observe(AddModel(), [])
    assert observer.num_obs() == 0
    message = re.escape("no call was recorded: call the model inside `with observer(model):`")
    with pytest.raises(ValueError, match=message):
        observer.infer_dynamic_shapes()
    with pytest.raises(ValueError, match=message):
        observer.infer_arguments()


def errors_of(calls: Sequence[Call], model: torch.nn.Module | None = None) -> str:
    """The message ``infer_dynamic_shapes`` and ``infer_arguments`` both raise on ``calls``."""
    observer = observe(model or WithOptions(), calls, store_n_calls=len(calls))
    messages = []
    for infer in (observer.infer_dynamic_shapes, observer.infer_arguments):
        with pytest.raises(ValueError) as caught:
            infer()
        messages.append(str(caught.value))
    assert messages[0] == messages[1]
    return messages[0]


@pytest.mark.parametrize(
    ("second", "change", "how"),
    [
        ([torch.randn(3, 3), torch.randn(3)], "changes structure between calls", "#2[T1s3x3,T1s3]"),
        ((torch.randn(3, 3),), "has 1 tensors but previously got 2 tensors", "(T1s3x3,)"),
        ({"a": torch.randn(3, 3), "b": torch.randn(3)}, "changes structure between calls", "dict(a:T1s3x3,b:T1s3)"),
    ],
    ids=["tuple-to-list", "fewer-leaves", "tuple-to-dict"],
)
def test_a_structure_change_names_the_argument_the_calls_and_how(second, change, how) -> None:
    calls = [((torch.randn(2, 3),), {"b": (torch.randn(2, 3), torch.randn(2))}), ((torch.randn(3, 3),), {"b": second})]
    assert errors_of(calls, ThreeInputs()) == (
        f"Named argument 'b' {change}: call 0 gives (T1s2x3,T1s2), call 1 gives {how}"  # torch's words first
    )


def test_a_rank_change_names_the_input_and_the_ranks() -> None:
    calls = [((torch.randn(2, 3), torch.randn(1, 3)), {}), ((torch.randn(3, 3, 1), torch.randn(1, 3)), {})]
    assert errors_of(calls, AddModel()) == "input 'x' changes rank between calls (rank 2 in call 0; rank 3 in call 1)"


def test_a_rank_change_names_only_the_calls_that_differ() -> None:
    calls = [((torch.randn(n, 3), torch.randn(1, 3)), {}) for n in range(2, 7)]
    calls.insert(3, ((torch.randn(3, 3, 1), torch.randn(1, 3)), {}))
    assert errors_of(calls, AddModel()) == (
        "input 'x' changes rank between calls (rank 2 in calls 0-2, 4-5; rank 3 in call 3)")


@pytest.mark.parametrize(
    ("options", "shown"),
    [
        ([{"flag": True}, {"flag": False}], "call 0: bool=True, call 1: bool=False"),
        ([{"mode": "mul"}, {}], "call 0: str='mul', call 1: default 'add'"),
    ],
    ids=["two-values", "value-then-default"],
)
def test_a_constant_keyword_changing_value_is_a_clear_error(options, shown) -> None:
    calls = [((torch.randn(n, 3),), kw) for n, kw in zip((2, 3), options)]
    argument = next(iter(options[0]))
    assert errors_of(calls) == f"Two calls were made with different constant values for argument {argument!r}: {shown}"


@pytest.mark.parametrize(
    ("missing", "error", "message"),
    [
        ({"pixels": torch.empty(0)}, ValueError,
         "value_if_missing key 'pixels' is not an argument of the signature ('x', 'extra', 'flag', 'scale', 'mode')"),
        ({5: torch.empty(0)}, ValueError,
         "value_if_missing key 5 is no position of the signature ('x', 'extra', 'flag', 'scale', 'mode')"),
        ({1.5: torch.empty(0)}, TypeError, "value_if_missing keys are names or positions, got 1.5"),
    ],
    ids=["unknown-name", "position-out-of-range", "not-a-name"],
)
def test_value_if_missing_keys_are_checked_against_the_signature(missing, error, message) -> None:
    model = WithOptions()
    original = model.forward
    with pytest.raises(error, match=re.escape(message)):
        with InputObserver(value_if_missing=missing)(model):
            pass
    assert model.forward == original


def test_constant_keywords_stay_constants_and_export() -> None:
    model = WithOptions()
    calls = [((torch.randn(n, 3),), {"flag": True, "scale": 2.0, "mode": "mul"}) for n in (2, 3)]
    observer = observe(model, calls)
    shapes = observer.infer_dynamic_shapes()
    arguments = observer.infer_arguments()
    assert shapes == {"x": {0: DYN}, "flag": None, "scale": None, "mode": None}
    assert {k: v for k, v in arguments.items() if k != "x"} == {"flag": True, "scale": 2.0, "mode": "mul"}
    program = torch.export.export(model, (), kwargs=arguments, dynamic_shapes=shapes)
    x = torch.randn(5, 3)
    torch.testing.assert_close(program.module()(x=x, flag=True, scale=2.0, mode="mul"), -2 * x)


def test_constants_equal_to_their_default_are_left_out() -> None:
    model = WithOptions()
    calls = [((torch.randn(n, 3), None, False), {"scale": 1.0}) for n in (2, 3)]
    observer = observe(model, calls)
    shapes, arguments = observer.infer_dynamic_shapes(), observer.infer_arguments()
    assert shapes == {"x": {0: DYN}}
    assert string_type(arguments, with_shape=True) == "dict(x:T1s2x3)"
    program = torch.export.export(model, (), kwargs=arguments, dynamic_shapes=shapes)
    x = torch.randn(4, 3)
    torch.testing.assert_close(program.module()(x=x), x + 1)


def test_non_tensor_leaves_are_recorded_and_get_no_dynamic_shape() -> None:
    model = WithOptions()

    def extra(n: int) -> dict[str, Any]:
        return {"t": torch.randn(n), "none": None, "k": 3, "f": 1.5, "b": True, "s": "text"}

    observer = observe(model, [((torch.randn(n, 3),), {"extra": extra(n)}) for n in (2, 3)])
    shapes = observer.infer_dynamic_shapes()
    arguments = observer.infer_arguments()
    assert shapes == {
        "x": {0: DYN},
        "extra": {"t": {0: DYN}, "none": None, "k": None, "f": None, "b": None, "s": None},
    }
    assert string_type(arguments, with_shape=True) == (
        "dict(x:T1s2x3,extra:dict(t:T1s2,none:None,k:int,f:float,b:bool,s:str))"
    )
    assert {k: v for k, v in arguments["extra"].items() if k != "t"} == {
        "none": None, "k": 3, "f": 1.5, "b": True, "s": "text",
    }
    program = torch.export.export(model, (), kwargs=arguments, dynamic_shapes=shapes)
    x, e = torch.randn(4, 3), extra(5)
    torch.testing.assert_close(program.module()(x=x, extra=e), model(x, extra=e))


def test_an_index_out_of_range_is_an_index_error() -> None:
    observer = observe(AddModel(), ADD_CALLS)
    assert string_type(observer.infer_arguments(-1), with_shape=True) == "(T1s4x8,T1s1x8)"
    with pytest.raises(IndexError, match=re.escape("index 3 out of range: 3 recorded calls")):
        observer.infer_arguments(3)


class Methods(torch.nn.Module):
    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return x

    def generate(*args: Any, **kwargs: Any) -> None:  # no ``self`` of its own
        return None

    @classmethod
    def build(cls, size: int) -> Methods:
        return cls()


@pytest.mark.parametrize("name", ["forward", "generate", "build"])
def test_the_cached_signature_of_a_method_is_inspects(name: str) -> None:
    from pytest_exportobs.observe.recorder import signature_of

    method = getattr(Methods(), name)
    assert signature_of(method) == inspect.signature(method)
    assert signature_of(getattr(Methods(), name)) is signature_of(method)  # computed once
