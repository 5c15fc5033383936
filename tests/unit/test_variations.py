"""Hypothesis shape variations: generated sizes, invalid examples, shrinking, seeds, database."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import sympy
import torch
from torch.utils import _pytree

from pytest_exportobs import InputObserver, ShapeModel
from pytest_exportobs.core.vocabulary import AxisRole
from pytest_exportobs.engine.base.eager import call_model
from pytest_exportobs.engine.explore.ranges import MAX_ELEMENTS, MAX_OUTPUT_ELEMENTS, size_ranges
from pytest_exportobs.engine.explore.variations import Leaves, VariationOutcome, explore
from pytest_exportobs.engine.verify.compare import Tolerance
from pytest_exportobs.engine.verify.runtimes import OnnxRunner
from pytest_exportobs.shapes.dims import Relation
from pytest_exportobs.shapes.inference import DimPolicy
from pytest_exportobs.shapes.synthesis import build_leaves, complete_sizes, export_sizes, ignore_padded_labels, recipes

from models import example_arguments, tiny_llama_config


class OddBatchShift(torch.nn.Module):
    """Branches on the batch parity: the export keeps the branch of its even example."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] % 2 == 1:
            x = x + 1
        return x * 2


class Decoder(torch.nn.Module):
    """A decode step that rejects position ids not following its cache."""

    def forward(self, x: torch.Tensor, past: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        expected = torch.arange(past.shape[1], past.shape[1] + x.shape[1]).expand_as(position_ids)
        if not torch.equal(position_ids, expected):
            raise ValueError("position ids do not follow the cache")
        return torch.cat([past, x], dim=1) * 2


def observe(module: torch.nn.Module, *calls: tuple, dim_names: dict[str, str] | None = None,
            policy: DimPolicy | None = None) -> ShapeModel:
    observer = InputObserver()
    with observer(module), torch.no_grad():
        for args in calls:
            module(*args)
    return ShapeModel.from_aligned(observer.aligned(), None, dim_names, *([policy] if policy else []))


def eager_of(module: torch.nn.Module) -> Callable[[Leaves], list[torch.Tensor]]:
    """The engine's eager runner: what the module raises comes as ModelRaised."""

    def eager(leaves: Leaves) -> list[torch.Tensor]:
        with torch.no_grad():
            return [call_model(module, *leaves)]

    return eager


def onnx_runner(module: torch.nn.Module, shapes: ShapeModel, dynamic_shapes: Any) -> OnnxRunner:
    args, _ = example_arguments(shapes)
    return OnnxRunner(torch.onnx.export(module, args, dynamo=True, dynamic_shapes=dynamic_shapes, verbose=False))


def run_explore(
    shapes: ShapeModel, eager: Callable, run: Callable, database_dir: Path, examples: int = 8, seed: int | None = 0
) -> VariationOutcome:
    return explore(eager=eager, run=run, shapes=shapes, tolerance=Tolerance(), examples=examples, seed=seed,
                   database_dir=database_dir)


@pytest.fixture(scope="module")
def mlp() -> tuple[torch.nn.Module, ShapeModel, OnnxRunner]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
    shapes = observe(
        model, (torch.randn(2, 5, 8),), (torch.randn(4, 3, 8),), (torch.randn(3, 6, 8),),
        dim_names={"input:0": "batch", "input:1": "seq"},
    )
    return model, shapes, onnx_runner(model, shapes, shapes.to_dynamic_shapes())


def test_onnxruntime_runs_on_the_checks_share_of_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parallel checks (xdist workers, --export-jobs) each get torch.get_num_threads() threads."""
    program = torch.onnx.export(torch.nn.Linear(2, 2).eval(), (torch.randn(3, 2),), dynamo=True, verbose=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    options = OnnxRunner(program).session.get_session_options()
    assert options.intra_op_num_threads == 1
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"


def wrong_at_odd_batch(runner: Callable[[Leaves], Sequence[Any]]) -> Callable[[Leaves], list[Any]]:
    """``runner`` made wrong by +1 when the batch is odd and at least 3."""

    def run(leaves: Leaves) -> list[Any]:
        batch = leaves[0].shape[0]
        return [out + 1.0 for out in runner(leaves)] if batch % 2 and batch >= 3 else list(runner(leaves))

    return run


def test_mlp_variations_pass_within_bounds(mlp, tmp_path):
    model, shapes, runner = mlp
    outcome = run_explore(shapes, eager_of(model), runner, tmp_path)
    ranges = size_ranges(shapes)
    assert ranges == {"batch": (2, 8), "seq": (2, 12)}
    assert outcome.valid == outcome.tried == len(outcome.examples) <= 8 + 1  # the draws, then the largest
    assert outcome.examples[-1] == {"batch": 8, "seq": 12}
    assert outcome.examples[0] == {"batch": 2, "seq": 5}  # hypothesis starts from the traced sizes (call 0)
    assert any(e["batch"] > 4 for e in outcome.examples) and any(e["seq"] > 6 for e in outcome.examples)  # unseen
    assert (outcome.invalid, outcome.failed, outcome.failing_sizes, outcome.failing_leaves) == (0, 0, None, None)
    for sizes in outcome.examples:
        assert all(ranges[name][0] <= size <= ranges[name][1] for name, size in sizes.items())


def test_hypothesis_keeps_its_own_storage_in_the_session_directory_not_the_graphs(mlp, tmp_path):
    """The constants hypothesis reads from the local modules' sources are cached once for a
    session (the export cache), not again in every graph's directory."""
    from hypothesis import configuration

    model, shapes, runner = mlp
    homes: set[Path] = set()

    def eager(leaves: Leaves) -> list[torch.Tensor]:
        homes.add(Path(configuration.storage_directory(intent_to_write=False).home_directory))
        return eager_of(model)(leaves)

    outcome = explore(eager=eager, run=runner, shapes=shapes, tolerance=Tolerance(), examples=4, seed=0,
                      database_dir=tmp_path / "graph", storage_dir=tmp_path / "session")
    assert outcome.valid == outcome.tried > 0
    assert tmp_path / "session" in homes  # during hypothesis' search (the largest example runs after it)
    assert not any(home.is_relative_to(tmp_path / "graph") for home in homes)
    assert Path(configuration.storage_directory(intent_to_write=False).home_directory) != tmp_path / "session"


def test_a_failure_shrinks_to_the_sizes_nearest_the_traced_ones(mlp, tmp_path):
    """Traced at batch 2, seq 5: the nearest failing batch is 3, and seq plays no part in it."""
    model, shapes, runner = mlp
    outcome = run_explore(shapes, eager_of(model), wrong_at_odd_batch(runner), tmp_path)
    assert outcome.failed == sum(e["batch"] % 2 == 1 and e["batch"] >= 3 for e in outcome.examples) > 0
    assert outcome.failing_sizes == {"batch": 3, "seq": 5}
    assert [tuple(t.shape) for t in outcome.failing_leaves] == [(3, 5, 8)]
    assert outcome.max_abs == pytest.approx(1.0, abs=1e-5)
    assert outcome.detail == "60 of 60 values beyond tolerance, worst in output 0 (atol=0.0001, rtol=0.0001)"
    summary = outcome.to_json()
    assert "failing_leaves" not in summary and json.loads(json.dumps(summary)) == summary


def test_real_onnx_wrong_only_at_odd_batch(tmp_path):
    model = OddBatchShift().eval()
    shapes = observe(model, (torch.randn(2, 3),), (torch.randn(4, 3),), dim_names={"x:0": "batch"})
    runner = onnx_runner(model, shapes, ({0: torch.export.Dim.AUTO},))
    outcome = run_explore(shapes, eager_of(model), runner, tmp_path, examples=10)
    assert outcome.examples[0] == {"batch": 2}  # even batches pass: the recorded calls never hit the bug
    assert outcome.failing_sizes == {"batch": 3}
    assert outcome.max_abs == pytest.approx(2.0)
    assert tuple(outcome.failing_leaves[0].shape) == (3, 3)


def test_same_seed_same_examples(mlp, tmp_path):
    model, shapes, runner = mlp
    first, second = (
        run_explore(shapes, eager_of(model), wrong_at_odd_batch(runner), tmp_path / name, seed=7)
        for name in ("a", "b")
    )
    assert first.examples == second.examples and len(first.examples) >= 2
    assert first.to_json() == second.to_json()


def test_ci_derandomizes_without_database(mlp, tmp_path, monkeypatch):
    model, shapes, runner = mlp
    monkeypatch.setenv("CI", "true")
    first, second = (
        run_explore(shapes, eager_of(model), wrong_at_odd_batch(runner), tmp_path / "db", seed=None)
        for _ in range(2)
    )
    assert first.to_json() == second.to_json() and first.failing_sizes == {"batch": 3, "seq": 5}
    assert not (tmp_path / "db").exists()


def test_database_replays_the_failure_first(mlp, tmp_path, monkeypatch):
    model, shapes, runner = mlp
    monkeypatch.delenv("CI", raising=False)
    first, second = (
        run_explore(shapes, eager_of(model), wrong_at_odd_batch(runner), tmp_path, seed=None, examples=20)
        for _ in range(2)
    )
    assert first.failing_sizes == second.failing_sizes == {"batch": 3, "seq": 5}
    assert second.examples[0] == first.failing_sizes


def test_eager_errors_make_invalid_examples_never_failures(mlp, tmp_path):
    model, shapes, runner = mlp

    def picky(x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] > 6:
            raise ValueError("sequence too long for this model")
        return model(x)

    outcome = run_explore(shapes, eager_of(picky), runner, tmp_path, examples=12)
    assert outcome.invalid == sum(e["seq"] > 6 for e in outcome.examples) > 0
    assert outcome.failed == 0 and outcome.failing_sizes is None
    assert outcome.valid + outcome.invalid == outcome.tried


def test_an_error_around_the_models_call_is_the_engines_and_is_raised(mlp, tmp_path):
    model, shapes, runner = mlp

    def broken_harness(leaves: Leaves) -> list[torch.Tensor]:
        outputs = eager_of(model)(leaves)
        return outputs[1:2] + [outputs[5]]  # an engine bug, not the model rejecting the sizes

    with pytest.raises(IndexError):
        run_explore(shapes, broken_harness, runner, tmp_path, examples=4)


def test_the_largest_example_runs_when_the_drawn_ones_pass(mlp, tmp_path):
    """One drawn example misses a graph that breaks at the top of its batch range; the largest
    example, run after the draws, finds it in every run."""
    model, shapes, runner = mlp
    ranges = size_ranges(shapes)

    def breaks_at_the_largest_batch(leaves: Leaves) -> Sequence[Any]:
        outputs = list(runner(leaves))
        if leaves[0].shape[0] == ranges["batch"][1]:
            outputs[0] = outputs[0] + 1.0
        return outputs

    outcome = run_explore(shapes, eager_of(model), breaks_at_the_largest_batch, tmp_path, examples=1)
    assert outcome.failing_sizes == {name: high for name, (_, high) in ranges.items()}
    assert (outcome.tried, outcome.failed) == (2, 1)
    clean = run_explore(shapes, eager_of(model), runner, tmp_path / "clean", examples=1)
    assert (clean.tried, clean.failed, clean.failing_sizes) == (2, 0, None)
    assert clean.examples[-1] == {name: high for name, (_, high) in ranges.items()}


def test_exported_model_errors_fail_the_example(mlp, tmp_path):
    model, shapes, runner = mlp

    def crashes_from_batch_5(leaves: Leaves) -> Sequence[Any]:
        if leaves[0].shape[0] >= 5:
            raise RuntimeError("kernel failed\nsecond line")
        return runner(leaves)

    outcome = run_explore(shapes, eager_of(model), crashes_from_batch_5, tmp_path, examples=12)
    assert outcome.failing_sizes == {"batch": 5, "seq": 5}
    assert outcome.max_abs is None and outcome.detail == "RuntimeError: kernel failed"


def test_static_inputs_have_nothing_to_explore(tmp_path):
    model = torch.nn.Linear(3, 2)
    shapes = observe(model, (torch.randn(2, 3),))
    outcome = run_explore(shapes, eager_of(model), lambda leaves: pytest.fail("nothing to run"), tmp_path)
    assert (outcome.tried, outcome.examples, outcome.failing_sizes) == (0, [], None)


def test_size_ranges_include_observed_small_sizes_and_cap_elements():
    identity = torch.nn.Identity()
    small = observe(identity, (torch.randn(1, 2),), (torch.randn(2, 3),))
    assert size_ranges(small) == {"input_dim0": (1, 8), "input_dim1": (2, 8)}
    large = observe(identity, (torch.randn(2, 200, 300),), (torch.randn(3, 400, 300),))
    ranges = size_ranges(large)
    assert ranges["input_dim0"][0] == 2 and ranges["input_dim1"][0] == 2
    assert ranges["input_dim0"][1] <= 8 and ranges["input_dim1"][1] <= 512
    assert math.prod(high for _, high in ranges.values()) * 300 <= MAX_ELEMENTS


def test_a_batch_of_large_images_is_capped_one_past_the_traced_batch():
    """The budget of elements allows 2 images of 3x256x256 (the batch the graph is traced at),
    the range still reaches a batch the tests never used; smaller images fit more."""
    identity = torch.nn.Identity()
    large = observe(identity, (torch.randn(1, 3, 256, 256),), (torch.randn(2, 3, 256, 256),))
    assert export_sizes(large) == {"input_dim0": 2}
    assert size_ranges(large) == {"input_dim0": (1, 3)}
    small = observe(identity, (torch.randn(1, 3, 64, 64),), (torch.randn(2, 3, 64, 64),))
    assert size_ranges(small) == {"input_dim0": (1, 8)}


def test_images_grow_at_most_eightfold_over_the_traced_example_and_text_as_before():
    """Latents of 2x4x32x32 (batch, height and width dynamic, a diffusion model's): the batch to 8
    and the sides to 48 would be 18 times the traced example; the highs are lowered until it is
    at most 8 times. Token ids of a text model keep twice their sizes."""
    latents = observe(torch.nn.Identity(), (torch.randn(2, 4, 32, 32),), policy=DimPolicy(roles=True))
    ranges = size_ranges(latents)
    traced = export_sizes(latents)
    assert {v.role for v in latents.variables} == {AxisRole.BATCH, AxisRole.HEIGHT, AxisRole.WIDTH}
    assert math.prod(ranges[name][1] / traced[name] for name in ranges) <= 8
    assert all(ranges[name][1] > traced[name] for name in ranges)  # every size still grows
    text = observe(torch.nn.Identity(), (torch.randint(0, 9, (2, 7)),), (torch.randint(0, 9, (3, 5)),))
    assert size_ranges(text) == {"input_dim0": (2, 8), "input_dim1": (2, 14)}


def test_the_outputs_of_the_largest_example_hold_at_most_max_output_elements():
    """Tokens traced at 13x200 whose attention maps (8 heads) grow with the square of the tokens:
    at twice the batch and the tokens the maps would hold 33M elements; the highs are lowered,
    the largest growth first, until they hold at most 16M, each still past its traced size.
    Outputs already past the budget at the traced sizes leave each high one past it."""
    shapes = observe(torch.nn.Identity(), (torch.randn(13, 200, 16),), (torch.randn(12, 180, 16),))
    assert export_sizes(shapes) == {"input_dim0": 13, "input_dim1": 200}
    assert size_ranges(shapes) == {"input_dim0": (2, 26), "input_dim1": (2, 400)}
    batch, seq = sympy.symbols("input_dim0 input_dim1", integer=True)
    attention = 8 * batch * seq**2 + 16 * batch * seq
    assert attention.subs({batch: 26, seq: 400}) > MAX_OUTPUT_ELEMENTS
    assert size_ranges(shapes, output_elements=attention) == {"input_dim0": (2, 19), "input_dim1": (2, 300)}
    assert attention.subs({batch: 19, seq: 300}) <= MAX_OUTPUT_ELEMENTS
    assert size_ranges(shapes, output_elements=80 * batch * seq**2) == {"input_dim0": (2, 14), "input_dim1": (2, 201)}
    assert size_ranges(shapes, output_elements=16 * batch * seq) == size_ranges(shapes)  # linear: within budget


def test_position_ids_of_decode_steps_stay_arange_like(tmp_path):
    decoder = Decoder()
    calls = [
        (torch.randn(batch, 1, 4), torch.randn(batch, past, 4), torch.full((batch, 1), past))
        for batch, past in ((2, 3), (3, 5), (2, 6))
    ]
    shapes = observe(decoder, *calls)
    outcome = run_explore(shapes, eager_of(decoder), eager_of(decoder), tmp_path, examples=10)
    assert outcome.tried >= 2 and outcome.invalid == 0 and outcome.failed == 0


@pytest.mark.slow
def test_tiny_llama_variations(tmp_path):
    transformers = pytest.importorskip("transformers")
    from pytest_exportobs.core.cache_pytrees import register_flattening_functions
    from pytest_exportobs.core.caches import make_dynamic_cache
    from pytest_exportobs.engine.export.pipeline import export_model

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config(max_position_embeddings=256)).eval()

    def step(batch: int, past: int, seq: int) -> dict[str, Any]:
        inputs = {
            "input_ids": torch.randint(0, 100, (batch, seq)),
            "attention_mask": torch.ones(batch, past + seq, dtype=torch.int64),
            "position_ids": torch.arange(past, past + seq).expand(batch, seq),
        }
        if past:
            pairs = [(torch.randn(batch, 2, past, 16), torch.randn(batch, 2, past, 16)) for _ in range(2)]
            inputs["past_key_values"] = make_dynamic_cache(pairs)
        return inputs

    observer = InputObserver()
    with register_flattening_functions(), torch.no_grad():
        with observer(model):
            for batch, past, seq in ((2, 0, 7), (2, 7, 1), (3, 8, 1)):
                model(**step(batch, past, seq))
        shapes = ShapeModel.from_aligned(observer.aligned(), None, True)
        exported = export_model(model, shapes, "onnx", tmp_path / "model.onnx")
        assert exported.ok, exported.reason
        runner, generated = OnnxRunner(Path(exported.onnx_path)), []

        def eager(leaves: Leaves) -> list[Any]:
            args, kwargs = shapes.aligned.split_arguments(leaves)
            outputs = call_model(model, *args, **kwargs)
            return [t.detach() if hasattr(t, "detach") else None for t in _pytree.tree_leaves(outputs)]

        def run(leaves: Leaves) -> Sequence[Any]:
            generated.append(dict(zip(shapes.aligned.leaf_names, leaves)))
            return runner(leaves)

        outcome = run_explore(shapes, eager, run, tmp_path / "db", examples=10)
    assert outcome.invalid == 0 and outcome.failed == 0 and outcome.valid == outcome.tried >= 2
    for leaves in generated:
        batch, seq = leaves["input_ids"].shape
        past = leaves["past_key_values.key_0"].shape[2]
        assert leaves["attention_mask"].shape == (batch, past + seq)
        assert 0 <= int(leaves["input_ids"].min()) and int(leaves["input_ids"].max()) < 100
        assert torch.equal(leaves["position_ids"], torch.arange(past, past + seq).expand(batch, seq))


