"""The engine on one model group: stages, reasons, verdicts, cache, tolerances (no pytest session)."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import onnx
import onnxruntime
import pytest
import torch

from pytest_exportobs import InputObserver, ShapeModel
from pytest_exportobs.core.vocabulary import Target
from pytest_exportobs.engine.base.result import ModelResult
from pytest_exportobs.engine.base.settings import CheckSettings
from pytest_exportobs.engine.check import check_model
from pytest_exportobs.engine.explore.ranges import MAX_OUTPUT_ELEMENTS
from pytest_exportobs.engine.export import cache, digests
from pytest_exportobs.engine.verify.compare import OutputLayout, Tolerance, compare, run_and_compare
from pytest_exportobs.observe.store import ModelGroup, ObserveOptions, SessionStore
from pytest_exportobs.shapes.spec import spec_api

import models
from models import MLP, Branchy, CheckedOnRequest, ConvNet, HalvingUNet, PatchMixer


@torch.library.custom_op("exportobs_test::mystery", mutates_args=())
def mystery(x: torch.Tensor) -> torch.Tensor:
    return x.clone() + 1


@mystery.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class UsesMystery(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mystery(x) * 2


def observed(module: torch.nn.Module, *calls: tuple, name: str = "model", **options) -> ModelGroup:
    store = SessionStore()
    torch.manual_seed(0)
    with store.observe(module, name, ObserveOptions(**options), "test_check.py::test") as group:
        for args in calls:
            module(*args)
    return group


def settings(tmp_path: Path, **kwargs) -> CheckSettings:
    return CheckSettings(export_dir=tmp_path, examples=0, **kwargs)


def test_exportable_mlp_passes_with_its_numbers(tmp_path: Path) -> None:
    group = observed(MLP().eval(), (torch.randn(2, 8),), (torch.randn(5, 8),))
    result = check_model(group, settings(tmp_path))
    assert (result.verdict, result.stage, result.kind, result.reason) == ("passed", "verify", None, "")
    assert result.dims == {"x": {"0": "batch"}}
    assert result.dim_sources == {"batch": "observed"}
    assert result.n_observations == 2
    assert 0 <= result.max_abs < 1e-5  # bit-exact on some CPUs
    assert result.reference == "recorded"
    assert [d["ok"] for d in result.discrepancies] == [True, True]
    assert Path(result.onnx_path) == tmp_path / "model" / "model.onnx"
    assert result.op_counts["Gemm"] + result.op_counts.get("MatMul", 0) >= 2
    assert set(result.timings) >= {"infer", "torch.export", "decompose", "onnx-translate", "onnx-checker", "verify"}


def test_conv_net_with_dynamic_height_and_width(tmp_path: Path) -> None:
    group = observed(ConvNet().eval(), (torch.randn(2, 3, 16, 20),), (torch.randn(3, 3, 24, 12),),
                     name="pixel_values")
    result = check_model(group, settings(tmp_path))
    assert result.verdict == "passed", result.reason
    assert result.dims == {"images": {"0": "batch", "2": "height", "3": "width"}}


def test_data_dependent_branch_fails_at_torch_export_with_the_source_line(tmp_path: Path) -> None:
    group = observed(Branchy(), (torch.randn(2, 4),), (torch.randn(3, 4),))
    result = check_model(group, settings(tmp_path))
    assert (result.verdict, result.stage, result.kind) == ("failed", "torch.export", "error")
    source = Path(models.__file__)
    line = next(i for i, text in enumerate(source.read_text().splitlines(), 1) if "if x.sum() > 0" in text)
    assert result.reason.startswith("GuardOnDataDependentSymNode: Could not guard on data-dependent expression")
    assert result.reason.endswith(f"(at {os.path.relpath(source)}:{line}: if x.sum() > 0:)")


def test_op_without_onnx_translation_fails_at_translation_naming_it(tmp_path: Path) -> None:
    group = observed(UsesMystery(), (torch.randn(2, 4),), (torch.randn(3, 4),))
    result = check_model(group, settings(tmp_path))
    assert (result.verdict, result.stage) == ("failed", "onnx-translate")
    assert "exportobs_test" in result.reason and "mystery" in result.reason


class Wide(torch.nn.Module):
    """Wide enough (GELU over 256 features, a softmax) that onnxruntime rounds differently from eager
    on every CPU: the small MLP is bit-exact on some."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(64, 256), torch.nn.Linear(256, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.nn.functional.gelu(self.l1(x))).softmax(-1)


def test_tolerance_below_the_real_error_fails_as_mismatch_with_numbers(tmp_path: Path) -> None:
    group = observed(Wide().eval(), (torch.randn(2, 64),), (torch.randn(5, 64),), atol=0.0, rtol=0.0)
    result = check_model(group, settings(tmp_path))
    assert (result.verdict, result.stage, result.kind) == ("failed", "verify", "mismatch")
    assert result.max_abs > 0
    assert f"max |Δ| {result.max_abs:.3g}" in result.reason
    assert "values beyond tolerance, worst in output (atol=0, rtol=0)" in result.reason


class Transposed(torch.nn.Module):
    """``x @ w.T``: onnxscript's optimizer folds the transpose of a constant weight into a new
    initializer."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(3, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T


class Normalized(torch.nn.Module):
    """A linear layer, a batch norm: onnxscript's optimizer folds the norm of constant weights."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.norm = torch.nn.Linear(8, 6), torch.nn.BatchNorm1d(6)
        torch.nn.init.uniform_(self.norm.running_var, 0.5, 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x))


@pytest.mark.parametrize("module_class", [MLP, Transposed, Normalized])
def test_second_run_hits_the_cache_and_changed_weights_are_applied_by_name(
    tmp_path: Path, module_class: type[torch.nn.Module],
) -> None:
    """A suite that does not seed its models: the cached graph serves the new weights, applied by
    name; the file holds each weight it reads under its own name, none folded into another."""
    group = observed(module_class().eval(), (torch.randn(2, 8),), (torch.randn(5, 8),))
    first = check_model(group, settings(tmp_path))
    used = {name for name, _ in group.module.named_parameters()} | {
        name for name, _ in group.module.named_buffers() if not name.endswith("num_batches_tracked")}
    assert {i.name for i in onnx.load(first.onnx_path).graph.initializer} == used
    second = check_model(group, settings(tmp_path))
    assert (first.cache_hit, second.cache_hit) == (False, True)
    assert second.verdict == "passed" and "torch.export" not in second.timings
    assert "applied to it by name" not in " ".join(second.notes)
    with torch.no_grad():
        for parameter in group.module.parameters():
            parameter.mul_(-2.0)
    third = check_model(group, settings(tmp_path))
    assert (third.cache_hit, third.verdict, third.stage) == (True, "passed", "verify")
    assert "the weights differ from those of the cached graph: applied to it by name" in third.notes
    assert third.reference.startswith("recomputed on the exported instance for 2 of 2")
    session = onnxruntime.InferenceSession(third.onnx_path)
    x = torch.randn(7, 8)
    (actual,) = session.run(None, {"x": x.numpy()})
    torch.testing.assert_close(torch.from_numpy(actual), group.module(x).detach(), atol=1e-5, rtol=1e-5)


def test_a_rerun_does_not_explore_again_the_variations_its_trace_passed(tmp_path: Path) -> None:
    """The exploration's outcome is kept with the trace: a rerun (other weights too: a suite that
    does not seed its models) reports it without running the examples; other exploration settings
    explore again."""
    group = observed(MLP().eval(), (torch.randn(2, 8),), (torch.randn(5, 8),))
    first = check_model(group, CheckSettings(export_dir=tmp_path, examples=6))
    assert first.verdict == "passed" and "variations" in first.graphs[0].timings
    with torch.no_grad():
        for parameter in group.module.parameters():
            parameter.mul_(-2.0)
    again = check_model(group, CheckSettings(export_dir=tmp_path, examples=6))
    assert (again.cache_hit, again.verdict) == (True, "passed")
    assert "variations" not in again.graphs[0].timings
    assert again.graphs[0].variations == first.graphs[0].variations
    valid = first.graphs[0].variations["valid"]
    assert (f"variations: as explored on an earlier check of this trace ({valid} examples passed), not again (the "
            "export cache holds the outcome)") in again.notes
    more = check_model(group, CheckSettings(export_dir=tmp_path, examples=7))
    assert more.cache_hit and "variations" in more.graphs[0].timings


def test_a_rerun_explores_again_the_variations_its_trace_failed(tmp_path: Path) -> None:
    """PatchMixer fails at sides that are no multiple of its patch (a branch traced once)."""
    group = observed(PatchMixer().eval(), (torch.randn(2, 3, 8, 8),), (torch.randn(3, 3, 12, 10),))
    first = check_model(group, CheckSettings(export_dir=tmp_path, examples=6, hypothesis_seed=0))
    again = check_model(group, CheckSettings(export_dir=tmp_path, examples=6, hypothesis_seed=0))
    assert (first.verdict, first.kind, again.verdict, again.kind) == ("failed", "variation", "failed", "variation")
    assert again.cache_hit and "variations" in again.graphs[0].timings
    assert again.reason == first.reason


def test_the_largest_example_explored_is_bounded_by_its_outputs_also_on_a_trace_from_the_cache(tmp_path: Path) -> None:
    """Attention maps grow with the square of the tokens: the exploration's highs (every size at
    once) hold at most MAX_OUTPUT_ELEMENTS in the outputs, as the program says how many they hold;
    a second check (one more example: explored again) takes that from the export cache's trace."""
    group = observed(models.AttentionMaps().eval(), (torch.randn(13, 200, 16),), (torch.randn(12, 180, 16),))
    first = check_model(group, CheckSettings(export_dir=tmp_path, examples=4, hypothesis_seed=0))
    again = check_model(group, CheckSettings(export_dir=tmp_path, examples=5, hypothesis_seed=0))
    assert (first.verdict, again.verdict, first.cache_hit, again.cache_hit) == ("passed", "passed", False, True)
    assert "torch.export" not in again.graphs[0].timings and "variations" in again.graphs[0].timings
    for result in (first, again):
        examples = result.graphs[0].variations["examples"]
        assert examples[-1] == {"batch": 19, "seq": 300}  # the largest: every size at its high
        assert max(8 * e["batch"] * e["seq"] ** 2 + 16 * e["batch"] * e["seq"] for e in examples) <= MAX_OUTPUT_ELEMENTS


class Labelled(MLP):
    """An MLP with a configuration its forward never reads (as a transformers config's labels)."""

    def __init__(self, label: str) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(label=label)


def test_a_model_whose_trace_is_another_ones_takes_its_translation(tmp_path: Path) -> None:
    """Another configuration is another trace key; the traced program is the same, so the
    decomposition and translation are skipped and the second model's weights applied."""
    models = []
    for seed, label in enumerate("ab"):
        torch.manual_seed(seed)  # weights of their own, whatever the tests before drew
        models.append(Labelled(label).eval())
    first = check_model(observed(models[0], (torch.randn(2, 8),), (torch.randn(5, 8),)), settings(tmp_path))
    second = check_model(observed(models[1], (torch.randn(3, 8),), (torch.randn(4, 8),)), settings(tmp_path))
    assert (first.verdict, second.verdict) == ("passed", "passed")
    assert (first.cache_hit, second.cache_hit) == (False, False)
    assert ("decompose" in first.timings, "decompose" in second.timings) == (True, False)
    assert {"the traced graph is one the export cache holds: decomposition and translation skipped",
            "the weights differ from those of the cached graph: applied to it by name"} <= set(second.notes)


def test_a_model_loaded_from_another_directory_hits_the_cache(tmp_path: Path) -> None:
    """transformers' tests save and reload models through a fresh temporary directory: the
    configuration's ``_name_or_path`` differs in every run, what the model computes does not."""
    transformers = pytest.importorskip("transformers")

    def loaded_from(path: str) -> MLP:
        model = MLP().eval()
        model.config = transformers.PretrainedConfig(name_or_path=path)
        return model

    first = check_model(observed(loaded_from("/tmp/tmpa1b2c3"), (torch.randn(2, 8),), (torch.randn(5, 8),)),
                        settings(tmp_path))
    again = check_model(observed(loaded_from("/tmp/tmpz9y8x7"), (torch.randn(2, 8),), (torch.randn(5, 8),)),
                        settings(tmp_path))
    assert (first.cache_hit, again.cache_hit, again.verdict) == (False, True, "passed")
    assert "torch.export" not in again.timings


def test_an_entry_of_an_earlier_format_misses_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Entries written before the conditions of runtime asserts were kept would lack them."""
    group = observed(MLP().eval(), (torch.randn(2, 8),), (torch.randn(5, 8),))
    assert check_model(group, settings(tmp_path)).cache_hit is False
    monkeypatch.setattr(cache, "ENTRY_FORMAT", cache.ENTRY_FORMAT - 1)
    assert check_model(group, settings(tmp_path)).cache_hit is False
    monkeypatch.undo()
    assert check_model(group, settings(tmp_path)).cache_hit is True


def test_an_entry_made_by_other_code_of_the_plugin_misses_the_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin's own code is part of every key: an entry another version of it made (same
    version number, other source) is not served."""
    group = observed(MLP().eval(), (torch.randn(2, 8),), (torch.randn(5, 8),))
    assert check_model(group, settings(tmp_path)).cache_hit is False
    monkeypatch.setattr(digests, "plugin_digest", lambda: "other code")
    assert check_model(group, settings(tmp_path)).cache_hit is False
    monkeypatch.undo()
    assert check_model(group, settings(tmp_path)).cache_hit is True


