"""A mismatch localized: the first ONNX node wrong on torch's own inputs, with its source line, or
the rounding that accumulates (no pytest session)."""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any

import onnx
import pytest
import torch

from pytest_exportobs.compat import torch_private
from pytest_exportobs.engine.base.settings import CheckSettings
from pytest_exportobs.engine.check import check_model
from pytest_exportobs.engine.explore.localize import localize
from pytest_exportobs.engine.export import onnx_stages, pipeline
from pytest_exportobs.engine.verify.compare import Tolerance
from pytest_exportobs.observe.store import ModelGroup, ObserveOptions, SessionStore


class Activated(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner, self.outer = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.nn.functional.gelu(self.inner(x))
        return self.outer(hidden * 2 + 1).softmax(-1)


class Residual(torch.nn.Module):
    """24 residual layers: a translation of tanh off by a little adds up over the layers and the
    final sum."""

    def __init__(self, layers: int = 24, width: int = 64) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return x.sum(-1)


def observed(module: torch.nn.Module, *calls: torch.Tensor, **options: Any) -> ModelGroup:
    store = SessionStore()
    with store.observe(module, "model", ObserveOptions(**options), "test_localize.py::test") as group, \
            torch.no_grad():
        for x in calls:
            module(x)
    return group


def settings(export_dir: Path) -> CheckSettings:
    return CheckSettings(export_dir=export_dir, examples=0)


def source_line(function: Any, text: str) -> str:
    """``file:line: code`` of the line of ``function`` holding ``text``, as the report writes it."""
    lines, first = inspect.getsourcelines(function)
    number = first + next(i for i, line in enumerate(lines) if text in line)
    return f"{os.path.relpath(__file__)}:{number}: {lines[number - first].strip()}"


def wrong_gelu(x: Any, approximate: str = "none") -> Any:
    """A translation of ``aten.gelu`` that is not gelu."""
    from onnxscript import opset18

    op: Any = opset18
    return op.Relu(x)


def translated_by(monkeypatch: pytest.MonkeyPatch, op: torch._ops.OpOverload, translation: Any) -> None:
    """``op`` translated by ``translation``, in a registry of the calling test's own."""
    from torch.onnx._internal.exporter import _registration

    registry = _registration.ONNXRegistry.from_torchlib()
    monkeypatch.setattr(torch_private, "_torchlib_registry", lambda: registry)
    monkeypatch.setattr(torch_private, "_REGISTERED", set())
    monkeypatch.setattr(pipeline, "custom_translations", lambda: {op: translation})


@pytest.fixture
def wrongly_translated_gelu(monkeypatch: pytest.MonkeyPatch) -> None:
    """``aten.gelu`` translated by :func:`wrong_gelu`, in a registry of this test's own."""
    translated_by(monkeypatch, torch.ops.aten.gelu.default, wrong_gelu)


@pytest.mark.usefixtures("wrongly_translated_gelu")
def test_a_wrong_translation_is_named_with_its_source_line(tmp_path: Path) -> None:
    torch.manual_seed(0)
    result = check_model(observed(Activated().eval(), torch.randn(2, 8), torch.randn(5, 8)), settings(tmp_path))
    assert (result.verdict, result.stage, result.kind) == ("failed", "verify", "mismatch")
    first = result.localization["first"]
    line = source_line(Activated.forward, "gelu(")
    assert (first["torch_op"], first["onnx_ops"], first["line"], first["beyond"]) == (
        "aten.gelu.default", ["Relu"], line, True)
    assert first["introduced"] == pytest.approx(first["accumulated"]) and first["introduced"] > 0.01
    assert f"first diverging op: Relu ({first['onnx_node']}) from aten.gelu.default at {line}: |Δ|" in result.reason
    assert "localize" in result.timings


def test_an_edited_node_is_the_first_beyond_tolerance_and_its_consumers_are_not(tmp_path: Path) -> None:
    """``+ 1`` turned into ``- 1`` in the ONNX file: the add introduces the error; the matmul and
    softmax after it only carry it (within tolerance on torch's inputs, beyond from the graph's)."""
    torch.manual_seed(0)
    model, x = Activated().eval(), torch.randn(3, 8)
    program = onnx_stages.decompose(torch.export.export(model, (x,)), [])
    path = tmp_path / "model.onnx"
    translated = torch_private.to_onnx_program(program)
    translated.optimize()
    translated.save(str(path))
    edited = onnx.load(str(path))
    add = next(node for node in edited.graph.node if node.op_type == "Add" and node.output[0] == "add")
    add.op_type = "Sub"
    onnx.save(edited, str(path))

    found = localize(program, path, [x], Tolerance(), expected=[model(x).detach()])

    assert found.first is not None and found.compared == 6
    assert (found.first.value, found.first.onnx_ops, found.first.onnx_node) == ("add", ("Sub",), add.name)
    assert found.first.introduced == pytest.approx(2.0)
    assert found.first.line == source_line(Activated.forward, "hidden * 2 + 1")
    downstream = {e.value: e for e in found.largest if e.value in ("linear_1", "softmax")}
    assert downstream and all(not e.beyond and e.accumulated > 0.01 for e in downstream.values())
    assert found.summary().startswith("first diverging op: Sub (")


def test_a_program_that_differs_from_eager_is_not_blamed_on_the_translation(tmp_path: Path) -> None:
    model, x = Activated().eval(), torch.randn(3, 8)
    program = onnx_stages.decompose(torch.export.export(model, (x,)), [])
    path = tmp_path / "model.onnx"
    torch_private.to_onnx_program(program).save(str(path))

    found = localize(program, path, [x], Tolerance(), expected=[model(x).detach() + 0.5])

    assert (found.first, found.compared) == (None, 0)
    assert found.summary().startswith("not the ONNX translation's: the program torch.export traced differs from "
                                      "eager already (max |Δ| 0.5:")


def biased_tanh(x: Any) -> Any:
    """A translation of ``aten.tanh`` off by 5e-7: within a tolerance of 1e-6 at every node."""
    from onnxscript import opset18

    op: Any = opset18
    return op.Add(op.Tanh(x), op.CastLike(op.Constant(value_float=5e-7), x))


@pytest.fixture
def slightly_biased_tanh(monkeypatch: pytest.MonkeyPatch) -> None:
    """``aten.tanh`` translated by :func:`biased_tanh`, in a registry of this test's own."""
    translated_by(monkeypatch, torch.ops.aten.tanh.default, biased_tanh)


@pytest.mark.slow
@pytest.mark.usefixtures("slightly_biased_tanh")
def test_an_error_that_only_accumulates_blames_no_node(tmp_path: Path) -> None:
    """Each tanh 5e-7 off, within the tolerance of 1e-6 at every node; over 24 layers and a sum of
    64 they add up to about 8e-4: further from float64 than eager, the mismatch stands."""
    torch.manual_seed(0)
    model = Residual().eval()
    result = check_model(observed(model, torch.randn(4, 64), torch.randn(3, 64), atol=1e-6, rtol=1e-6),
                         settings(tmp_path))
    assert (result.verdict, result.stage, result.kind, result.runtimes) == (
        "failed", "verify", "mismatch", ["onnxruntime"]), result.reason
    localization = result.localization
    assert localization["first"] is None and localization["compared"] >= 24
    assert all(not node["beyond"] and node["dtype"] == "float32" for node in localization["largest"])
    assert "the mismatch accumulates: each of the" in result.reason
    assert "values compared is within tolerance on torch's own inputs (a reduction in float32" in result.reason


@pytest.mark.slow
def test_float16_eager_drifting_from_float64_where_onnxruntime_does_not_passes(tmp_path: Path) -> None:
    """torch's float16 matmuls on a CPU round where onnxruntime's keep float32 inside: over 24
    layers eager drifts 0.03 from float64, onnxruntime 1e-5; the graph passes with both distances."""
    torch.manual_seed(0)
    model = Residual().to(torch.float16).eval()
    calls = torch.randn(4, 64, dtype=torch.float16), torch.randn(3, 64, dtype=torch.float16)
    result = check_model(observed(model, *calls, atol=1e-3, rtol=1e-3), settings(tmp_path))
    assert (result.verdict, result.runtimes) == ("passed", ["onnxruntime"]), result.reason
    (note,) = [n for n in result.notes if "where eager rounds as much" in n]
    eager, graph = (float(n) for n in note.split("the model in float64 is ")[1].split(" from the graph")[0]
                    .split(" from eager and "))
    assert eager > 0.01 and graph < 1e-3, note


@pytest.mark.slow
def test_a_rerun_takes_the_comparison_the_float64_model_judged_from_the_export_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A comparison the model in float64 judged is kept with the export cache as any other: a
    rerun runs neither the graph nor the model in float64, and passes with the same note."""
    from pytest_exportobs.engine import context
    from pytest_exportobs.engine.verify import runtimes

    ran: list[str] = []
    run, copy = runtimes.OnnxRunner.__call__, context.Float64Copy
    monkeypatch.setattr(runtimes.OnnxRunner, "__call__", lambda self, *a: ran.append("onnx") or run(self, *a))
    monkeypatch.setattr(context, "Float64Copy", lambda module: ran.append("float64") or copy(module))
    torch.manual_seed(0)
    model = Residual().to(torch.float16).eval()
    group = observed(model, torch.randn(4, 64, dtype=torch.float16), torch.randn(3, 64, dtype=torch.float16),
                     atol=1e-3, rtol=1e-3)
    results, counted = [], []
    for _ in range(2):
        ran.clear()
        results.append(check_model(group, settings(tmp_path)))
        counted.append((ran.count("onnx"), ran.count("float64")))
    notes = [[n for n in r.notes if "where eager rounds as much" in n] for r in results]
    assert [r.verdict for r in results] == ["passed", "passed"] and notes[0] == notes[1] and len(notes[0]) == 1
    assert counted == [(4, 1), (0, 0)]  # first: compared, then judged by the float64 model; rerun: neither


@pytest.mark.usefixtures("wrongly_translated_gelu")
def test_a_graph_from_the_export_cache_is_traced_again_and_localized_alike(tmp_path: Path) -> None:
    torch.manual_seed(0)
    group = observed(Activated().eval(), torch.randn(2, 8), torch.randn(5, 8))
    first, second = check_model(group, settings(tmp_path)), check_model(group, settings(tmp_path))
    assert (first.cache_hit, second.cache_hit) == (False, True)
    assert second.localization == first.localization and second.localization["first"]["torch_op"] == "aten.gelu.default"
    assert second.reason == first.reason