def test_derived_sizes_follow_their_expression() -> None:
    observer = InputObserver()
    model = ConvPair()
    with observer(model):
        for side in (8, 12):
            model(torch.randn(1, 3, side, side))
    shapes = ShapeModel.from_aligned(observer.aligned())
    derived = shapes.derived("height", Relation("height", ("height_half",), scale=2))
    assert complete_sizes(derived, {"batch": 2, "height_half": 3, "width": 5})["height"] == 6


class TwoCaches(torch.nn.Module):
    """A full cache and a sliding one: the state a hybrid decoder hands its next step."""

    def forward(self, x: torch.Tensor, full: torch.Tensor, sliding: torch.Tensor) -> torch.Tensor:
        return torch.cat([full, x], dim=1).sum(1) + torch.cat([sliding, x], dim=1).sum(1)


def test_a_sliding_windows_length_follows_the_full_one_up_to_its_limit() -> None:
    """Split off a window of 10 (the engine does when torch bounds the length and the model's
    next step holds the sliding layer there): variations size only the full length, reach past
    the window, and build the sliding cache at ``min(past, 10)``."""
    calls = [(torch.randn(2, 1, 4), torch.randn(2, past, 4), torch.randn(2, past, 4)) for past in (3, 4)]
    shapes = observe(TwoCaches(), *calls)
    assert shapes.to_json()["dims"] == {"full": {"1": "full_dim1"}, "sliding": {"1": "full_dim1"}}
    split = shapes.split("full_dim1", [(2, 1)], "full_dim1_window", 10)
    assert split.to_json()["dims"] == {"full": {"1": "full_dim1"}, "sliding": {"1": "full_dim1_window"}}
    assert [str(w) for w in split.windows] == ["full_dim1_window = min(full_dim1, 10)"]
    assert (size_ranges(shapes), size_ranges(split)) == ({"full_dim1": (2, 8)}, {"full_dim1": (2, 12)})
    assert complete_sizes(split, {"full_dim1": 12}) == {"full_dim1": 12, "full_dim1_window": 10}
    for past, window in ((5, 5), (12, 10)):
        leaves = build_leaves(split, complete_sizes(split, {"full_dim1": past}), torch.Generator().manual_seed(0))
        assert [tuple(leaf.shape) for leaf in leaves] == [(2, 1, 4), (2, past, 4), (2, window, 4)]
    assert split.without("full_dim1").windows == [] and split.project([0], ["x", "full"]).windows == []