class StepByStep(torch.nn.Module):
    """A recurrence over the sequence in Python (Mamba's path without its kernels): a graph
    holds one length, whatever the length traced."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state, states = torch.zeros_like(x[:, 0]), []
        for index in range(x.shape[1]):  # one step per position
            state = torch.tanh(self.cell(state) + x[:, index])
            states.append(state)
        return torch.stack(states, 1)


@contextlib.contextmanager
def traced_sizes() -> Iterator[list[tuple[int, ...]]]:
    """The shapes of the first tensor of every torch.export call made meanwhile."""
    sizes: list[tuple[int, ...]] = []
    export = torch.export.export

    def counted(module, args, kwargs=None, **options):
        first = next(t for t in (*args, *(kwargs or {}).values()) if isinstance(t, torch.Tensor))
        sizes.append(tuple(first.shape))
        return export(module, args, kwargs, **options)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.export, "export", counted)
        yield sizes


def test_a_line_that_pins_every_size_stops_the_retraces_and_a_rerun_fails_alike_untraced(tmp_path: Path) -> None:
    """The sequence pinned at the loop on the first example (named dims, then ``Dim.DYNAMIC``;
    on torch >= 2.14 after a ``ShapesSpec``, which fails on the loop) and again at the loop on
    another recorded length (named dims only): the line pins every length, no other export is
    tried.  The failure is kept in the export cache: the rerun reports it as the
    first check did, without tracing."""
    calls = [(torch.randn(2, n, 4),) for n in (5, 7, 6, 8)]
    with traced_sizes() as first_sizes:
        first = check_model(observed(StepByStep().eval(), *calls), settings(tmp_path))
    with traced_sizes() as rerun_sizes:
        again = check_model(observed(StepByStep().eval(), *calls), settings(tmp_path))
    line = next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1)
                if "for index in range(x.shape[1]):" in text)
    assert (first.verdict, first.stage, first.kind) == ("failed", "torch.export", "specialized")
    assert first.reason == ("seq (x.1, the tests vary it) specialized to 5 by torch.export at tests/unit/"
                            f"test_check.py:{line}: for index in range(x.shape[1]):  # one step per position")
    assert [size[1] for size in first_sizes] == [5] * (spec_api() is not None) + [5, 5, 7]  # a ShapesSpec first
    assert rerun_sizes == []
    assert (again.verdict, again.stage, again.kind, again.reason, again.dims, again.cache_hit) == (
        first.verdict, first.stage, first.kind, first.reason, first.dims, True)
    assert again.graphs[0].traceback == first.graphs[0].traceback
    assert again.notes == [*first.notes, "export cache hit: this trace failed at torch.export on an earlier check "
                                         "with nothing it depends on changed since, not exported again"]


def test_a_failed_translation_is_kept_and_the_rerun_neither_traces_nor_translates(tmp_path: Path) -> None:
    group = observed(UsesMystery(), (torch.randn(2, 4),), (torch.randn(3, 4),))
    first = check_model(group, settings(tmp_path))
    with traced_sizes() as sizes:
        again = check_model(group, settings(tmp_path))
    assert (first.verdict, first.stage, first.cache_hit) == ("failed", "onnx-translate", False)
    assert (again.verdict, again.stage, again.kind, again.reason, again.cache_hit) == (
        "failed", "onnx-translate", first.kind, first.reason, True)
    assert sizes == [] and "onnx-translate" not in again.timings and again.dims == first.dims


def test_corrupted_cache_entry_is_rebuilt(tmp_path: Path) -> None:
    group = observed(MLP().eval(), (torch.randn(2, 8),), (torch.randn(5, 8),))
    check_model(group, settings(tmp_path))
    for entry in (tmp_path / "cache").glob("*.onnx"):
        entry.write_bytes(entry.read_bytes()[:100])
    again = check_model(group, settings(tmp_path))
    assert (again.cache_hit, again.verdict) == (False, "passed")


def test_a_graph_file_replaced_since_its_entry_was_stored_misses(tmp_path: Path) -> None:
    """Another process storing the same graph with other weights leaves a file of the same size
    that the entry's metadata does not describe: taken for the entry, its weights would be stale
    (the metadata says they are the module's); it misses and the graph is exported again."""
    group = observed(MLP().eval(), (torch.randn(2, 8),), (torch.randn(5, 8),))
    check_model(group, settings(tmp_path))
    (kept,) = (tmp_path / "cache").glob("graph-*.onnx")
    model = onnx.load(str(kept))
    for initializer in model.graph.initializer:
        initializer.raw_data = bytes(len(initializer.raw_data))  # zeros: another model's weights
    onnx.save(model, str(tmp_path / "other.onnx"))
    assert (tmp_path / "other.onnx").stat().st_size == kept.stat().st_size
    os.replace(tmp_path / "other.onnx", kept)
    again = check_model(group, settings(tmp_path))
    assert (again.cache_hit, again.verdict) == (False, "passed")
    assert "onnx-translate" in again.timings
    session = onnxruntime.InferenceSession(again.onnx_path)
    x = torch.randn(7, 8)
    (actual,) = session.run(None, {"x": x.numpy()})
    torch.testing.assert_close(torch.from_numpy(actual), group.module(x).detach(), atol=1e-5, rtol=1e-5)
    assert check_model(group, settings(tmp_path)).cache_hit is True


def test_an_export_directory_copied_elsewhere_serves_its_graphs(tmp_path: Path) -> None:
    """CI restores the export directory from its cache: the files get new inodes and, copied as
    ``cp -r`` copies, new modification times; their bytes are the same, and they are served."""
    group = observed(MLP().eval(), (torch.randn(2, 8),), (torch.randn(5, 8),))
    first = check_model(group, settings(tmp_path / "first"))
    shutil.copytree(tmp_path / "first", tmp_path / "restored", copy_function=shutil.copyfile)
    again = check_model(group, settings(tmp_path / "restored"))
    assert (first.cache_hit, again.cache_hit, again.verdict) == (False, True, "passed")
    assert not {"torch.export", "decompose", "onnx-translate"} & set(again.timings)


def test_a_rerun_in_place_takes_its_graph_files_as_hashed_and_a_copy_is_hashed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A graph file with the size and modification time it had when its entry was stored is not
    read to be hashed again (timm's 46 files, 792 MB, on every rerun); a copy with new times is."""
    from pytest_exportobs.core import files

    group = observed(MLP().eval(), (torch.randn(2, 8),), (torch.randn(5, 8),))
    check_model(group, settings(tmp_path / "first"))
    shutil.copytree(tmp_path / "first", tmp_path / "restored", copy_function=shutil.copyfile)
    hashed: list[Path] = []
    digest = files.file_digest
    monkeypatch.setattr(files, "file_digest", lambda path: hashed.append(Path(path)) or digest(path))
    in_place = check_model(group, settings(tmp_path / "first"))
    assert (in_place.cache_hit, hashed) == (True, [])
    restored = check_model(group, settings(tmp_path / "restored"))
    assert restored.cache_hit and [path.parent.name for path in hashed] == ["cache"]


class BatchesSeen(MLP):
    """An MLP that keeps the batch size of every call it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.batches.append(x.shape[0])
        return super().forward(x)


def test_a_trace_the_cache_holds_is_found_without_running_eager_on_a_made_example(tmp_path: Path) -> None:
    """Calls of one row only: the first check traces inputs made at another batch once eager
    accepts them; a rerun whose cache holds that trace runs the model on recorded calls only."""
    model = BatchesSeen().eval()
    group = observed(model, (torch.randn(1, 8),), (torch.randn(1, 8),))
    model.batches.clear()
    first = check_model(group, settings(tmp_path))
    made = set(model.batches) - {1}
    model.batches.clear()
    again = check_model(group, settings(tmp_path))
    assert (first.verdict, first.cache_hit, again.verdict, again.cache_hit) == ("passed", False, "passed", True)
    assert "no recorded call has every dynamic size >= 2: exported on synthesized inputs" in again.notes
    assert made and not set(model.batches) - {1}  # made inputs ran on the first check only
    assert again.dims == first.dims == {"x": {"0": "batch"}}


def test_target_torch_stops_after_torch_export(tmp_path: Path) -> None:
    group = observed(MLP().eval(), (torch.randn(2, 8),), (torch.randn(5, 8),))
    result = check_model(group, settings(tmp_path, targets=(Target.TORCH,)))
    assert (result.verdict, result.stage, result.onnx_path) == ("passed", "verify", "")
    assert "onnx-translate" not in result.timings
    assert result.max_abs is not None and result.max_abs < 1e-5


def test_model_with_no_call_is_skipped(tmp_path: Path) -> None:
    group = observed(MLP().eval())
    result = check_model(group, settings(tmp_path))
    assert (result.verdict, result.stage, result.reason) == ("skipped", "observe", "no call of the model was observed")


def test_module_mode_is_restored_and_export_runs_in_eval(tmp_path: Path) -> None:
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    group = observed(module.eval(), (torch.randn(2, 4),), (torch.randn(3, 4),))
    module.train()
    result = check_model(group, settings(tmp_path))
    assert result.verdict == "passed", result.reason
    assert module.training is True


class CachedDecoder(torch.nn.Module):
    """A decoder step: ``past`` (batch, past_seq, 4) is absent at prefill, as a KV cache is."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, past: torch.Tensor | None = None) -> torch.Tensor:
        if past is None:
            past = x.new_zeros((x.shape[0], 0, x.shape[2]))
        return self.proj(torch.cat([past, x], dim=1)).sum(dim=1)


def test_an_optional_input_of_unknown_meaning_gets_a_graph_of_its_own(tmp_path: Path) -> None:
    module = CachedDecoder()
    store = SessionStore()
    with store.observe(module, "decoder", ObserveOptions(), "t") as group:
        module(torch.randn(2, 5, 4))  # prefill: batch 2, no cache
        module(torch.randn(1, 1, 4), past=torch.randn(1, 5, 4))
        module(torch.randn(3, 1, 4), past=torch.randn(3, 6, 4))
    result = check_model(group, settings(tmp_path))
    assert result.verdict == "passed", result.reason
    assert [(g.name, g.calls, g.dims) for g in result.graphs] == [
        ("with past", [1, 2], {"x": {"0": "batch", "1": "seq"}, "past": {"0": "batch", "1": "past_dim1"}}),
        ("without past", [0], {"x": {"0": "batch", "1": "seq"}}),
    ]


def test_the_library_api_stands_in_for_an_absent_input_with_an_empty_tensor_of_the_calls_batch() -> None:
    module = CachedDecoder()
    observer = InputObserver()
    with observer(module):
        module(torch.randn(2, 5, 4))
        module(torch.randn(1, 1, 4), past=torch.randn(1, 5, 4))
        module(torch.randn(3, 1, 4), past=torch.randn(3, 6, 4))
    shapes = ShapeModel.from_aligned(observer.aligned())
    assert [tuple(t.shape) for t in shapes.call_leaves(0)] == [(2, 5, 4), (2, 0, 4)]


class KeywordConstants(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        y = self.proj(x)
        return y * 2 if kwargs.get("return_dict") else y

    def encode(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.proj(x) * scale


@pytest.mark.parametrize("target", ["onnx", "torch"])
def test_calls_with_other_constants_get_a_graph_of_their_own(tmp_path: Path, target: str) -> None:
    module = KeywordConstants()
    store = SessionStore()
    with store.observe(module, "constants", ObserveOptions(), "t") as group:
        module(torch.randn(2, 4), return_dict=True)
        module(torch.randn(3, 4), return_dict=True)
        module(torch.randn(5, 4))  # like a direct call beside generate()'s calls: y, not 2 * y
    result = check_model(group, settings(tmp_path, targets=(Target(target),)))
    assert (result.verdict, result.n_observations, len(result.discrepancies)) == ("passed", 3, 3), result.reason
    graphs = [(g.name, g.calls, g.constants, g.verdict, g.dims) for g in result.graphs]
    assert graphs == [
        ("return_dict=True", [0, 1], {"return_dict": True}, "passed", {"x": {"0": "batch"}}),
        ("return_dict default", [2], {}, "passed", {"x": {"0": "batch"}}),
    ]


@pytest.mark.parametrize("every_graph", [False, True])
def test_a_models_check_ends_at_its_first_failing_graph_unless_every_graph_is_asked(
    tmp_path: Path, every_graph: bool
) -> None:
    module = CheckedOnRequest()
    store = SessionStore()
    with store.observe(module, "checked", ObserveOptions(), "t") as group:
        module(torch.randn(2, 4), checked=True)
        module(torch.randn(3, 4), checked=True)
        module(torch.randn(5, 4))
    result = check_model(group, settings(tmp_path, every_graph=every_graph))
    assert (result.verdict, result.stage, result.kind) == ("failed", "torch.export", "error")
    assert result.reason.startswith("[checked=True] GuardOnDataDependentSymNode")  # the same either way
    graphs = [(g.name, g.calls, g.verdict) for g in result.graphs]
    unchecked = ("calls [2] not checked: the check ended at the first failing graph, whose failure is the model's "
                 "verdict (--export-every-graph checks them)")
    if every_graph:
        assert graphs == [("checked=True", [0, 1], "failed"), ("checked default", [2], "passed")]
        assert unchecked not in result.model_notes
    else:
        assert graphs == [("checked=True", [0, 1], "failed")]
        assert unchecked in result.model_notes


def test_calls_with_other_constants_and_the_same_outputs_share_a_graph(tmp_path: Path) -> None:
    module = KeywordConstants()
    store = SessionStore()
    with store.observe(module, "constants", ObserveOptions(), "t") as group:
        module(torch.randn(2, 4), verbose=True)
        module(torch.randn(3, 4), verbose=True)
        module(torch.randn(5, 4))  # no effect on the outputs: the first graph reproduces it
    result = check_model(group, settings(tmp_path))
    assert result.verdict == "passed", result.reason
    assert [(g.name, g.calls, g.constants) for g in result.graphs] == [("verbose=True", [0, 1, 2], {"verbose": True})]
    assert result.graphs[0].notes[-1] == "calls [2] of other arguments or constants also run on this graph"


def test_a_method_other_than_forward_is_exported(tmp_path: Path) -> None:
    module = KeywordConstants()
    store = SessionStore()
    with store.observe(module, "encoder", ObserveOptions(method="encode"), "t") as group:
        module.encode(torch.randn(2, 4), 3.0)
        module.encode(torch.randn(6, 4), scale=3.0)
    result = check_model(group, settings(tmp_path))
    assert result.verdict == "passed", result.reason
    assert result.dims == {"x": {"0": "batch"}}


@pytest.mark.slow
def test_tiny_llama_onnx_axes_carry_the_inferred_names(tiny_llama, tmp_path: Path) -> None:
    """Prefill + decode calls at two batch sizes: the ONNX inputs read input_ids[batch, seq],
    attention_mask[batch, total_seq], caches [batch, 2, past_seq, 16]; ORT runs unseen sizes."""
    import onnx

    from pytest_exportobs import make_dynamic_cache, register_flattening_functions
    from pytest_exportobs.engine.verify.runtimes import OnnxRunner

    def cache(batch: int, past: int) -> object:
        return make_dynamic_cache([(torch.randn(batch, 2, past, 16), torch.randn(batch, 2, past, 16))] * 2)

    store = SessionStore()
    with register_flattening_functions(), store.observe(tiny_llama, "llama", ObserveOptions(), "t") as group:
        for batch, past, seq in ((2, 0, 6), (2, 6, 1), (3, 7, 1), (3, 4, 3)):
            inputs = dict(input_ids=torch.randint(0, 100, (batch, seq)),
                          attention_mask=torch.ones(batch, past + seq, dtype=torch.int64))
            tiny_llama(**inputs, **({models.cache_argument(): cache(batch, past)} if past else {}))
    result = check_model(group, settings(tmp_path))
    assert result.verdict == "passed", result.reason
    assert result.relations == ["total_seq = past_seq + seq"]
    model = onnx.load(result.onnx_path)
    axes = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert axes["input_ids"] == ["batch", "seq"]
    assert axes["attention_mask"] == ["batch", "total_seq"]
    caches = [axes[name] for name in axes if name.startswith(models.cache_argument())]
    assert caches == [["batch", 2, "past_seq", 16]] * 4
    logits = model.graph.output[0].type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in logits] == ["batch", "seq", 100]

    unseen = dict(input_ids=torch.randint(0, 100, (5, 4)), attention_mask=torch.ones(5, 13, dtype=torch.int64))
    past = cache(5, 9)
    with register_flattening_functions(), torch.no_grad():
        leaves = torch.utils._pytree.tree_leaves((unseen["input_ids"], unseen["attention_mask"], past))
        expected = tiny_llama(**unseen, **{models.cache_argument(): past}).logits
    got = OnnxRunner(Path(result.onnx_path))(leaves)[0]
    torch.testing.assert_close(torch.from_numpy(got), expected, atol=1e-4, rtol=1e-4)


def test_batch_one_only_with_forced_batch_runs_at_batch_three_in_ort(tmp_path: Path) -> None:
    from pytest_exportobs.engine.verify.runtimes import OnnxRunner

    group = observed(MLP().eval(), (torch.randn(1, 8),), (torch.randn(1, 8),), set_batch_dimension_for=True)
    result = check_model(group, settings(tmp_path))
    assert (result.verdict, result.dims) == ("passed", {"x": {"0": "batch"}})
    x = torch.randn(3, 8)
    runner = OnnxRunner(Path(result.onnx_path))
    torch.testing.assert_close(torch.from_numpy(runner([x])[0]), group.module(x))
    # the session keeps no memory arena: a check holds its graphs' sessions open, each arena the
    # size of its largest variation
    assert not runner.session.get_session_options().enable_cpu_mem_arena


PATCH_LOG: list[str] = []


@contextlib.contextmanager
def recording_patch() -> Iterator[None]:
    """An export patch (ini ``export_patches`` / marker ``patches=``) that records its use."""
    PATCH_LOG.append("enter")
    try:
        yield
    finally:
        PATCH_LOG.append("exit")


def test_export_patches_wrap_export_and_verification(tmp_path: Path) -> None:
    PATCH_LOG.clear()
    group = observed(MLP().eval(), (torch.randn(2, 8),), (torch.randn(5, 8),))
    result = check_model(group, settings(tmp_path, patches=(f"{__name__}.recording_patch",)))
    assert result.verdict == "passed" and PATCH_LOG == ["enter", "exit"]
    broken = check_model(group, settings(tmp_path, patches=("no_such_module.patch",)))
    assert broken.verdict == "failed"
    assert broken.reason == (
        "ValueError: export patch 'no_such_module.patch' cannot be imported: No module named 'no_such_module'")


def test_sides_torch_restricts_to_even_sizes_stay_even_in_variations(tmp_path: Path) -> None:
    group = observed(HalvingUNet().eval(), (torch.randn(2, 4, 16, 16),), (torch.randn(2, 4, 24, 20),))
    result = check_model(group, CheckSettings(export_dir=tmp_path, examples=12, hypothesis_seed=0))
    assert result.verdict == "passed", result.reason
    assert result.dims == {"latents": {"0": "batch", "2": "height", "3": "width"}}
    assert sorted(result.relations) == ["height = 2*height_half", "width = 2*width_half"]
    tried = result.graphs[0].variations["examples"]
    assert len(tried) > 1 and all(set(sizes) == {"batch", "height_half", "width_half"} for sizes in tried)
    cached = check_model(group, CheckSettings(export_dir=tmp_path, examples=12, hypothesis_seed=0))
    assert cached.cache_hit and sorted(cached.relations) == sorted(result.relations)  # read back from the cache


def test_a_dim_torch_turns_into_a_constant_fails_as_specialized_with_the_line(tmp_path: Path) -> None:
    class FirstRowsOnly(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] == 3:  # fine in eager for any batch, pins it in a graph
                return x[:1].expand(3, -1)
            return x

    result = check_model(observed(FirstRowsOnly(), (torch.randn(3, 4),)), settings(tmp_path))
    line = next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1) if "if x.shape[0] == 3" in text)
    assert (result.verdict, result.stage, result.kind) == ("failed", "torch.export", "specialized")
    assert result.reason.startswith("batch (x.0, a deployment varies it) ")
    assert result.reason.endswith(
        f"by torch.export at tests/unit/test_check.py:{line}: "
        "if x.shape[0] == 3:  # fine in eager for any batch, pins it in a graph")


class MaskedPool(torch.nn.Module):
    """A classifier called as transformers' tests call one: 2-D int64 masks, a bool mask, a 4-D float mask."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(50, 8), torch.nn.Linear(8, 3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embed(input_ids)
        if attention_mask is not None:
            mask = attention_mask[:, 0, -1, :] if attention_mask.dim() == 4 else attention_mask
            hidden = hidden * mask.to(hidden.dtype).unsqueeze(-1)
        return self.head(hidden.mean(1))


def test_calls_of_another_rank_or_dtype_get_graphs_of_their_own(tmp_path: Path) -> None:
    ids = [torch.randint(0, 50, (b, s)) for b, s in ((2, 7), (3, 5), (2, 6), (2, 6))]
    masks = [torch.ones(2, 7, dtype=torch.int64), torch.ones(3, 5, dtype=torch.int64),
             torch.ones(2, 6, dtype=torch.bool), torch.ones(2, 1, 6, 6)]
    group = observed(MaskedPool().eval(), *zip(ids, masks))
    result = check_model(group, settings(tmp_path))
    assert result.verdict == "passed", result.reason
    assert [(g.calls, g.inputs, g.dims) for g in result.graphs] == [
        ([0, 1], ["input_ids", "attention_mask"], {"input_ids": {"0": "batch", "1": "seq"},
                                                    "attention_mask": {"0": "batch", "1": "seq"}}),
        ([2], ["input_ids", "attention_mask"], {"input_ids": {"0": "batch", "1": "seq"},
                                                "attention_mask": {"0": "batch", "1": "seq"}}),
        ([3], ["input_ids", "attention_mask"], {"input_ids": {"0": "batch", "1": "seq"},
                                                "attention_mask": {"0": "batch", "2": "seq", "3": "seq"}}),
    ]
    assert "3 input structures (ranks, dtypes or cache classes differ)" in " ".join(result.notes)
    assert [g.name for g in result.graphs] == ["", "attention_mask bool", "attention_mask rank 4 float32"]


class HiddenStates(torch.nn.Module):
    """Like transformers' ``output_hidden_states=True, return_dict=False``: constants change the outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, output_hidden_states: bool = False, return_dict: bool = True) -> Any:
        hidden = self.l1(x)
        outputs = (self.l2(hidden), hidden) if output_hidden_states else (self.l2(hidden),)
        return dict(zip(("logits", "hidden_states"), outputs)) if return_dict else outputs


def test_the_export_cache_tells_graphs_of_other_constants_apart(tmp_path: Path) -> None:
    module = HiddenStates().eval()
    store = SessionStore()
    with store.observe(module, "hidden", ObserveOptions(), "t") as group:
        module(torch.randn(2, 4), return_dict=False)
        module(torch.randn(2, 4), output_hidden_states=True, return_dict=False)  # sizes as in the first call
    for run in range(2):  # the second run takes both graphs from the cache
        result = check_model(group, settings(tmp_path))
        assert result.verdict == "passed", result.reason
        assert [(g.constants, g.cache_hit, len(g.discrepancies)) for g in result.graphs] == [
            ({"return_dict": False}, bool(run), 1),
            ({"output_hidden_states": True, "return_dict": False}, bool(run), 1)]


def test_the_export_cache_tells_attention_implementations_apart(tmp_path: Path) -> None:
    """transformers' tests build one model with ``eager`` and with ``sdpa`` attention (its config's
    JSON holds neither): each gets its own graph (sdpa returns no attention weights)."""
    transformers = pytest.importorskip("transformers")
    from models import tiny_llama_config

    found = []
    for implementation in ("eager", "sdpa"):
        torch.manual_seed(0)
        model = transformers.LlamaModel(tiny_llama_config()).eval()
        model.set_attn_implementation(implementation)
        store = SessionStore()
        with store.observe(model, "llama", ObserveOptions(), "test_check.py::test") as group:
            model(torch.randint(0, 100, (2, 5)), output_attentions=True)
        result = check_model(group, settings(tmp_path))
        found.append((result.verdict, [g.cache_hit for g in result.graphs]))
    assert found == [("passed", [False]), ("passed", [False])]


class SpanQA(torch.nn.Module):
    """Extractive QA as transformers writes it: 1-D ``start_positions``/``end_positions`` targets."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.qa = torch.nn.Embedding(50, 8), torch.nn.Linear(8, 2)

    def forward(self, input_ids: torch.Tensor, start_positions: torch.Tensor, end_positions: torch.Tensor):
        start, end = self.qa(self.embed(input_ids)).unbind(-1)
        loss = (torch.nn.functional.cross_entropy(start, start_positions)
                + torch.nn.functional.cross_entropy(end, end_positions))
        return loss, start, end


def test_one_dimensional_targets_follow_the_batch(tmp_path: Path) -> None:
    torch.manual_seed(0)
    ids, starts, ends = torch.randint(0, 50, (13, 7)), torch.randint(0, 7, (13,)), torch.randint(0, 7, (13,))
    result = check_model(observed(SpanQA().eval(), (ids, starts, ends)), CheckSettings(export_dir=tmp_path, examples=3))
    assert result.verdict == "passed", result.reason
    assert result.dims == {"input_ids": {"0": "batch", "1": "seq"}, "start_positions": {"0": "batch"},
                           "end_positions": {"0": "batch"}}


def test_a_kernel_onnxruntime_lacks_is_run_widened_to_float32_naming_op_and_dtype(tmp_path: Path) -> None:
    model = MLP().to(torch.bfloat16).eval()
    result = check_model(observed(model, (torch.randn(2, 8, dtype=torch.bfloat16),)), settings(tmp_path))
    assert (result.verdict, result.runtimes) == ("passed", ["onnxruntime-float32"]), result.reason
    (note,) = [n for n in result.notes if n.startswith("run by onnxruntime in float32, each op's outputs rounded to "
                                                       "their half-precision type")]
    assert note.endswith(") in bfloat16") and "has no kernel for " in note
    assert result.max_abs < 0.0078  # under one bfloat16 unit at 1: computed as torch's bfloat16 kernels compute


def test_a_graph_onnxruntime_cannot_run_even_widened_goes_to_the_reference_evaluator_within_its_limits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_exportobs.engine.verify import runtimes

    def unloadable(path: Any) -> None:
        raise RuntimeError("no session")

    monkeypatch.setattr(runtimes, "WidenedRunner", unloadable)
    model = MLP().to(torch.bfloat16).eval()
    result = check_model(observed(model, (torch.randn(2, 8, dtype=torch.bfloat16),)), settings(tmp_path))
    assert (result.verdict, result.runtimes) == ("passed", ["onnx-reference"]), result.reason
    (note,) = [n for n in result.notes if n.startswith("run by onnx's reference evaluator: ")]
    assert note.endswith("in bfloat16; widened to float32 it cannot run either (RuntimeError: no session)"), note
    monkeypatch.setattr(runtimes, "MAX_REFERENCE_NODES", 1)
    result = check_model(observed(model, (torch.randn(2, 8, dtype=torch.bfloat16),)), settings(tmp_path / "limit"))
    assert (result.verdict, result.stage, result.kind) == ("skipped", "ort-load", "runtime"), result.reason
    assert result.reason.startswith("onnxruntime's CPUExecutionProvider has no kernel for ")
    assert (" in bfloat16; widened to float32 it cannot run either (RuntimeError: no session), and onnx's reference "
            "evaluator runs no graph of 3 nodes, over the reference evaluator's limit of 1: the ONNX was written and "
            "checked but cannot run here") in result.reason
    assert Path(result.onnx_path).is_file()


def test_a_wrong_translation_of_a_bfloat16_graph_fails_run_widened(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A translation of ``relu`` that doubles: onnxruntime cannot run the bfloat16 graph, widened to
    float32 it does and finds it wrong; the model in float64 does not excuse it."""
    from pytest_exportobs.compat import torch_private
    from pytest_exportobs.engine.export import pipeline

    def doubled_relu(x: Any) -> Any:
        from onnxscript import opset18 as op

        return op.Mul(op.Relu(x), op.CastLike(op.Constant(value_float=2.0), x))

    fresh = functools.cache(torch_private._torchlib_registry.__wrapped__)  # the wrong one stays in this test
    monkeypatch.setattr(torch_private, "_REGISTERED", set())
    monkeypatch.setattr(torch_private, "_torchlib_registry", fresh)
    monkeypatch.setattr(pipeline, "custom_translations", lambda: {torch.ops.aten.relu.default: doubled_relu})
    model = MLP().to(torch.bfloat16).eval()
    result = check_model(observed(model, (torch.randn(2, 8, dtype=torch.bfloat16),)), settings(tmp_path))
    assert (result.verdict, result.stage, result.kind, result.runtimes) == (
        "failed", "verify", "mismatch", ["onnxruntime-float32"]), result.reason
    assert "; first diverging op: Relu, Mul (node_relu) from aten.relu.default at tests/models.py:" in result.reason


def test_checks_forked_after_prepare_inherit_the_registry_with_this_packages_translations(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A translation registered in a forked check would build the decomposition table again there."""
    from pytest_exportobs.compat import torch_private
    from pytest_exportobs.engine.export import pipeline

    monkeypatch.setattr(torch_private, "_REGISTERED", set())
    fresh = functools.cache(torch_private._torchlib_registry.__wrapped__)
    monkeypatch.setattr(torch_private, "_torchlib_registry", fresh)
    try:
        pipeline.prepare((Target.ONNX,))
        table = torch_private.onnx_decompositions()
        torch_private.register_translations(pipeline.custom_translations())
        assert torch_private.onnx_decompositions() is table
        assert torch.ops.aten._grouped_mm.default in torch_private._REGISTERED
    finally:  # the tables of the registry this test built
        torch_private.translated_ops.cache_clear()
        torch_private.onnx_decompositions.cache_clear()


class HugeConv(torch.nn.Module):
    """A projection and a grouped convolution over time whose weights reach 1e11."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.conv = torch.nn.Conv1d(16, 16, 16, padding=8, groups=2)
        with torch.no_grad():
            self.conv.weight.mul_(1e11)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.proj(x).transpose(1, 2)).transpose(1, 2)


def test_differences_are_rounding_below_the_scale_of_their_output() -> None:
    reference = torch.tensor([[1.3e11, -2.1e11, 4.0e3, 7.5e10]])  # 4e3: terms of 1e11 that cancelled
    rounded = reference + torch.tensor([[1.0e4, -2.0e4, 2.5e5, 0.0]])  # another summation order
    assert compare([rounded], [reference], Tolerance()).ok
    wrong = reference + torch.tensor([[0.0, 0.0, 3.0e6, 0.0]])  # beyond a tenth of rtol * 2.1e11
    found = compare([wrong], [reference], Tolerance())
    assert (found.ok, found.n_beyond) == (False, 1)
    ordinary = torch.tensor([[0.5, -3.0, 9.0, 0.01]])  # below 10 the scale floor is under atol
    found = compare([ordinary + torch.tensor([[0.0, 0.0, 0.0, 2e-4]])], [ordinary], Tolerance())
    assert (found.ok, found.n_beyond) == (False, 1)
    assert not compare([rounded], [reference], Tolerance(atol=0.0, rtol=0.0)).ok


def test_one_unit_in_the_last_place_of_a_half_precision_output_is_rounding() -> None:
    """bfloat16 keys of magnitude 2 to 4 after a rotation: where eager and ONNX round one product
    apart, a value near 0 is off by 0.0156, one bfloat16 unit at that magnitude (DeepSeek-V3's
    bf16 tests); two units are not rounding, nor is one unit with ``rtol`` 0."""
    keys = torch.tensor([[3.5, -2.25, 0.0078125, 1.0]], dtype=torch.bfloat16)
    one_unit = keys.clone()
    one_unit[0, 2] += 0.015625
    assert compare([one_unit], [keys], Tolerance()).ok
    two_units = keys.clone()
    two_units[0, 2] += 0.03125
    found = compare([two_units], [keys], Tolerance())
    assert (found.ok, found.n_beyond) == (False, 1)
    assert not compare([one_unit], [keys], Tolerance(atol=0.01, rtol=0.0)).ok
    fp32 = keys.float()
    assert not compare([fp32 + torch.tensor([[0.0, 0.0, 0.015625, 0.0]])], [fp32], Tolerance()).ok


def test_a_model_of_huge_weights_passes_where_its_outputs_cancel(tmp_path: Path) -> None:
    model = HugeConv().eval()  # weights of 1e11, as uninitialized memory holds
    group = observed(model, (torch.randn(3, 35, 16),), (torch.randn(5, 20, 16),))
    result = check_model(group, settings(tmp_path))
    assert result.verdict == "passed", result.reason
    assert result.max_abs > 1e3  # the rounding of terms of 1e11, within tolerance


def test_a_loss_of_labels_at_padded_positions_is_read_nowhere() -> None:
    """A test's token labels under a left-padded mask: under causal attention the padded queries
    attend to nothing, their logits are arbitrary in eager and ONNX alike, and so is a loss that
    scores them; labels set to the ignore index there make the loss defined again."""
    layout = OutputLayout.of(["loss", "logits"], ["input_ids", "attention_mask", "labels"])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    labels = torch.tensor([[1, 2, 0, 1], [2, 2, 1, 0]])
    loss, logits = torch.tensor(1.25), torch.randn(2, 4, 3)
    arbitrary_rows = logits.clone()
    arbitrary_rows[0, :2] += 0.7
    exported = [loss + 0.01, arbitrary_rows]  # the loss averaged the arbitrary rows in
    found = run_and_compare(lambda leaves: exported, [torch.ones(2, 4), mask, labels], [loss, logits], Tolerance(),
                            outputs=layout)
    assert (found.ok, found.n_padded, found.n_beyond) == (True, 7, 0)
    ignored = labels.masked_fill(mask == 0, -100)
    found = run_and_compare(lambda leaves: exported, [torch.ones(2, 4), mask, ignored], [loss, logits], Tolerance(),
                            outputs=layout)
    assert (found.ok, found.worst) == (False, "loss (atol=0.0001, rtol=0.0001)")


def test_rows_of_padded_queries_are_compared_as_attention_reads_them() -> None:
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])  # left padding
    reference = torch.randn(2, 5, 8)
    garbage_at_padding = reference.clone()
    garbage_at_padding[0, :2] += 0.7  # queries that attend to nothing: arbitrary in eager and ONNX
    found = compare([garbage_at_padding], [reference], Tolerance(), padding=mask)
    assert (found.ok, found.n_padded, found.n_beyond) == (True, 16, 0)
    wrong_real_token = reference.clone()
    wrong_real_token[0, 2, 0] += 0.7
    found = compare([wrong_real_token], [reference], Tolerance(), padding=mask)
    assert (found.ok, found.kind, found.n_beyond, found.n_padded) == (False, "mismatch", 1, 0)
    start_logits = torch.randn(2, 5)  # a score per token (question answering): padded tokens are not read
    garbage_at_padding = start_logits.clone()
    garbage_at_padding[0, :2] += 0.7
    found = compare([garbage_at_padding], [start_logits], Tolerance(), padding=mask)
    assert (found.ok, found.n_padded) == (True, 2)
    classifier = torch.randn(2, 3)  # (batch, labels): no rows of queries
    found = compare([classifier + 0.7], [classifier], Tolerance(), padding=mask)
    assert (found.ok, found.n_beyond) == (False, 6)


