"""The ExecuTorch target's parts that need no ExecuTorch: upper bounds, their symbols in a traced
program, the delegation note, one outcome per model and target, ``--export-target`` parsing."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from pytest_exportobs import InputObserver, ShapeModel
from pytest_exportobs.core.vocabulary import Target, Verdict
from pytest_exportobs.engine.base.result import ModelResult, target_name
from pytest_exportobs.engine.export.lowering import (
    Delegation,
    UpperBound,
    bounds_note,
    symbol_maxima,
    upper_bounds,
    within_torch_bounds,
)
from pytest_exportobs.shapes.inference import DimPolicy

from models import MLP


class Tagger(torch.nn.Module):
    """Token ids to tags; its configuration declares the longest sequence it takes."""

    def __init__(self) -> None:
        super().__init__()
        self.config = {"max_position_embeddings": 128}
        self.embed, self.head = torch.nn.Embedding(50, 8), torch.nn.Linear(8, 3)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids))


def observe(module: torch.nn.Module, *calls: tuple) -> ShapeModel:
    observer = InputObserver()
    with observer(module), torch.no_grad():
        for args in calls:
            module(*args)
    return ShapeModel.from_aligned(observer.aligned(), None, None, DimPolicy(roles=True))


def test_a_sequence_is_bounded_by_the_declared_maximum_a_batch_by_twice_its_largest() -> None:
    model = Tagger()
    shapes = observe(model, (torch.randint(0, 50, (2, 7)),), (torch.randint(0, 50, (11, 9)),))
    assert [(v.name, v.axes) for v in shapes.variables] == [("batch", [(0, 0)]), ("seq", [(0, 1)])]
    assert upper_bounds(shapes, model) == {
        "batch": UpperBound(22, "twice the largest size observed, 11"),
        "seq": UpperBound(128, "max_position_embeddings = 128"),
    }


def test_a_rotary_scaling_factor_stretches_the_declared_maximum() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, max_position_embeddings=512,
                                      rope_scaling={"rope_type": "linear", "factor": 2.0})
    model = transformers.LlamaModel(config).eval()
    shapes = observe(model, (torch.randint(0, 64, (2, 7)),), (torch.randint(0, 64, (1, 12)),))
    assert upper_bounds(shapes, model)["seq"] == UpperBound(1024, "max_position_embeddings = 512 x rope factor 2")


def test_without_a_declared_maximum_every_dim_gets_the_margin_and_at_least_16() -> None:
    model = MLP()
    shapes = observe(model, (torch.randn(2, 8),), (torch.randn(3, 8),))
    bounds = upper_bounds(shapes, model)
    assert bounds == {"batch": UpperBound(16, "the smallest bound, over the largest size observed, 3")}
    assert bounds_note(bounds) == ("ExecuTorch plans memory for batch <= 16 "
                                   "(the smallest bound, over the largest size observed, 3)")
    assert bounds_note({}) == ""


def test_the_bounds_reach_the_symbols_of_the_traced_program() -> None:
    model = Tagger()
    shapes = observe(model, (torch.randint(0, 50, (2, 7)),), (torch.randint(0, 50, (3, 9)),))
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
    program = torch.export.export(model, (torch.randint(0, 50, (2, 7)),), dynamic_shapes=({0: batch, 1: seq},))
    (placeholder,) = program.graph.find_nodes(op="placeholder", target="input_ids")
    batch_symbol, seq_symbol = (str(size) for size in placeholder.meta["val"].shape)
    maxima = symbol_maxima(program, shapes, [0], upper_bounds(shapes, model))
    assert maxima == {batch_symbol: 16, seq_symbol: 128}


class Window(torch.nn.Module):
    """Attends within a window of 10 positions: it says so to torch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._check(x.shape[1] <= 10)
        return x.softmax(dim=1)


def test_a_bound_torch_export_puts_on_a_dim_is_the_one_planned_for_where_tighter() -> None:
    model = Window()
    shapes = observe(model, (torch.randn(2, 6),), (torch.randn(3, 8),))
    program = torch.export.export(model, (torch.randn(2, 6),),
                                  dynamic_shapes=({0: torch.export.Dim.DYNAMIC, 1: torch.export.Dim.DYNAMIC},))
    bounds = within_torch_bounds(program, shapes, [0], upper_bounds(shapes, model))
    assert bounds == {"batch": UpperBound(16, "the smallest bound, over the largest size observed, 3"),
                      "x_dim1": UpperBound(10, "torch.export's bound")}
    assert UpperBound.from_json(bounds["x_dim1"].to_json()) == bounds["x_dim1"]


def test_the_delegation_note_names_what_runs_on_portable_kernels_largest_first() -> None:
    taken = Delegation(partitions=2, delegated=5)
    assert taken.note() == ""
    left = Delegation(partitions=1, delegated=3, portable={"aten.mean.dim": 1, "aten.cumsum.default": 2},
                      lines=["aten.cumsum.default at model.py:12: return x.cumsum(1)"])
    assert left.note() == (
        "XNNPACK took 3 of 6 ops (1 partitions); 3 run on ExecuTorch's portable kernels, slower on a phone: "
        "aten.cumsum.default x2, aten.mean.dim x1; the largest: aten.cumsum.default at model.py:12: return x.cumsum(1)")
    assert Delegation.from_json(left.to_json()) == left


def test_one_outcome_per_model_and_target_named_apart() -> None:
    assert [target_name("llama", t) for t in Target] == ["llama", "llama", "llama[executorch]"]
    onnx = ModelResult(name="llama", verdict=Verdict.PASSED, target=Target.ONNX)
    lowered = ModelResult(name="llama", verdict=Verdict.FAILED, target=Target.EXECUTORCH, stage="lower")
    onnx.other_targets = [lowered]
    named = onnx.per_target((Target.ONNX, Target.EXECUTORCH))
    assert [(r.name, r.target, r.verdict, r.stage) for r in named] == [
        ("llama", "onnx", "passed", onnx.stage), ("llama[executorch]", "executorch", "failed", "lower")]
    assert ModelResult.from_json(onnx.to_json()).other_targets[0].stage == "lower"
    # a check that ended before the second target (time up, a crash) gives it the same outcome
    ended = ModelResult(name="vae", verdict=Verdict.FAILED, target=Target.ONNX, stage="isolate")
    assert [(r.name, r.verdict, r.stage) for r in ended.per_target((Target.ONNX, Target.EXECUTORCH))] == [
        ("vae", "failed", "isolate"), ("vae[executorch]", "failed", "isolate")]


@pytest.mark.slow
@pytest.mark.parametrize(("value", "message"), [
    ("onnx,torch", "name onnx or torch, not both"),
    ("onnx,tflite", "tflite"),
    (",", "names no target"),
])
def test_export_target_usage_errors(pytester: pytest.Pytester, value: str, message: str) -> None:
    pytester.makepyfile(test_nothing="def test_nothing():\n    pass\n")
    result = pytester.runpytest_subprocess("--export-check", f"--export-target={value}", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert message in result.stderr.str()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("executorch") is not None, reason="ExecuTorch is installed here")
def test_the_executorch_target_without_executorch_says_what_to_install(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_nothing="def test_nothing():\n    pass\n")
    result = pytester.runpytest_subprocess("--export-check", "--export-target=onnx,executorch")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "pip install 'pytest-exportobs[executorch]'" in result.stderr.str()