class ConvPair(torch.nn.Module):
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return pixel_values.mean((2, 3))


@pytest.mark.parametrize(
    ("recorded", "left", "pad_value"),
    [
        (torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]), True, 0),
        (torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]]), False, 0),
        (torch.tensor([[False, False, True], [False, False, False]]), False, 1),
    ],
    ids=["left-padded", "right-padded", "key-padding-mask"],
)
def test_generated_masks_look_like_a_tokenizers(recorded: torch.Tensor, left: bool, pad_value: int) -> None:
    name = "src_key_padding_mask" if pad_value else "attention_mask"
    observer = InputObserver()
    model = MaskUser()
    with observer(model):
        model(torch.randn(2, recorded.shape[1], 4), **{name: recorded})
        model(torch.randn(3, recorded.shape[1] + 1, 4),
              **{name: torch.cat([recorded, recorded[:1]])[:, :1].repeat(1, recorded.shape[1] + 1)})
    shapes = ShapeModel.from_aligned(observer.aligned())
    leaf = shapes.aligned.leaf_names.index(name)
    recipe = recipes(shapes)[leaf]
    assert (recipe.kind, recipe.left, recipe.pad_value) == ("mask", left, pad_value)
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        sizes = {v.name: 6 if v.name == "batch" else 9 for v in shapes.variables}
        mask = build_leaves(shapes, sizes, generator)[leaf]
        assert mask.shape == (6, 9) and mask.dtype == recorded.dtype
        real = (mask != pad_value).long()
        assert bool((real.sum(1) >= 1).all())  # at least one real token per row
        runs = real.diff(dim=1).abs().sum(1)  # one boundary at most: padding on one side
        assert bool((runs <= 1).all())
        first_real = real[:, 0] if not left else real[:, -1]
        assert bool((first_real == 1).all())