def test_outputs_a_decomposition_reorders_are_compared_by_name(tmp_path: Path) -> None:
    """transformers' output recorder sets ``router_logits`` on the model's output before
    ``hidden_states``; torch's decomposition (a ``torch.cond`` leaves the program to it) rebuilds
    the output class in its fields' order, so the ONNX file's outputs come in another order than
    the model's, which a note names: each is compared with the model's output of its name, on the
    first run and on a rerun from the export cache (before: a shape mismatch at router_logits.0)."""
    from dataclasses import dataclass

    model_output = pytest.importorskip("transformers").utils.ModelOutput

    @dataclass
    class Routed(model_output):
        last_hidden_state: torch.Tensor | None = None
        hidden_states: tuple | None = None
        router_logits: tuple | None = None

    class Captured(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer, self.router = torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> Routed:
            hidden = torch.cond(x.sum() > 0, lambda t: self.layer(t), lambda t: -self.layer(t), (x,))
            out = Routed(last_hidden_state=hidden)
            out["router_logits"] = (self.router(hidden).flatten(0, 1),)
            out["hidden_states"] = (x, hidden)
            return out

    group = observed(Captured().eval(), (torch.randn(2, 5, 8),), (torch.randn(3, 4, 8),))
    first = check_model(group, CheckSettings(export_dir=tmp_path, examples=3, hypothesis_seed=0))
    again = check_model(group, CheckSettings(export_dir=tmp_path, examples=3, hypothesis_seed=0))
    note = ("the ONNX file's outputs come in another order than the model's (torch's decomposition rebuilds its "
            "output class in the order of its fields): last_hidden_state, hidden_states.0, hidden_states.1, "
            "router_logits.0; each is compared with the model's output of its name")
    assert (first.verdict, again.verdict, again.cache_hit) == ("passed", "passed", True), first.reason
    assert note in first.notes and note in again.notes
    assert first.dims == {"x": {"0": "batch", "1": "seq"}}
    assert len(first.graphs[0].variations["examples"]) > 1


class MaskPerLayerKind(torch.nn.Module):
    """Called as Jamba's tests call it: one mask per kind of layer, the linear layers' ``None``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, attention_mask: dict[str, torch.Tensor | None]) -> torch.Tensor:
        return self.proj(x) * attention_mask["full_attention"][..., None]


def test_a_mask_no_call_holds_is_left_absent(tmp_path: Path) -> None:
    """An attention mask entry ``None`` in every call has no shape to stand in for: the calls
    keep it absent (before: an internal error, StopIteration, computing the probe's key)."""
    calls = [(torch.randn(b, s, 4), {"full_attention": torch.ones(b, s), "linear_attention": None})
             for b, s in ((2, 5), (3, 6))]
    result = check_model(observed(MaskPerLayerKind().eval(), *calls), settings(tmp_path))
    assert (result.verdict, result.stage) == ("passed", "verify"), result.reason
    assert result.dims == {"attention_mask.full_attention": {"0": "batch", "1": "seq"}, "x": {"0": "batch", "1": "seq"}}


def test_rows_of_padded_tokens_flattened_over_the_batch_are_read_nowhere() -> None:
    """A mixture of experts' router logits, ``(batch * length, experts)``: the rows of padded
    tokens are computed from queries that attend to nothing, and the load-balancing loss leaves
    them out (Mixtral's ``test_load_balancing_loss``)."""
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    router_logits = torch.randn(10, 8)
    garbage_at_padding = router_logits.clone()
    garbage_at_padding[:2] += 0.7  # tokens 0 and 1 of the first sequence
    found = compare([garbage_at_padding], [router_logits], Tolerance(), padding=mask)
    assert (found.ok, found.n_padded, found.n_beyond) == (True, 16, 0)
    wrong_real_token = router_logits.clone()
    wrong_real_token[2, 0] += 0.7
    found = compare([wrong_real_token], [router_logits], Tolerance(), padding=mask)
    assert (found.ok, found.n_beyond, found.n_padded) == (False, 1, 0)
    per_head = torch.randn(10, 5, 5)  # (batch * heads, queries, keys): not rows of tokens
    found = compare([per_head + 0.7], [per_head], Tolerance(), padding=mask)
    assert (found.ok, found.n_padded) == (False, 0)


def test_a_model_resized_after_its_calls_is_verified_on_the_weights_the_calls_were_made_with(tmp_path: Path) -> None:
    """As resize_token_embeddings does: a new embedding module replaces the first; calls made before
    run on the first weights again (the recorded ids 20 to 49 do not fit the new table)."""
    model = MaskedPool().eval()
    store = SessionStore()
    torch.manual_seed(0)
    with store.observe(model, "model", ObserveOptions(), "t::test") as group:
        model(torch.randint(20, 50, (2, 7)))
        model(torch.randint(20, 50, (3, 5)))
        model.embed = torch.nn.Embedding(20, 8)
        model(torch.randint(0, 20, (4, 6)))
    result = check_model(group, settings(tmp_path))
    assert result.verdict == "passed", result.reason
    assert [(g.name, g.calls, g.verdict) for g in result.graphs] == [
        ("before the resize", [0, 1], "passed"), ("after the resize", [2], "passed")]
    assert result.reference == "recorded"  # each call compared with the outputs the test saw
    assert model.embed.num_embeddings == 20  # the instance is left as the test left it


@pytest.mark.slow
def test_a_transformers_model_resized_between_its_calls_is_verified_on_both_sides(tmp_path: Path) -> None:
    """transformers' resize_token_embeddings gives the tied embedding parameter new data: the calls
    before run on the first weights, their head still tied."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=99, n_embd=32, n_layer=1, n_head=4, n_positions=64)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    store = SessionStore()
    with store.observe(model, "gpt2", ObserveOptions(), "t::test") as group, torch.no_grad():
        model(torch.randint(50, 99, (2, 7)))
        model.resize_token_embeddings(120)
        model(torch.randint(0, 120, (3, 5)))
    result = check_model(group, settings(tmp_path))
    assert result.verdict == "passed", result.reason
    assert [(g.name, g.calls) for g in result.graphs] == [("before the resize", [0]), ("after the resize", [1])]
    assert [o.type.tensor_type.shape.dim[2].dim_value for o in onnx_outputs(result.graphs[0].onnx_path)[:1]] == [99]


def onnx_outputs(path: str) -> list:
    import onnx

    return list(onnx.load(path, load_external_data=False).graph.output)


def test_calls_made_with_weights_no_longer_at_hand_are_left_out_and_nothing_left_is_a_skip(tmp_path: Path) -> None:
    model = MaskedPool().eval()
    group = observed(model, (torch.randint(0, 50, (2, 7)),))
    group.weights.clear()  # as if they had not been held
    model.embed = torch.nn.Embedding(20, 8)
    result = check_model(group, settings(tmp_path))
    assert (result.verdict, result.stage) == ("skipped", "observe")
    assert result.reason.startswith("the model's parameters changed shape after its calls")
    assert result.model_notes == ["calls [0] left out: made before the parameters changed shape "
                                  "(resize_token_embeddings?), with weights no longer at hand"]


class Window(torch.nn.Module):
    """Rejects sequences longer than its ``max_len``, an attribute (neither a parameter nor a config)."""

    def __init__(self, max_len: int) -> None:
        super().__init__()
        self.max_len, self.linear = max_len, torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] > self.max_len:
            raise ValueError(f"sequence of {x.shape[1]} beyond max_len={self.max_len}")
        return self.linear(x)


class LimitedWindow(torch.nn.Module):
    """The window with its limit in a dict, which a model may change as it runs: its instances
    share a group."""

    def __init__(self, max_len: int) -> None:
        super().__init__()
        self.limits, self.linear = {"max_len": max_len}, torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] > self.limits["max_len"]:
            raise ValueError(f"sequence of {x.shape[1]} beyond max_len={self.limits['max_len']}")
        return self.linear(x)


def test_instances_computing_with_other_values_are_groups_of_their_own(tmp_path: Path) -> None:
    store = SessionStore()
    first, other = Window(max_len=6).eval(), Window(max_len=8).eval()
    with store.observe(first, "window", ObserveOptions(), "t::a"):
        first(torch.randn(2, 5, 4))
    with store.observe(other, "window", ObserveOptions(), "t::b"):
        other(torch.randn(2, 7, 4))
    groups = sorted(store.groups.values(), key=lambda g: g.sources)
    assert [(g.name.split("[")[0], g.sources) for g in groups] == [("window", ["t::a"]), ("window", ["t::b"])]
    results = [check_model(g, settings(tmp_path / str(i))) for i, g in enumerate(groups)]
    assert [(r.verdict, r.reference) for r in results] == [("passed", "recorded")] * 2, [r.reason for r in results]


def test_a_call_the_exported_instance_cannot_run_is_unverified_not_internal(tmp_path: Path) -> None:
    store = SessionStore()
    first, other = LimitedWindow(max_len=6).eval(), LimitedWindow(max_len=8).eval()
    with store.observe(first, "window", ObserveOptions(), "t::a") as group:
        first(torch.randn(2, 5, 4))
    with store.observe(other, "window", ObserveOptions(), "t::b"):
        other(torch.randn(2, 7, 4))  # recomputed on the exported instance, which rejects it
    result = check_model(group, settings(tmp_path))
    assert (result.verdict, result.stage, result.kind) == ("failed", "verify", "unverified"), result.reason
    assert result.reason == ("call 1 from t::b was made on another instance or before the model changed, and the "
                             "exported instance cannot run it: ValueError: sequence of 7 beyond max_len=6")


class MarkedEmbeds(torch.nn.Module):
    """Finds its marker token in ``inputs_embeds`` by its own embedding of it, as Gemma-3 and
    LLaVA find their image tokens; a configured model (``config``), like transformers' ones."""

    def __init__(self) -> None:
        super().__init__()
        self.config = {"marker_token_id": 3}
        self.embed, self.head = torch.nn.Embedding(10, 8), torch.nn.Linear(8, 4)

    def forward(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        marked = (inputs_embeds == self.embed.weight[3]).all(-1)
        torch._check(marked.sum().item() > 0, lambda: "no marker token in inputs_embeds")
        return self.head(inputs_embeds) * marked.unsqueeze(-1)


def test_a_call_made_for_another_instances_weights_is_left_out_with_a_note(tmp_path: Path) -> None:
    """Each test builds its model and embeds its ids with it: the exported instance finds no
    marker in another instance's embeddings and rejects that call, which is no evidence against
    the export (same configuration, other weights)."""
    store = SessionStore()
    torch.manual_seed(0)
    first, other = MarkedEmbeds().eval(), MarkedEmbeds().eval()
    with torch.no_grad():
        with store.observe(first, "marked", ObserveOptions(), "t::a") as group:
            for batch in (2, 3):
                first(first.embed(torch.tensor([[3, 1, 2, 5]] * batch)))
        with store.observe(other, "marked", ObserveOptions(), "t::b"):
            other(other.embed(torch.tensor([[4, 3, 6, 7, 1]])))
    result = check_model(group, settings(tmp_path))
    assert result.verdict == "passed", result.reason
    assert result.graphs[0].calls == [0, 1]
    assert result.model_notes == [
        "call 2 from t::b left out: made on another instance, whose weights its inputs were made for, and the "
        "exported instance rejects it (RuntimeError: no marker token in inputs_embeds)"]


VENDOR_MODEL = """
import torch


class CountCheck(torch.nn.Module):
    def forward(self, x, labels):
        index = (labels >= 0).nonzero()
        if index.size(0) > 0:
            return x * 2
        return x
"""


def test_a_guard_in_an_installed_packages_model_names_its_line_from_the_package_root(tmp_path: Path) -> None:
    """DeBERTa-v2's loss branches on the count of its valid labels: torch's message quotes no
    call, and the model's line is the innermost frame outside torch, shown from site-packages."""
    import importlib.util

    installed = tmp_path / "site-packages" / "vendor_counts.py"  # as transformers' modeling files are
    installed.parent.mkdir()
    installed.write_text(VENDOR_MODEL)
    spec = importlib.util.spec_from_file_location("vendor_counts", installed)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    group = observed(module.CountCheck(), (torch.randn(2, 3), torch.tensor([1, -2])),
                     (torch.randn(3, 3), torch.tensor([0, 1, 2])))
    result = check_model(group, settings(tmp_path / "export"))
    assert (result.verdict, result.stage) == ("failed", "torch.export")
    assert result.reason.endswith("(at vendor_counts.py:8: if index.size(0) > 0:)"), result.reason


class ImageTokens(torch.nn.Module):
    """Puts each row's image features at its image token (id 7), as VLMs do; a row without
    exactly one image token is rejected, as Gemma-3 rejects ids that do not match its images."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.vision, self.head = torch.nn.Embedding(10, 8), torch.nn.Linear(12, 8), torch.nn.Linear(8, 3)

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor) -> torch.Tensor:
        marked = input_ids == 7
        torch._check(marked.sum().item() == pixel_values.shape[0], lambda: "image tokens do not match the images")
        embeds = self.embed(input_ids).masked_scatter(marked.unsqueeze(-1).expand(-1, -1, 8), self.vision(pixel_values))
        return self.head(embeds)


def test_a_batch_of_one_whose_synthesized_inputs_eager_rejects_is_traced_at_two_repeated_rows(
        tmp_path: Path) -> None:
    """Every test sends one image: synthesized ids hold no image token where the pixel values
    need one, so the example is the recorded call with its row repeated, and the ONNX serves
    batches of three."""
    from pytest_exportobs.engine.verify.runtimes import OnnxRunner

    def row(length: int, at: int) -> list[int]:
        return [7 if i == at else 1 + i % 6 for i in range(length)]

    torch.manual_seed(0)
    model = ImageTokens().eval()
    group = observed(model, (torch.tensor([row(5, 2)]), torch.randn(1, 12)),
                     (torch.tensor([row(7, 0)]), torch.randn(1, 12)))
    result = check_model(group, settings(tmp_path))
    assert result.verdict == "passed", result.reason
    assert result.dims == {"input_ids": {"0": "batch", "1": "seq"}, "pixel_values": {"0": "batch"}}
    assert "synthesized inputs rejected by eager as an example (RuntimeError)" in result.notes
    assert ("no recorded call has every dynamic size >= 2: exported on call 0 with its batch of one repeated "
            "to two rows") in result.notes
    assert not any(note.startswith("batch kept static") for note in result.notes)  # the probe repeats rows too
    unseen = (torch.tensor([row(6, 1), row(6, 5), row(6, 3)]), torch.randn(3, 12))
    with torch.no_grad():
        expected = model(*unseen)
    torch.testing.assert_close(torch.from_numpy(OnnxRunner(Path(result.onnx_path))(list(unseen))[0]), expected)


class MaskedTokenLoss(torch.nn.Module):
    """A tagger whose loss keeps the logits of unpadded positions only (``logits[mask != 0]``,
    as Gemma-3's and PaliGemma's): the number of targets depends on the mask's values."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(20, 8), torch.nn.Linear(8, 5)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> tuple:
        logits = self.logits(input_ids, attention_mask)
        kept = logits[attention_mask != 0].contiguous().view(-1, 5)
        return torch.nn.functional.cross_entropy(kept, labels[attention_mask != 0].view(-1)), logits

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids))


class FirstTokenMutedLoss(MaskedTokenLoss):
    """The same loss over logits whose first position is written in place (a write into a view,
    which only torch.onnx's decomposition takes: the program is decomposed, not translated as
    traced)."""

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        logits = super().logits(input_ids, attention_mask) * 1
        logits[:, 0] = 0
        return logits


@pytest.mark.parametrize("model_class", [MaskedTokenLoss, FirstTokenMutedLoss])
def test_a_loss_over_a_data_dependent_number_of_targets_exports_and_serves_unseen_padding(
    tmp_path: Path, model_class: type[MaskedTokenLoss],
) -> None:
    """torch's own decomposition of the loss guards on the number of targets (``Eq(5*u0, 0)``);
    translated as traced, the loss is torchlib's; decomposed, the engine decomposes it without
    that guard (a note says so); either way the ONNX computes eager's loss."""
    from pytest_exportobs.engine.verify.runtimes import OnnxRunner

    def batch(rows: int, seq: int, real: list[int]) -> tuple[torch.Tensor, ...]:
        mask = torch.tensor([[1] * n + [0] * (seq - n) for n in real])
        return torch.randint(1, 20, (rows, seq)), mask, torch.randint(0, 5, (rows, seq))

    torch.manual_seed(0)
    model = model_class().eval()
    result = check_model(observed(model, batch(2, 6, [6, 4]), batch(3, 5, [2, 5, 3])), settings(tmp_path))
    assert result.verdict == "passed", result.reason
    note = "cross_entropy_loss decomposed into _log_softmax and nll_loss_forward"
    assert (note in " ".join(result.notes)) == (model_class is FirstTokenMutedLoss)
    unseen = batch(4, 9, [9, 1, 5, 7])
    with torch.no_grad():
        expected = model(*unseen)[0]
    got = torch.from_numpy(OnnxRunner(Path(result.onnx_path))(list(unseen))[0])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


class Tagger(torch.nn.Module):
    """A frame tagger over sequences of any length: an LSTM."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.lstm, self.head = torch.nn.LSTM(8, hidden, batch_first=True), torch.nn.Linear(hidden, 3)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(frames)[0])


@pytest.mark.slow
def test_two_lstm_models_in_one_process_both_keep_their_sequence_dynamic(tmp_path: Path) -> None:
    for hidden in (16, 24):  # torch 2.13 specialized the second one's sequence (dispatch cache left behind)
        group = observed(Tagger(hidden).eval(), (torch.randn(2, 32, 8),), (torch.randn(3, 20, 8),))
        result = check_model(group, settings(tmp_path))
        assert result.verdict == "passed", result.reason
        assert result.dims == {"frames": {"0": "batch", "1": "seq"}}


class PatchEmbeddings(torch.nn.Module):
    """As DINOv2 does: at the config's image size the position table is used as is, at any other
    size it is interpolated (the 32x32 call alone makes torch pin height and width to 32)."""

    def __init__(self, image_size: int = 32, patch: int = 8) -> None:
        super().__init__()
        self.image_size, self.patch = image_size, patch
        self.proj = torch.nn.Conv2d(3, 16, patch, stride=patch)
        self.positions = torch.nn.Parameter(torch.randn(1, 16, image_size // patch, image_size // patch))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.proj(pixel_values)
        height, width = pixel_values.shape[-2:]
        if height == self.image_size and width == self.image_size:
            positions = self.positions
        else:
            positions = torch.nn.functional.interpolate(self.positions, size=patches.shape[-2:], mode="bicubic")
        return (patches + positions).flatten(2).transpose(1, 2)


def test_a_dim_pinned_at_a_size_the_model_treats_specially_is_traced_again_elsewhere(tmp_path: Path) -> None:
    torch.manual_seed(0)
    group = observed(PatchEmbeddings().eval(), (torch.randn(2, 3, 32, 32),), (torch.randn(2, 3, 48, 48),))
    result = check_model(group, CheckSettings(export_dir=tmp_path, examples=4))
    assert result.verdict == "passed", result.reason
    assert result.dims == {"pixel_values": {"0": "batch", "2": "height", "3": "width"}}
    assert any(note.startswith("traced on call 1: on the first example torch pinned height") for note in result.notes)


def test_a_dim_pinned_at_the_only_size_tested_is_traced_again_on_synthesized_inputs(tmp_path: Path) -> None:
    torch.manual_seed(0)
    group = observed(PatchEmbeddings().eval(), (torch.randn(2, 3, 32, 32),), (torch.randn(3, 3, 32, 32),),
                     dynamic=("pixel_values:2", "pixel_values:3"))  # the user declares the sides dynamic
    result = check_model(group, CheckSettings(export_dir=tmp_path, examples=4))
    assert result.verdict == "passed", result.reason
    assert result.dims == {"pixel_values": {"0": "batch", "2": "height", "3": "width"}}
    assert any(note.startswith("traced on inputs synthesized at height=48: on the first example torch pinned height")
               for note in result.notes), result.notes


class SpanLoss(torch.nn.Module):
    """BERT's question-answering loss: ``ignore_index`` is the sequence length, a symbolic size in
    the export, which torchlib's translation of ``cross_entropy_loss`` cannot take."""

    def __init__(self) -> None:
        super().__init__()
        self.qa = torch.nn.Linear(8, 2)

    def forward(self, hidden: torch.Tensor, start_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start, _ = self.qa(hidden).unbind(-1)
        ignored = start.size(1)
        loss = torch.nn.functional.cross_entropy(start, start_positions.clamp(0, ignored), ignore_index=ignored)
        return loss, start


@pytest.mark.slow
def test_an_op_whose_translation_fails_is_decomposed_and_translated_again(tmp_path: Path) -> None:
    torch.manual_seed(0)
    calls = [(torch.randn(3, 7, 8), torch.tensor([1, 7, 3])), (torch.randn(2, 5, 8), torch.tensor([4, 0]))]
    result = check_model(observed(SpanLoss().eval(), *calls), CheckSettings(export_dir=tmp_path, examples=4))
    assert result.verdict == "passed", result.reason
    assert result.dims == {"hidden": {"0": "batch", "1": "seq"}, "start_positions": {"0": "batch"}}
    # taken as traced, torchlib's cross_entropy_loss fails on the symbolic ignore_index: decomposed alone, the
    # rest of the program kept as traced (no second trace of the model)
    assert not any(n.startswith("translated after torch.onnx's decomposition") for n in result.notes), result.notes
    decomposed = any(n.startswith("translated after decomposing aten.cross_entropy_loss.default") for n in result.notes)
    assert decomposed or torch.__version__ >= "2.14", result.notes  # torch 2.14 on translates it as it is


class Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: int = 1) -> torch.Tensor:
        return self.proj(x) * scale


def test_more_structures_than_the_old_cap_each_get_their_graph(tmp_path: Path) -> None:
    store = SessionStore()
    module = Scaled().eval()
    with store.observe(module, "scaled", ObserveOptions(store_n_calls=10), "t") as group:
        for scale in range(2, 10):  # eight constants, eight graphs (the cap was 6: two calls left unverified)
            module(torch.randn(scale, 4), scale=scale)
    result = check_model(group, settings(tmp_path, targets=(Target.TORCH,)))
    assert result.verdict == "passed", result.reason
    assert sorted(g.constants["scale"] for g in result.graphs) == list(range(2, 10))


def test_rows_of_padded_queries_after_a_cache_are_the_masks_last_positions() -> None:
    mask = torch.tensor([[0, 0, 0, 1, 1], [1, 1, 1, 1, 1]])  # 2 cached positions, then 3 new queries
    reference = torch.randn(2, 3, 8)
    garbage_at_padding = reference.clone()
    garbage_at_padding[0, 0] += 0.7  # the first new query is padding
    found = compare([garbage_at_padding], [reference], Tolerance(), padding=mask)
    assert (found.ok, found.n_padded) == (True, 8)
    garbage_at_padding[0, 1] += 0.7  # a real query
    assert compare([garbage_at_padding], [reference], Tolerance(), padding=mask).n_beyond == 8


def test_a_batch_element_a_mask_leaves_attending_to_nothing_is_not_evidence() -> None:
    encoder_mask = torch.tensor([[1, 0, 1], [0, 0, 0], [1, 1, 1]])  # random test masks: row 1 masks everything
    reference = torch.randn(3, 4, 8)
    arbitrary = reference.clone()
    arbitrary[1] += 0.5  # cross-attention over no key: arbitrary in eager and ONNX alike
    found = compare([arbitrary], [reference], Tolerance(), empty_rows=(encoder_mask == 0).all(1))
    assert (found.ok, found.n_padded) == (True, 32)
    arbitrary[2, 0, 0] += 0.5
    assert compare([arbitrary], [reference], Tolerance(), empty_rows=(encoder_mask == 0).all(1)).n_beyond == 1


class Patches(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 4, stride=4)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.conv(pixel_values).flatten(2)


def test_a_bfloat16_conv_onnxruntime_types_out_is_run_widened_to_float32(tmp_path: Path) -> None:
    model = Patches().to(torch.bfloat16).eval()
    result = check_model(observed(model, (torch.randn(2, 3, 16, 16, dtype=torch.bfloat16),)), settings(tmp_path))
    assert (result.verdict, result.runtimes) == ("passed", ["onnxruntime-float32"]), result.reason
    assert any(n.startswith("run by onnxruntime in float32, each op's outputs rounded to their half-precision type (as "
                            "a half-precision kernel computes): onnxruntime's CPUExecutionProvider has no kernel for "
                            "Conv (node ") and "at the graph's opset in bfloat16" in n for n in result.notes)


def test_decoder_outputs_of_an_encoder_decoder_read_the_decoder_mask() -> None:
    encoder_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1]])
    decoder_mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])  # the decoder side is padded
    decoder_states, encoder_states = torch.randn(2, 4, 8), torch.randn(2, 4, 8)
    garbage = decoder_states.clone()
    garbage[0, 0] += 0.7
    found = compare([garbage, encoder_states], [decoder_states, encoder_states], Tolerance(),
                    names=["last_hidden_state", "encoder_last_hidden_state"], padding=encoder_mask,
                    decoder_padding=decoder_mask)
    assert (found.ok, found.n_padded) == (True, 8)
    wrong_encoder = encoder_states.clone()
    wrong_encoder[0, 0] += 0.7  # the encoder side is not padded: a real mismatch
    found = compare([decoder_states, wrong_encoder], [decoder_states, encoder_states], Tolerance(),
                    names=["last_hidden_state", "encoder_last_hidden_state"], padding=encoder_mask,
                    decoder_padding=decoder_mask)
    assert (found.ok, found.n_beyond) == (False, 8)


