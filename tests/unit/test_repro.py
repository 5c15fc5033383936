"""Repro scripts: written beside their weights and inputs, rerun in a fresh process."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

torch = pytest.importorskip("torch")

from pytest_exportobs import InputObserver  # noqa: E402
from pytest_exportobs.engine.export.pipeline import export_model  # noqa: E402
from pytest_exportobs.engine.repro import Repro, write_repro  # noqa: E402
from pytest_exportobs.shapes.model import ShapeModel  # noqa: E402

from models import SOURCE, tiny_llama_config  # noqa: E402


@pytest.fixture(scope="module")
def mymodels(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModuleType]:
    """``mymodels``, a real module file importable the way pytest imports test modules."""
    directory = tmp_path_factory.mktemp("models")
    (directory / "mymodels.py").write_text(SOURCE)
    sys.path.insert(0, str(directory))
    try:
        yield importlib.import_module("mymodels")
    finally:
        sys.path.remove(str(directory))
        sys.modules.pop("mymodels", None)


def observed_shapes(model: torch.nn.Module, calls: list[dict], method: str = "forward") -> ShapeModel:
    observer = InputObserver()
    with observer(model, method_name=method), torch.no_grad():
        for kwargs in calls:
            getattr(model, method)(**kwargs)
    return ShapeModel.from_aligned(observer.aligned(), None, None)


def first_call(shapes: ShapeModel) -> list:
    return shapes.call_leaves(shapes.aligned.complete_call())


def run(repro: Repro, cwd: Path) -> subprocess.CompletedProcess:
    """``python repro.py`` in a fresh process, from another directory than the script's."""
    assert Path(cwd) != Path(repro.path).parent
    return subprocess.run([sys.executable, repro.path], cwd=cwd, capture_output=True, text=True, timeout=600)


def max_abs_diff(output: str) -> float:
    found = re.search(r"max abs diff ([0-9.e+-]+)", output)
    assert found, output
    return float(found.group(1))


@pytest.mark.slow
def test_torch_export_failure_reproduces_with_the_same_exception(mymodels, tmp_path):
    model = mymodels.Branchy().eval()
    shapes = observed_shapes(model, [{"x": torch.randn(2, 4)}, {"x": torch.randn(3, 4)}])
    outcome = export_model(model, shapes, "onnx", tmp_path / "model.onnx")
    assert (outcome.ok, outcome.stage) == (False, "torch.export")

    repro = write_repro(tmp_path / "repro", model, shapes, first_call(shapes), stage="torch.export",
                        target="onnx", method="forward", atol=None, rtol=None)

    assert (repro.runnable, repro.note) == (True, "")
    assert sorted(p.name for p in (tmp_path / "repro").iterdir()) == ["inputs.pt", "repro.py", "weights.pt"]
    assert "DYNAMIC_SHAPES = {'x': {0: 'x_dim0'}}" in Path(repro.path).read_text()
    completed = run(repro, tmp_path)
    assert completed.returncode == 1
    assert outcome.error_type in completed.stderr


@pytest.mark.slow
def test_a_model_built_from_a_config_mapping_is_rebuilt_with_from_config(mymodels, tmp_path):
    model = mymodels.FromConfig(width=6).eval()
    shapes = observed_shapes(model, [{"x": torch.randn(2, 6)}, {"x": torch.randn(3, 6)}])
    outcome = export_model(model, shapes, "onnx", tmp_path / "model.onnx")

    repro = write_repro(tmp_path / "repro", model, shapes, first_call(shapes), stage="torch.export",
                        target="onnx", method="forward", atol=None, rtol=None)

    assert (repro.runnable, repro.note) == (True, "")
    assert (tmp_path / "repro" / "config.json").read_text() == '{\n "width": 6\n}'
    assert ('return FromConfig.from_config(json.loads((HERE / "config.json").read_text()))'
            in Path(repro.path).read_text())
    completed = run(repro, tmp_path)
    assert completed.returncode == 1
    assert outcome.error_type in completed.stderr


@pytest.mark.slow
def test_verify_beyond_tolerance_exits_1_with_the_max_diff(mymodels, tmp_path):
    torch.manual_seed(0)
    model = mymodels.Scorer().eval()
    shapes = observed_shapes(model, [{"x": torch.randn(2, 16)}, {"x": torch.randn(3, 16)}])

    repro = write_repro(tmp_path / "repro", model, shapes, first_call(shapes), stage="verify",
                        target="onnx", method="forward", atol=0.0, rtol=0.0)

    completed = run(repro, tmp_path)
    assert completed.returncode == 1, completed.stderr
    assert 0 < max_abs_diff(completed.stdout) < 1e-5
    assert (tmp_path / "repro" / "model.onnx").exists()


@pytest.mark.slow
def test_observed_method_exported_with_torch_within_tolerance_exits_0(mymodels, tmp_path):
    model = mymodels.Scorer().eval()
    shapes = observed_shapes(model, [{"x": torch.randn(2, 16)}, {"x": torch.randn(3, 16)}], method="encode")

    repro = write_repro(tmp_path / "repro", model, shapes, first_call(shapes), stage="variations",
                        target="torch", method="encode", atol=None, rtol=None)

    assert "model.forward = model.encode" in Path(repro.path).read_text()
    completed = run(repro, tmp_path)
    assert completed.returncode == 0, completed.stderr
    assert "within tolerance" in completed.stdout