class MaskUser(torch.nn.Module):
    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                src_key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        mask = attention_mask if attention_mask is not None else ~src_key_padding_mask
        return x * mask.unsqueeze(-1).to(x.dtype)


def test_generated_token_ids_never_take_the_padding_token() -> None:
    observer = InputObserver()
    model = TokenUser()
    with observer(model):
        model(torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0]]), torch.ones(2, 4, dtype=torch.long))
        model(torch.tensor([[1, 3, 0]]), torch.ones(1, 3, dtype=torch.long))
    shapes = ShapeModel.from_aligned(observer.aligned())
    ids = shapes.aligned.leaf_names.index("input_ids")
    generator = torch.Generator().manual_seed(0)
    sizes = {v.name: 40 for v in shapes.variables}
    generated = [build_leaves(shapes, sizes, generator, recipes(shapes, pad_token_id=3))[ids] for _ in range(5)]
    assert set(torch.cat(generated).unique().tolist()) == {0, 1, 2}
    unrestricted = [build_leaves(shapes, sizes, generator)[ids] for _ in range(5)]
    assert set(torch.cat(unrestricted).unique().tolist()) == {0, 1, 2, 3}


class TokenUser(torch.nn.Module):
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return (input_ids * attention_mask).float().mean(1)


class TokenClassifier(torch.nn.Module):
    """The cross-entropy of per-token logits: the loss reads every position whose label is not
    torch's ignore index."""

    def __init__(self, padded_logits: float = 0.0) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(10, 3)
        self.padded_logits = padded_logits  # what padded positions hold: arbitrary, as attention leaves them

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.embedding(input_ids)
        padded = self.padded_logits * torch.arange(3.0).expand_as(logits)
        logits = torch.where(attention_mask.unsqueeze(-1).bool(), logits, padded)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def token_classification_calls() -> list[tuple[torch.Tensor, ...]]:
    masks = [torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]), torch.tensor([[0, 0, 1], [0, 1, 1], [1, 1, 1]])]
    return [(torch.randint(0, 10, m.shape), m, torch.randint(0, 3, m.shape)) for m in masks]