def test_eager_outputs_holding_none_compare_with_each_other() -> None:
    logits = torch.randn(2, 3)
    assert compare([None, logits], [None, logits.clone()], Tolerance()).ok  # two eager runs of a model without loss


class PositionTable(torch.nn.Module):
    """Learned positions for at most 16 tokens: torch bounds seq <= 16, and so does eager."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.table[: x.shape[1]]


class ShortPathBranch(torch.nn.Module):
    """Another computation past 8 tokens: torch bounds seq <= 8 though eager runs 9."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] > 8:
            return x.flip(1)
        return x * 2


def test_a_bound_eager_cannot_pass_is_the_models_limit_and_the_onnx_serves_up_to_it(tmp_path: Path) -> None:
    from pytest_exportobs.engine.verify.runtimes import OnnxRunner

    model = PositionTable()
    result = check_model(observed(model, (torch.randn(2, 5, 8),), (torch.randn(3, 9, 8),)), settings(tmp_path))
    assert result.verdict == "passed", result.reason
    assert result.dims == {"x": {"0": "batch", "1": "seq"}}
    x = torch.randn(4, 16, 8)
    torch.testing.assert_close(torch.from_numpy(OnnxRunner(Path(result.onnx_path))([x])[0]), model(x).detach())


def test_a_bound_below_a_size_eager_runs_fails_as_specialized(tmp_path: Path) -> None:
    result = check_model(observed(ShortPathBranch(), (torch.randn(2, 3),), (torch.randn(3, 5),)), settings(tmp_path))
    assert (result.verdict, result.stage, result.kind) == ("failed", "torch.export", "specialized")
    line = next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1) if "if x.shape[1] > 8" in text)
    assert result.reason == (
        "x_dim1 (x.1, the tests vary it) bounded to at most 8 (eager runs x_dim1=9) by torch.export"
        f" at tests/unit/test_check.py:{line}: if x.shape[1] > 8:")