@pytest.mark.slow
def test_class_defined_in_a_function_needs_the_user(tmp_path):
    class Local(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.linear(x)

    model = Local().eval()
    shapes = observed_shapes(model, [{"x": torch.randn(2, 4)}, {"x": torch.randn(3, 4)}])

    repro = write_repro(tmp_path / "repro", model, shapes, first_call(shapes), stage="verify",
                        target="onnx", method="forward", atol=None, rtol=None)

    name = f"{__name__}.test_class_defined_in_a_function_needs_the_user.<locals>.Local"
    assert repro.runnable is False
    assert repro.note == (
        f"repro needs the model: {name} cannot be rebuilt automatically (it is defined inside a function)")
    assert repro.note in Path(repro.path).read_text()
    completed = run(repro, tmp_path)
    assert completed.returncode == 1
    assert "NotImplementedError: build the model in build_model() of repro.py" in completed.stderr


@pytest.mark.parametrize(
    ("build", "why"),
    [
        (lambda m: m.NeedsWidth(16), "its constructor needs arguments: width"),
        (lambda m: m.Scorer(hidden=4),
         "Scorer() has other parameters than the observed instance, built with arguments"),
    ],
)
def test_class_that_cls_cannot_rebuild_needs_the_user(mymodels, tmp_path, build, why):
    model = build(mymodels).eval()
    shapes = observed_shapes(model, [{"x": torch.randn(2, 16)}, {"x": torch.randn(3, 16)}])

    repro = write_repro(tmp_path, model, shapes, first_call(shapes), stage="verify",
                        target="onnx", method="forward", atol=None, rtol=None)

    assert (repro.runnable, repro.note) == (
        False, f"repro needs the model: mymodels.{type(model).__name__} cannot be rebuilt automatically ({why})")


def test_unknown_stage_is_an_error(mymodels, tmp_path):
    model = mymodels.Scorer().eval()
    shapes = observed_shapes(model, [{"x": torch.randn(2, 16)}])
    with pytest.raises(ValueError, match="no repro for stage 'infer'"):
        write_repro(tmp_path, model, shapes, first_call(shapes), stage="infer",
                    target="onnx", method="forward", atol=None, rtol=None)


@pytest.mark.slow
def test_llama_with_dynamic_cache_is_rebuilt_from_its_config(tmp_path):
    transformers = pytest.importorskip("transformers")
    from pytest_exportobs.core.cache_pytrees import register_flattening_functions
    from pytest_exportobs.core.caches import make_dynamic_cache

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config()).eval()

    def call(batch: int, seq: int, past: int) -> dict:
        pairs = [(torch.randn(batch, 2, past, 16), torch.randn(batch, 2, past, 16)) for _ in range(2)]
        return {
            "input_ids": torch.randint(0, 100, (batch, seq)),
            "attention_mask": torch.ones(batch, seq + past, dtype=torch.int64),
            "past_key_values": make_dynamic_cache(pairs),
        }

    with register_flattening_functions():
        shapes = observed_shapes(model, [call(2, 3, 5), call(3, 4, 6)])
        repro = write_repro(tmp_path / "repro", model, shapes, first_call(shapes), stage="verify",
                            target="onnx", method="forward", atol=0.0, rtol=0.0)

    script = Path(repro.path).read_text()
    assert (repro.runnable, repro.note) == (True, "")
    assert "from transformers import LlamaConfig, LlamaForCausalLM" in script
    assert "'past_key_values': [{0: 'batch', 2: 'past_seq'}," in script
    assert "with register_flattening_functions(), torch.no_grad():" in script  # caches and export patches
    assert (tmp_path / "repro" / "config.json").exists()
    completed = run(repro, tmp_path)
    assert completed.returncode == 1, completed.stderr
    assert max_abs_diff(completed.stdout) > 0


@pytest.mark.slow
def test_localize_names_the_first_node_beyond_tolerance_and_its_line(mymodels, tmp_path):
    """With a tolerance of 0 the first node that rounds otherwise than torch is the culprit."""
    torch.manual_seed(0)
    model = mymodels.Scorer().eval()
    shapes = observed_shapes(model, [{"x": torch.randn(2, 16)}, {"x": torch.randn(3, 16)}])
    repro = write_repro(tmp_path / "repro", model, shapes, first_call(shapes), stage="verify",
                        target="onnx", method="forward", atol=0.0, rtol=0.0)

    completed = subprocess.run([sys.executable, repro.path, "--localize"], cwd=tmp_path, capture_output=True,
                               text=True, timeout=600)

    assert completed.returncode == 1, completed.stderr
    lines = completed.stdout.splitlines()
    summary, *rows = lines[next(i for i, line in enumerate(lines) if line.startswith("max abs diff")) + 1:]
    assert re.fullmatch(r"first diverging op: \w+(, \w+)* \(\w+\) from aten\.\w+\.\w+ at \S+mymodels\.py:\d+: .+: "
                        r"\|Δ\| \S+ introduced on torch's inputs, \S+ accumulated", summary), summary
    assert rows and all(row.startswith(("  beyond  ", "  within  ")) for row in rows)