def test_labels_ignore_the_positions_a_padding_mask_pads(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TokenClassifier()
    shapes = observe(model, *token_classification_calls())
    other_runtime = TokenClassifier(padded_logits=5.0)  # other arbitrary values where padded
    other_runtime.embedding = model.embedding
    outcome = run_explore(shapes, eager_of(model), eager_of(other_runtime), tmp_path, examples=10)
    assert outcome.tried >= 3 and outcome.valid == outcome.tried and outcome.failed == 0

    leaves = build_leaves(shapes, {v.name: 5 for v in shapes.variables}, torch.Generator().manual_seed(1))
    ignored = ignore_padded_labels(shapes, leaves, recipes(shapes))
    assert ignored is not None
    ids, mask, labels = leaves
    assert bool((mask == 0).any())
    assert torch.equal(ignored[2], labels.masked_fill(mask == 0, -100))
    assert ignored[0] is ids and ignored[1] is mask


class LabelEmbedder(torch.nn.Module):
    """Labels as indices (a label embedding): the ignore index is out of range."""

    def __init__(self) -> None:
        super().__init__()
        self.labels = torch.nn.Embedding(3, 2)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.labels(labels) * attention_mask.unsqueeze(-1) + input_ids.unsqueeze(-1)


def test_a_model_rejecting_the_ignore_index_runs_with_the_plain_labels(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = LabelEmbedder()
    shapes = observe(model, *token_classification_calls())
    seen: list[torch.Tensor] = []

    def run(leaves: Leaves) -> list[torch.Tensor]:
        seen.append(leaves[2])
        return eager_of(model)(leaves)

    outcome = run_explore(shapes, eager_of(model), run, tmp_path, examples=10)
    assert outcome.tried >= 3 and outcome.valid == outcome.tried and outcome.failed == 0
    assert all(int(labels.min()) >= 0 for labels in seen)


def test_multiple_choice_masks_pad_each_choice_as_a_tokenizer_does() -> None:
    observer = InputObserver()
    model = MaskUser()
    with observer(model):
        for batch, length in ((2, 5), (3, 4)):
            mask = torch.ones(batch, 4, length, dtype=torch.long)
            mask[0, 1, :2] = 0  # one choice left-padded
            model(torch.randn(batch, 4, length, 4), attention_mask=mask)
    shapes = ShapeModel.from_aligned(observer.aligned())
    leaf = shapes.aligned.leaf_names.index("attention_mask")
    generator = torch.Generator().manual_seed(0)
    sizes = {v.name: 7 for v in shapes.variables}
    masks = torch.stack([build_leaves(shapes, sizes, generator)[leaf] for _ in range(10)])
    assert masks.shape == (10, 7, 4, 7)
    rows = masks.reshape(-1, 7)
    assert bool((rows.sum(1) >= 1).all()) and bool((rows[:, -1] == 1).all())
    assert bool((rows.diff(dim=1) >= 0).all())  # left padding: real tokens once they start
    assert bool((rows == 0).any())


class ImageTokenClassifier(torch.nn.Module):
    """A multimodal classifier: each row's image features replace its image tokens in the ids,
    which must hold exactly ``tokens`` of them per image, as transformers' multimodal models demand."""

    IMAGE_TOKEN = 7

    def __init__(self, tokens: int = 2) -> None:
        super().__init__()
        self.tokens = tokens
        self.embed = torch.nn.Embedding(10, 4)
        self.vision = torch.nn.Linear(6, 4)

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor) -> torch.Tensor:
        image_tokens = input_ids == self.IMAGE_TOKEN
        features = self.vision(pixel_values).reshape(-1, 4)  # (images * tokens, 4)
        if int(image_tokens.sum()) != features.shape[0]:
            raise ValueError("Image features and image tokens do not match")
        embeds = self.embed(input_ids).masked_scatter(image_tokens.unsqueeze(-1), features)
        return embeds.mean(1)


def test_batch_variations_of_a_multimodal_model_repeat_recorded_rows_its_image_tokens_match(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = ImageTokenClassifier()
    calls = []
    for batch in (2, 3):
        ids = torch.randint(0, 7, (batch, 6))
        ids[:, 1:3] = ImageTokenClassifier.IMAGE_TOKEN
        calls.append((ids, torch.randn(batch, 2, 6)))
    observer = InputObserver()
    with observer(model), torch.no_grad():
        for call in calls:
            model(*call)
    # as the plugin infers it (roles), with the prompt's length and the image's size pinned as the
    # probe pins them for such models (Gemma3ForSequenceClassification in transformers' tests)
    policy = DimPolicy(roles=True, static=frozenset({"input_ids:1", "pixel_values:2"}))
    shapes = ShapeModel.from_aligned(observer.aligned(), policy=policy)
    assert [(v.name, v.role, list(v.axes)) for v in shapes.variables] == [
        ("batch", AxisRole.BATCH, [(0, 0), (1, 0)])]  # ids, pixels
    seen: list[Leaves] = []

    def run(leaves: Leaves) -> list[torch.Tensor]:
        seen.append(leaves)
        return eager_of(model)(leaves)

    outcome = run_explore(shapes, eager_of(model), run, tmp_path, examples=10)
    assert outcome.tried >= 3 and outcome.valid == outcome.tried and outcome.failed == 0
    assert {example["batch"] for example in outcome.examples} - {2, 3}  # batch sizes no test used
    for ids, pixels in seen:
        assert ids.shape == (pixels.shape[0], 6)
        assert bool(((ids == ImageTokenClassifier.IMAGE_TOKEN).sum(1) == 2).all())