@pytest.mark.slow
def test_a_sliding_window_the_tests_never_fill_gets_a_length_of_its_own_and_the_onnx_serves_it_full(
        tmp_path: Path) -> None:
    """Gemma-2 under generate(), prompts and outputs shorter than its window of 16: every call's
    layers hold one length, torch bounds it to 15, and one more decode step holds the sliding
    layer at 15 while the full one goes on.  The sliding layer's length is a variable of its own,
    and the ONNX serves caches past the window, which no test made (an export cache hit too)."""
    transformers = pytest.importorskip("transformers")
    from pytest_exportobs import register_flattening_functions
    from pytest_exportobs.engine.verify.runtimes import OnnxRunner

    torch.manual_seed(0)
    config = transformers.Gemma2Config(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, sliding_window=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    model = transformers.Gemma2ForCausalLM(config).eval()
    store = SessionStore()
    with register_flattening_functions(), store.observe(model, "gemma2", ObserveOptions(), "t") as group:
        for batch, prompt, new in ((1, 5, 3), (2, 7, 4)):
            ids = torch.randint(3, 64, (batch, prompt))
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False)
    first, again = (check_model(group, settings(tmp_path)) for _ in range(2))
    assert first.verdict == "passed", first.reason
    sliding, full = {"0": "batch", "2": "past_seq_window"}, {"0": "batch", "2": "past_seq"}
    cache = models.cache_argument()
    assert {name: axes for name, axes in first.dims.items() if name.startswith(cache)} == {
        f"{cache}.key_0": sliding, f"{cache}.value_0": sliding, f"{cache}.key_1": full, f"{cache}.value_1": full}
    assert any(note.startswith(f"past_seq_window ({cache}.key_0.2, {cache}.value_0.2) a length apart")
               for note in first.notes)
    assert (again.verdict, again.cache_hit, again.dims) == ("passed", True, first.dims)

    runner = OnnxRunner(Path(first.onnx_path))
    assert first.graphs[0].inputs[:2] == ["input_ids", "position_ids"]
    for batch, prompt in ((3, 20), (2, 9)):
        with torch.no_grad(), register_flattening_functions():
            cache = getattr(model(torch.randint(3, 64, (batch, prompt)), use_cache=True), models.cache_argument())
            assert [layer.keys.shape[2] for layer in cache.layers] == [min(prompt, 15), prompt]
            step, positions = torch.randint(3, 64, (batch, 1)), torch.full((batch, 1), prompt)
            leaves = [step, positions, *torch.utils._pytree.tree_leaves(cache)]
            expected = model(step, position_ids=positions, **{models.cache_argument(): cache}).logits
        torch.testing.assert_close(torch.from_numpy(runner(leaves)[0]), expected, atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_a_llava_prefill_keeps_its_image_batch_dynamic_and_serves_unseen_batches(tmp_path: Path) -> None:
    """LLaVA makes its image features a Python list (one entry per image) and checks the image
    token count with a tensor condition: export_patches keep the batch dynamic, and the check's
    leftover nodes are dropped before the ONNX translation."""
    transformers = pytest.importorskip("transformers")
    from pytest_exportobs.engine.verify.runtimes import OnnxRunner

    torch.manual_seed(0)
    vision = transformers.CLIPVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=8)
    text = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, pad_token_id=0)
    config = transformers.LlavaConfig(
        vision_config=vision, text_config=text, image_token_id=60, vision_feature_layer=-1)
    model = transformers.LlavaForConditionalGeneration(config).eval()

    def inputs(batch: int, words: int) -> dict[str, torch.Tensor]:
        ids = torch.cat(
            [torch.randint(3, 60, (batch, 1)), torch.full((batch, 4), 60), torch.randint(3, 60, (batch, words))], 1)
        return dict(input_ids=ids, pixel_values=torch.randn(batch, 3, 16, 16), attention_mask=torch.ones_like(ids))

    store = SessionStore()
    with store.observe(model, "llava", ObserveOptions(), "t") as group:
        for batch, words in ((1, 5), (2, 7), (3, 6)):
            model(**inputs(batch, words))
    result = check_model(group, settings(tmp_path))
    if models.cache_argument() == "cache":  # transformers 5.24 returns the image features as a list, one per image
        assert (result.verdict, result.kind) == ("failed", "outputs")
        assert "the export patch batched_image_features changes what the model computes" in result.reason
        return
    assert result.verdict == "passed", result.reason
    assert result.dims == {"input_ids": {"0": "batch", "1": "seq"}, "pixel_values": {"0": "batch"},
                           "attention_mask": {"0": "batch", "1": "seq"}}
    runner = OnnxRunner(Path(result.onnx_path))
    for batch, words in ((4, 9), (5, 2)):
        unseen = inputs(batch, words)
        with torch.no_grad():
            expected = model(**unseen).logits
        got = torch.from_numpy(runner(list(unseen.values()))[0])
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


class WaveformClassifier(torch.nn.Module):
    """Strided convolutions over raw audio, pooled over time: any length from a few hundred samples."""

    def __init__(self) -> None:
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv1d(1, 8, kernel_size=80, stride=16), torch.nn.ReLU(),
            torch.nn.Conv1d(8, 8, kernel_size=3), torch.nn.ReLU(), torch.nn.MaxPool1d(4),
            torch.nn.Conv1d(8, 8, kernel_size=3), torch.nn.ReLU(),
        )
        self.head = torch.nn.Linear(8, 4)

    def forward(self, waveform: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(waveform.unsqueeze(1)).mean(-1))


def test_a_dim_named_dims_pin_but_unnamed_ones_keep_is_exported_dynamic(tmp_path: Path) -> None:
    """With a named length torch solves its conv guards for the example's 4000 samples; with
    Dim.DYNAMIC it keeps a range: the length stays dynamic and the ONNX serves lengths never tested."""
    from pytest_exportobs.engine.verify.runtimes import OnnxRunner

    model = WaveformClassifier().eval()
    calls = [(torch.randn(2, 4000),), (torch.randn(3, 8000),), (torch.randn(1, 16000),)]
    result = check_model(observed(model, *calls), settings(tmp_path))
    assert result.verdict == "passed", result.reason
    assert result.dims == {"waveform": {"0": "batch", "1": "waveform_dim1"}}
    assert "exported with Dim.DYNAMIC dims: with named dims, waveform_dim1 was specialized to 4000" in result.notes
    runner = OnnxRunner(Path(result.onnx_path))
    for shape in ((1, 3001), (5, 6000), (2, 12345)):
        x = torch.randn(*shape)
        torch.testing.assert_close(torch.from_numpy(runner([x])[0]), model(x).detach(), atol=1e-5, rtol=1e-4)


def test_a_batch_of_one_model_is_checked_in_process_with_the_threads_of_the_unused_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--export-jobs auto`` (the default) on 2 cores with one model left: no fork, both cores."""
    from pytest_exportobs.engine import runner

    threads_seen: list[int] = []

    def counting(group: ModelGroup, check_settings: CheckSettings, *progress: Any) -> Any:
        threads_seen.append(torch.get_num_threads())
        return check_model(group, check_settings, *progress)

    monkeypatch.setattr(runner, "_start", lambda *args: pytest.fail("a batch of one model was forked"))
    monkeypatch.setattr(runner, "check_model", counting)
    group = observed(MLP().eval(), (torch.randn(2, 8),), (torch.randn(5, 8),))
    results = list(runner.check_all([group], settings(tmp_path), isolate=False, jobs=2, threads=1))
    assert [r.verdict for r in results] == ["passed"] and threads_seen == [2]


class Wider(torch.nn.Module):
    """Large enough that torch runs its copies and products in parallel regions."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(1024, 1024)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).relu()


def test_an_isolated_check_after_the_parent_ran_parallel_torch_does_not_hang(tmp_path: Path) -> None:
    """GNU OpenMP is not fork-safe: with the parent's thread team made (the tests ran models on
    several threads), a child's parallel region of more than one thread waited forever (here:
    until the time limit killed it)."""
    from pytest_exportobs.engine import runner

    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.randn(2048, 2048).clone()  # a parallel region in this process
        group = observed(Wider().eval(), (torch.randn(256, 1024),), (torch.randn(300, 1024),))
        checked = CheckSettings(export_dir=tmp_path, examples=0, timeout=60)
        (result,) = runner.check_all([group], checked, isolate=True, threads=2)
    finally:
        torch.set_num_threads(previous)
    assert (result.verdict, result.kind) == ("passed", None), result.reason


def test_forked_checks_settle_groups_with_nothing_to_export_in_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A model called on the meta device (timm's tests build models there) gets its verdict
    without a process of its own; the two models left are checked as any batch of two."""
    from pytest_exportobs.engine import runner

    forked: list[str] = []
    monkeypatch.setattr(runner, "_forked",
                        lambda queue, *rest: forked.extend(g.name for g, _ in queue.checks) or iter(()))
    monkeypatch.setattr(runner, "prepare", lambda *args: None)
    on_meta = observed(MLP().to("meta"), (torch.randn(2, 8, device="meta"),), name="on_meta")
    checked = [observed(MLP().eval(), (torch.randn(2, 8),), name=f"mlp{i}") for i in range(2)]
    lines: list[str] = []
    results = list(runner.check_all([checked[0], on_meta, checked[1]], settings(tmp_path), isolate=False, jobs=2,
                                    progress=lines.append))
    assert [(r.name, r.verdict, r.stage) for r in results] == [("on_meta", "skipped", "observe")]
    assert lines == [f"exportobs [1/3] on_meta: skipped in {lines[0].split(' in ')[1]}"]
    assert sorted(forked) == ["mlp0", "mlp1"]


class _Scaled(torch.nn.Module):
    """An MLP whose output a keyword constant scales."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP()

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.mlp(x) * scale


def test_forked_checks_begin_with_the_most_expensive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Expected cost: the combinations of keyword constants (graphs) times the modules (ops)."""
    from pytest_exportobs.engine import placement, runner

    store = SessionStore()
    with store.observe(scaled := _Scaled().eval(), "scaled", ObserveOptions(), "test_check.py::test") as two_graphs:
        scaled(torch.randn(2, 8), scale=2.0)
        scaled(torch.randn(3, 8), scale=3.0)
        scaled(torch.randn(4, 8), scale=3.0)
    small = observed(MLP().eval(), (torch.randn(2, 8),), name="small")
    larger = observed(_Scaled().eval(), (torch.randn(2, 8),), name="larger")
    assert [placement.expected_cost(g) for g in (small, larger, two_graphs)] == [3, 4, 8]
    started: list[str] = []
    monkeypatch.setattr(runner, "_forked",
                        lambda queue, *rest: started.extend(g.name for g, _ in queue.checks) or iter(()))
    monkeypatch.setattr(runner, "prepare", lambda *args: None)
    assert list(runner.check_all([small, two_graphs, larger], settings(tmp_path), isolate=False, jobs=2)) == []
    assert started == ["scaled", "larger", "small"]


def test_checks_the_export_cache_served_last_time_run_in_process_and_others_are_forked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rerun: each check's seconds were recorded under what it depends on; the ones served by
    the cache run in the session's process (a fork costs more than they do), a model whose calls
    changed has no record and is forked, as is one whose weights are above the in-process bound."""
    from pytest_exportobs.engine import placement, runner

    def groups(third_batch: int) -> list[ModelGroup]:
        return [observed(MLP().eval(), (torch.randn(2, 8),), (torch.randn(5, 8),), name="mlp0"),
                observed(_Scaled().eval(), (torch.randn(2, 8),), (torch.randn(3, 8),), name="scaled"),
                observed(MLP().eval(), (torch.randn(2, 8),), (torch.randn(third_batch, 8),), name="mlp1")]

    checked = settings(tmp_path)
    first = list(runner.check_all(groups(4), checked, isolate=False, jobs=2))  # forked: nothing recorded yet
    assert sorted((r.name, r.verdict) for r in first) == [("mlp0", "passed"), ("mlp1", "passed"), ("scaled", "passed")]
    assert len(list(checked.cache_dir.glob("check-*.json"))) == 3
    forked: list[str] = []
    monkeypatch.setattr(runner, "_forked",
                        lambda queue, *rest: forked.extend(g.name for g, _ in queue.checks) or iter(()))
    monkeypatch.setattr(runner, "prepare", lambda *args: None)
    lines: list[str] = []
    rerun = list(runner.check_all(groups(4), checked, isolate=False, jobs=2, progress=lines.append))
    assert forked == [] and [(r.name, r.verdict) for r in rerun] == [("mlp0", "passed"), ("scaled", "passed"),
                                                                        ("mlp1", "passed")]
    assert all("export cache hit: torch.export and translation skipped" in r.notes for r in rerun)
    assert [line.split(": ")[0] for line in lines if " in " in line] == [
        "exportobs [1/3] mlp0", "exportobs [2/3] scaled", "exportobs [3/3] mlp1"]
    changed = list(runner.check_all(groups(6), checked, isolate=False, jobs=2))  # mlp1 called at another size
    assert forked == ["mlp1"] and changed == []  # forked (here: by the stand-in) beside the two in process
    forked.clear()
    monkeypatch.setattr(placement, "IN_PROCESS_BYTES", 0)
    in_process = list(runner.check_all(groups(4), checked, isolate=False, jobs=2))
    assert sorted(forked) == ["mlp0", "mlp1", "scaled"] and in_process == []
    forked.clear()
    isolated = list(runner.check_all(groups(4), checked, isolate=True, jobs=1))
    assert sorted(forked) == ["mlp0", "mlp1", "scaled"] and isolated == []
    # what an early check (--export-overlap) takes on: the checks the cache has no record of
    early = list(runner.check_all(groups(7), checked, isolate=False, jobs=1, unrecorded_only=True))
    assert [(r.name, r.verdict) for r in early] == [("mlp1", "passed")]


def _placed_by_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[ModelGroup], CheckSettings]:
    """Three models checked once (each check's seconds recorded): on a rerun, the one whose
    weights are above the in-process bound is forked, the two others checked in process."""
    from pytest_exportobs.engine import placement, runner

    def groups() -> list[ModelGroup]:
        return [observed(Wider().eval(), (torch.randn(2, 1024),), (torch.randn(3, 1024),), name="wider"),
                *(observed(MLP().eval(), (torch.randn(2, 8),), (torch.randn(5, 8),), name=f"mlp{i}") for i in range(2))]

    checked = settings(tmp_path)
    assert [r.verdict for r in runner.check_all(groups(), checked, isolate=False, jobs=2)] == ["passed"] * 3
    monkeypatch.setattr(placement, "IN_PROCESS_BYTES", 1 << 20)  # Wider's weights: 4 MB, an MLP's: 1 kB
    return groups(), checked


def test_checks_in_process_run_beside_the_forked_ones_on_the_cores_they_leave(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rerun's large model checked in a child while the small ones are checked in process:
    with one child running, the session's process takes one job's threads, all once it ends."""
    from pytest_exportobs.engine import runner

    groups, checked = _placed_by_size(tmp_path, monkeypatch)
    parent, started = os.getpid(), []
    threads_seen: dict[str, int] = {}
    start = runner._start

    def counting(group: ModelGroup, check_settings: CheckSettings, *progress: Any) -> Any:
        if os.getpid() == parent:
            threads_seen[group.name] = torch.get_num_threads()
        return check_model(group, check_settings, *progress)

    monkeypatch.setattr(runner, "check_model", counting)
    monkeypatch.setattr(runner, "_start", lambda queue, first, *rest: started.append(queue.checks[first][0].name)
                        or start(queue, first, *rest))
    previous = torch.get_num_threads()
    results = list(runner.check_all(groups, checked, isolate=False, jobs=2, threads=2))
    assert sorted((r.name, r.verdict) for r in results) == [("mlp0", "passed"), ("mlp1", "passed"),
                                                             ("wider", "passed")]
    assert started == ["wider"] and set(threads_seen) == {"mlp0", "mlp1"}
    assert threads_seen["mlp0"] == 2  # the first in process begins as the child does: 2 of the 4 threads
    assert torch.get_num_threads() == previous


def test_checks_in_process_go_on_after_the_forked_ones_ended(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The forked check ends (and is reaped) while the first check in process runs: the second
    one runs, and the checks end, without a child to wait for."""
    from pytest_exportobs.engine import runner

    groups, checked = _placed_by_size(tmp_path, monkeypatch)
    parent, children = os.getpid(), []
    start = runner._start

    def started(*args: Any) -> Any:
        children.append(child := start(*args))
        return child

    def waiting_for_the_child(group: ModelGroup, check_settings: CheckSettings, *progress: Any) -> Any:
        if os.getpid() == parent and group.name == "mlp0":
            children[0].process.join(60)
        return check_model(group, check_settings, *progress)

    monkeypatch.setattr(runner, "_start", started)
    monkeypatch.setattr(runner, "check_model", waiting_for_the_child)
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("the checks did not end"))
    signal.alarm(60)
    try:
        results = list(runner.check_all(groups, checked, isolate=False, jobs=2))
    finally:
        signal.alarm(0)
    assert [(r.name, r.verdict) for r in results] == [("mlp0", "passed"), ("wider", "passed"), ("mlp1", "passed")]


def test_the_job_of_the_last_check_in_process_goes_back_to_the_children_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rerun with one check the export cache serves, in process, and two changed models of one
    family, forked: once the check in process ends, a second child starts for the second model,
    while the first child still checks its first (which waits here for the second to begin).
    Waiting for the first child to end would leave a core idle while it checks its family's
    models one after the other."""
    from pytest_exportobs.engine import runner

    def groups(batch: int) -> list[ModelGroup]:
        return [observed(MLP().eval(), (torch.randn(2, 8),), (torch.randn(5, 8),), name="served"),
                *(observed(MLP().eval(), (torch.randn(2, 8),), (torch.randn(batch, 8),), name=f"changed{i}")
                  for i in range(2))]

    checked = settings(tmp_path)
    assert [r.verdict for r in runner.check_all(groups(4), checked, isolate=False, jobs=2)] == ["passed"] * 3
    second_began = tmp_path / "second began"

    def checking(group: ModelGroup, check_settings: CheckSettings, *progress: Any) -> Any:
        if group.name == "changed1":
            second_began.touch()
        deadline = time.monotonic() + 30
        while group.name == "changed0" and not second_began.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return _with_pid(check_model(group, check_settings, *progress))

    monkeypatch.setattr(runner, "check_model", checking)
    began = time.monotonic()
    results = {r.name: r for r in runner.check_all(groups(6), checked, isolate=False, jobs=2)}
    assert {name: r.verdict for name, r in results.items()} == {"served": "passed", "changed0": "passed",
                                                                "changed1": "passed"}
    pids = {name: _pid(r) for name, r in results.items()}
    assert pids["served"] == os.getpid() and len({*pids.values()}) == 3
    assert time.monotonic() - began < 30


def test_a_forked_helper_shares_the_checks_in_process_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rerun of ten small models the export cache serves: one forked helper and this process
    (on the job left to it) take them in turn from one queue, each model checked once."""
    from pytest_exportobs.engine import runner

    def groups() -> list[ModelGroup]:
        return [observed(MLP().eval(), (torch.randn(2, 8),), (torch.randn(5, 8),), name=f"mlp{i}") for i in range(10)]

    checked = settings(tmp_path)
    assert [r.verdict for r in runner.check_all(groups(), checked, isolate=False, jobs=2)] == ["passed"] * 10
    parent, forks, threads_here = os.getpid(), [], []
    start = runner._start

    def counting(group: ModelGroup, check_settings: CheckSettings, *progress: Any) -> Any:
        if os.getpid() == parent:
            threads_here.append(torch.get_num_threads())
        return _with_pid(check_model(group, check_settings, *progress))

    monkeypatch.setattr(runner, "_start", lambda queue, first, *rest: forks.append(queue.checks[first][0].name)
                        or start(queue, first, *rest))
    monkeypatch.setattr(runner, "check_model", counting)
    lines: list[str] = []
    results = list(runner.check_all(groups(), checked, isolate=False, jobs=2, threads=1, progress=lines.append))
    assert sorted((r.name, r.verdict) for r in results) == [(f"mlp{i}", "passed") for i in range(10)]
    assert all("export cache hit: torch.export and translation skipped" in r.notes for r in results)
    helper = {r.name for r in results if _pid(r) != parent}
    assert forks == ["mlp0"] and "mlp0" in helper and threads_here[0] == 1  # the helper takes the first
    assert len(threads_here) == 10 - len(helper) and {_pid(r) for r in results if r.name in helper} != {parent}
    assert sorted(line.split(": ")[0] for line in lines if " passed in " in line) == sorted(
        f"exportobs [{i + 1}/10] mlp{i}" for i in range(10))


def _with_pid(result: ModelResult) -> ModelResult:
    """``result`` noting the process that checked it."""
    result.model_notes.append(f"pid {os.getpid()}")
    return result


def _pid(result: ModelResult) -> int:
    return next(int(note.split()[1]) for note in result.notes if note.startswith("pid "))


def test_ctrl_c_in_a_check_in_process_kills_the_forked_ones_beside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pytest_exportobs.engine import runner

    groups, checked = _placed_by_size(tmp_path, monkeypatch)
    parent = os.getpid()

    def interrupting(group: ModelGroup, check_settings: CheckSettings, *progress: Any) -> Any:
        if os.getpid() == parent:
            raise KeyboardInterrupt
        time.sleep(30)  # the child: still running when the session is interrupted
        return check_model(group, check_settings, *progress)

    monkeypatch.setattr(runner, "check_model", interrupting)
    begin = time.monotonic()
    results = list(runner.check_all(groups, checked, isolate=False, jobs=2))
    assert time.monotonic() - begin < 20
    assert [(r.name, r.verdict, r.reason) for r in results] == [
        ("wider", "interrupted", "interrupted (Ctrl-C) during infer"),
        ("mlp0", "interrupted", "interrupted (Ctrl-C) during infer"),
        ("mlp1", "interrupted", "interrupted (Ctrl-C) before its check began"),
    ]


def test_a_check_key_changes_with_the_calls_structure_and_the_settings_not_the_weights(tmp_path: Path) -> None:
    """What places a check is known before it: the module's code and shapes, its calls' structure
    (not their values), the settings that change what the check does (not the time limit)."""
    from pytest_exportobs.engine.placement import CheckCosts

    def key(group: ModelGroup, **kwargs: Any) -> str | None:
        return CheckCosts([group], settings(tmp_path, **kwargs)).keys[id(group)]

    base = key(observed(MLP().eval(), (torch.randn(2, 8),), (torch.randn(5, 8),)))
    assert base is not None
    reseeded = MLP().eval()
    torch.nn.init.normal_(reseeded.l1.weight)
    assert key(observed(reseeded, (torch.randn(2, 8),), (torch.randn(5, 8),))) == base
    assert key(observed(MLP().eval(), (torch.randn(2, 8),), (torch.randn(5, 8),)), timeout=30) == base
    assert key(observed(MLP().eval(), (torch.randn(2, 8),), (torch.randn(6, 8),))) != base
    assert key(observed(MLP().eval(), (torch.randn(2, 8),), (torch.randn(5, 8),)), atol=1e-3) != base
    assert key(observed(MLP().train(), (torch.randn(2, 8),), (torch.randn(5, 8),))) != base
    assert CheckCosts([], settings(tmp_path, use_cache=False)).cache is None


class FixedBatchTagger(torch.nn.Module):
    """Tags tokens, written for batches of two (a reshape to the batch it was made for)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(10, 8), torch.nn.Linear(8, 3)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids).reshape(2, -1, 8))


def test_a_rerun_takes_the_dims_eager_rejects_from_the_export_cache_and_other_calls_probe_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pytest_exportobs.engine.export import probe

    probed: list[int] = []
    original = probe.probe_unvaried_dims
    monkeypatch.setattr(probe, "probe_unvaried_dims", lambda *args: probed.append(1) or original(*args))
    model = FixedBatchTagger().eval()
    calls = [(torch.randint(0, 10, (2, 5)),), (torch.randint(0, 10, (2, 7)),)]
    first = check_model(observed(model, *calls), settings(tmp_path))
    assert (first.verdict, first.dims, len(probed)) == ("passed", {"input_ids": {"1": "seq"}}, 1), first.reason
    (kept,) = [n for n in first.notes if n.startswith("batch kept static: eager rejects batch=3")]
    rerun = check_model(observed(model, *calls), settings(tmp_path))
    assert (rerun.verdict, rerun.dims, len(probed)) == ("passed", first.dims, 1)
    assert kept in rerun.notes and "export cache hit: torch.export and translation skipped" in rerun.notes
    longer = [(torch.randint(0, 10, (2, 5)),), (torch.randint(0, 10, (2, 9)),)]
    other = check_model(observed(model, *longer), settings(tmp_path))
    assert (other.verdict, other.dims, len(probed)) == ("passed", first.dims, 2)


def test_a_first_check_expects_its_rerun_without_the_stages_the_cache_serves() -> None:
    """The first rerun after a first run is placed as a rerun: what the export, decomposition,
    translation and variations took is not expected again; a failed check's exports are served
    (kept, failed or not), its variations are not."""
    from pytest_exportobs.engine.base.result import GraphResult, ModelResult
    from pytest_exportobs.engine.placement import expected_rerun_seconds

    timings = {"torch.export": 2.0, "decompose": 3.0, "onnx-translate": 1.0, "onnx-checker": 0.1,
               "variations": 1.5, "ort-load": 0.2, "verify": 0.1}
    passed = ModelResult(name="m", verdict="passed", graphs=[GraphResult(name="", verdict="passed", timings=timings)])
    assert expected_rerun_seconds(passed, 8.0) == pytest.approx(0.4)
    failed = ModelResult(name="m", verdict="failed", graphs=[GraphResult(name="", verdict="failed", timings=timings)])
    assert expected_rerun_seconds(failed, 8.0) == pytest.approx(1.9)


def test_a_rerun_takes_the_comparisons_of_the_same_file_inputs_and_references_from_the_cache(tmp_path: Path) -> None:
    """The comparisons of an unchanged graph with unchanged calls and references are kept with
    the export cache; other weights (another file, other references) are run and compared again."""
    calls = [(torch.randn(2, 8),), (torch.randn(5, 8),)]
    results = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        results.append(check_model(observed(MLP().eval(), *calls), settings(tmp_path, use_cache=True)))
    first, rerun, reseeded = (result.graphs[0] for result in results)
    assert [r.verdict for r in results] == ["passed", "passed", "passed"]
    assert [any(n.startswith("verified as on an earlier check") for n in g.notes) for g in (first, rerun, reseeded)] \
        == [False, True, False]
    assert rerun.discrepancies == first.discrepancies and rerun.cache_hit
    assert [d["ok"] for d in reseeded.discrepancies] == [True, True]
    assert len(list((tmp_path / "cache").glob("verified-*.json"))) == 2


def test_a_rerun_does_not_run_a_graph_again_on_the_calls_it_did_not_serve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whether a graph serves another plan's calls is a comparison too: kept with the export cache
    when it fails as when it passes, a rerun runs no graph, and finds the same graphs."""
    from pytest_exportobs.engine.verify import runtimes

    runs: list[int] = []
    original = runtimes.OnnxRunner.__call__
    monkeypatch.setattr(runtimes.OnnxRunner, "__call__", lambda self, *a: runs.append(1) or original(self, *a))
    calls = [((torch.randn(2, 4),), {"return_dict": True}), ((torch.randn(3, 4),), {"return_dict": True}),
             ((torch.randn(5, 4),), {})]  # 2 * y, then y: the first graph does not serve the last call
    graphs, counted = [], []
    for _ in range(2):
        torch.manual_seed(0)
        module, store = KeywordConstants(), SessionStore()
        with store.observe(module, "constants", ObserveOptions(), "t") as group:
            for args, kwargs in calls:
                module(*args, **kwargs)
        runs.clear()
        result = check_model(group, settings(tmp_path, use_cache=True))
        graphs.append([(g.name, g.calls, g.verdict) for g in result.graphs])
        counted.append(len(runs))
    assert graphs == [[("return_dict=True", [0, 1], "passed"), ("return_dict default", [2], "passed")]] * 2
    assert counted == [4, 0]  # the first run: two calls, one refused, then the last call on its own graph


class OptionalHidden(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, with_hidden: bool = False) -> Any:
        y = self.proj(x)
        return (y, torch.tanh(y)) if with_hidden else y


def test_a_graph_is_not_run_on_calls_whose_outputs_it_cannot_give(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A graph giving two outputs cannot serve calls returning one: they get a graph of their own
    without a run of the first on them."""
    from pytest_exportobs.engine.verify import runtimes

    runs: list[int] = []
    original = runtimes.OnnxRunner.__call__
    monkeypatch.setattr(runtimes.OnnxRunner, "__call__", lambda self, *a: runs.append(1) or original(self, *a))
    module = OptionalHidden()
    group = observed(module, (torch.randn(2, 4), True), (torch.randn(3, 4), True), (torch.randn(5, 4),))
    result = check_model(group, settings(tmp_path))
    assert [(g.name, g.calls, g.verdict) for g in result.graphs] == [
        ("with_hidden=True", [0, 1], "passed"), ("with_hidden default", [2], "passed")]
    assert len(runs) == 3  # each call on its own graph, none on the other


class _Exiting(torch.nn.Module):
    """A model whose export ends its process, as a native crash would (eager runs); with modules
    enough to be expected the most expensive check."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(12))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_exporting():
            os._exit(3)
        return x * 2


def test_a_child_takes_the_next_checks_of_its_family_and_a_crash_fails_only_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A forked child takes the next waiting check after each of its own while it is a model of
    its family (classes one module defines: a process's first trace of them costs about twice the
    next); a child that dies fails the model it was checking, the others are checked by the
    children after it; with ``isolate`` each model has a child of its own."""
    from pytest_exportobs.engine import runner

    parent, started = os.getpid(), []
    start = runner._start
    monkeypatch.setattr(runner, "_start", lambda queue, first, *rest: started.append(queue.checks[first][0].name)
                        or start(queue, first, *rest))
    monkeypatch.setattr(runner, "check_model", lambda *args: _with_pid(check_model(*args)))
    groups = [observed(_Exiting().eval(), (torch.randn(2, 8),), name="exiting"),
              *(observed(_Scaled().eval(), (torch.randn(2, 8),), (torch.randn(3, 8),), name=f"scaled{i}")
                for i in range(6)),
              observed(MLP().eval(), (torch.randn(2, 8),), (torch.randn(5, 8),), name="mlp")]
    results = {r.name: r for r in runner.check_all(groups, settings(tmp_path), isolate=False, jobs=2)}
    scaled_names = [f"scaled{i}" for i in range(6)]
    assert sorted(results) == ["exiting", "mlp", *scaled_names]
    assert (results["exiting"].verdict, results["exiting"].kind, results["exiting"].reason) == (
        "failed", "error", "the isolated check process died (exit code 3)")
    assert all(results[name].verdict == "passed" for name in ("mlp", *scaled_names))
    # the most expensive first; after it, at most two children (two jobs) check the six scaled
    # models (of one family) in turn, and none of them the MLP (another family): the child started
    # after the crash takes the next scaled model still waiting, whichever the other has reached
    assert started[:2] == ["exiting", "scaled0"] and started[-1] == "mlp"
    assert len(started[2:-1]) <= 1 and set(started[2:-1]) <= set(scaled_names[1:])
    scaled = [_pid(results[name]) for name in scaled_names]
    assert len(set(scaled)) <= 2 and _pid(results["mlp"]) not in scaled and parent not in scaled
    assert len(started) == 2 + len(set(scaled)) == len({*scaled, _pid(results["mlp"])}) + 1
    started.clear()
    isolated = list(runner.check_all(groups[1:], settings(tmp_path / "isolated"), isolate=True, jobs=2))
    assert [r.verdict for r in isolated] == ["passed"] * 7 and len({_pid(r) for r in isolated}) == 7
    assert sorted(started) == ["mlp", *scaled_names]


