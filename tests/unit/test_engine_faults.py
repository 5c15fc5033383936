"""The engine on models that make checking hard: what is the model's, what is the plugin's,
and references eager itself does not reproduce (no pytest session)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pytest_exportobs.engine.base.eager import ModelRaised, call_model
from pytest_exportobs.engine.base.reasons import one_line_reason
from pytest_exportobs.engine.base.settings import CheckSettings
from pytest_exportobs.engine.check import check_model
from pytest_exportobs.observe.store import ModelGroup, ObserveOptions, SessionStore

from models import MLP, Bad, Good


def observed(module: torch.nn.Module, *calls: tuple, between=None) -> ModelGroup:
    """Group of ``module`` after the calls; ``between(module)`` runs after the first call."""
    store = SessionStore()
    with store.observe(module, "model", ObserveOptions(), "test_engine_faults.py::test") as group:
        for index, args in enumerate(calls):
            module(*args)
            if between is not None and index == 0:
                between(module)
    return group


def check(group: ModelGroup, directory: Path) -> tuple[str, str, str, str]:
    result = check_model(group, CheckSettings(export_dir=directory, examples=0))
    return result.verdict, result.stage, result.kind, result.reason


def test_two_classes_with_equal_weights_never_share_a_cache_entry(tmp_path: Path) -> None:
    good, bad = Good(), Bad()
    bad.load_state_dict(good.state_dict())
    calls = [(torch.ones(2, 4),), (torch.ones(3, 4),)]
    assert check(observed(good, *calls), tmp_path)[:3] == ("passed", "verify", None)
    for _ in range(2):  # the second run finds good's entry in the cache, never uses it for bad
        verdict, stage, kind, reason = check(observed(bad, *calls), tmp_path)
        assert (verdict, stage, kind) == ("failed", "torch.export", "error")
        assert reason.startswith("GuardOnDataDependentSymNode")


def test_a_numpy_argument_is_named_with_what_to_do(tmp_path: Path) -> None:
    class Scales(torch.nn.Module):
        def forward(self, x: torch.Tensor, scale: np.ndarray) -> torch.Tensor:
            return x * float(scale.sum())

    assert check(observed(Scales(), (torch.randn(2, 3), np.ones(3))), tmp_path) == (
        "failed", "infer", "unsupported-input",
        "argument 'scale' holds a numpy.ndarray: torch.export takes tensors, numbers, strings and pytrees of "
        "them; convert it where the model is called (torch.from_numpy for a numpy array) or register its class "
        "with torch.utils._pytree",
    )


def test_a_model_returning_none_has_nothing_to_export(tmp_path: Path) -> None:
    class Logger(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> None:
            return None

    assert check(observed(Logger(), (torch.randn(2, 3),)), tmp_path) == (
        "failed", "infer", "unsupported-output",
        "the model returns no tensor (None or constants only): nothing to export",
    )


def test_a_bug_of_the_engine_is_not_blamed_on_the_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(aligned):
        raise KeyError("a bug")

    monkeypatch.setattr("pytest_exportobs.engine.check.plan_graphs", broken)
    result = check_model(observed(MLP(), (torch.randn(2, 8),)), CheckSettings(export_dir=tmp_path, examples=0))
    assert (result.verdict, result.stage, result.kind) == ("failed", "engine", "internal")
    assert result.reason == "internal error of pytest-exportobs, not of the model (please report it): KeyError: 'a bug'"
    assert "in broken" in result.traceback


class Noisy(torch.nn.Module):
    """Adds noise: two eager runs never agree."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + torch.randn_like(x)


def test_eager_that_does_not_reproduce_itself_is_nondeterministic_not_a_mismatch(tmp_path: Path) -> None:
    verdict, stage, kind, reason = check(observed(Noisy().eval(), (torch.randn(2, 4),), (torch.randn(3, 4),)), tmp_path)
    assert (verdict, stage, kind) == ("failed", "verify", "nondeterministic")
    assert reason.startswith("call ") and "two eager runs differ" in reason


class Scaled(torch.nn.Module):
    """Scales by an attribute, as a configuration entry would."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.scale = torch.nn.Linear(8, 4), 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale


def test_calls_observed_in_training_mode_are_judged_in_eval_mode(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5)).train()
    group = observed(model, (torch.randn(2, 4),), (torch.randn(3, 4),))
    result = check_model(group, CheckSettings(export_dir=tmp_path, examples=0))
    assert (result.verdict, result.reference) == (
        "passed", "recomputed on the exported instance for 2 of 2 calls, 2 observed in training mode (eval used)")
    assert model.training  # the check restores the mode the tests left


def test_weights_changed_through_data_after_a_call_recompute_its_reference(tmp_path: Path) -> None:
    """``.data`` has a version counter of its own: the digest of the weights' values sees the change."""
    model = MLP().eval()
    group = observed(model, (torch.randn(2, 8),), (torch.randn(3, 8),), between=lambda m: m.l1.weight.data.add_(1.0))
    result = check_model(group, CheckSettings(export_dir=tmp_path, examples=0))
    assert (result.verdict, result.reference) == ("passed", "recomputed on the exported instance for 1 of 2 calls")


def test_outputs_beyond_the_sessions_allowance_are_recomputed_and_judged_the_same(tmp_path: Path) -> None:
    """The store keeps a call's outputs while its allowance lasts (here one call's: 2 x 4 floats):
    the second call's reference is recomputed from its inputs, the verdict unchanged."""
    store = SessionStore()
    store.allowance.remaining = 2 * 4 * 4
    model = MLP().eval()
    with store.observe(model, "model", ObserveOptions(), "test_engine_faults.py::test") as group:
        model(torch.randn(2, 8))
        model(torch.randn(3, 8))
    assert [o.outputs is None for o in group.recorder.observations] == [False, True]
    assert [tuple(t.shape) for t in group.recorder.observations[1].args] == [(3, 8)]
    result = check_model(group, CheckSettings(export_dir=tmp_path, examples=0))
    assert (result.verdict, result.reference) == (
        "passed", "recomputed on the exported instance for 1 of 2 calls, 1 whose outputs the session's memory bound "
                  "did not keep")
    assert store.allowance.remaining == 0


def test_state_changed_after_the_calls_with_the_same_weights_recomputes_every_reference(tmp_path: Path) -> None:
    """A configuration entry changed after the calls (transformers' tests set ``model.config``):
    eager, as the tests ran it, steadily gives other outputs with the same weights."""
    model = Scaled().eval()
    group = observed(model, (torch.randn(2, 8),), (torch.randn(3, 8),))
    model.scale = 3.0
    result = check_model(group, CheckSettings(export_dir=tmp_path, examples=0))
    assert result.verdict == "passed", result.reason
    assert result.notes[-1] == (
        "references recomputed on the exported instance for every call: eager, as the tests ran it, no longer gave "
        "the recorded outputs with the same weights (the model's state changed after the calls: a config entry, "
        "an attribute)"
    )


class _Backbone(torch.nn.Module):
    """The feature map of each stage named in ``out_features``, as transformers' backbones read
    them from a config their tests change for the next model they build."""

    def __init__(self) -> None:
        super().__init__()
        self.stages = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.out_features = ["stage1", "stage2", "stage3"]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        maps = []
        for number, stage in enumerate(self.stages, 1):
            x = stage(x)
            if f"stage{number}" in self.out_features:
                maps.append(x)
        return tuple(maps)


def test_state_changed_after_the_calls_into_other_outputs_recomputes_every_reference(tmp_path: Path) -> None:
    """BeitBackbone's test calls a backbone, then sets ``out_features = None`` on the config it
    shares: the kept model now gives one feature map where its calls recorded three, which is the
    model's state, not the export's, and no export patch's."""
    model = _Backbone().eval()
    group = observed(model, (torch.randn(2, 8),), (torch.randn(3, 8),))
    model.out_features = ["stage3"]
    result = check_model(group, CheckSettings(export_dir=tmp_path, examples=0))
    assert (result.verdict, result.reason) == ("passed", "")
    assert [d["n_values"] for d in result.graphs[0].discrepancies] == [2 * 8, 3 * 8]  # the one map of each call
    assert result.notes[-1].startswith("references recomputed on the exported instance for every call: eager, as the "
                                       "tests ran it, no longer gave the recorded outputs with the same weights")


@pytest.mark.parametrize(
    "message, hint",
    [
        ("Error when translating node %grouped_mm_fallback : "
         "call_function[target=torch.ops.transformers.grouped_mm_fallback.default]",
         'ConversionError: cannot translate transformers.grouped_mm_fallback.default to ONNX; '
         'hint: transformers\' MoE experts ("grouped_mm") translate with a static number of experts and no '
         'out_dtype: else build the model with experts_implementation="batched_mm" in its config'),
        ("flash_attn is not supported by torch.export",
         'ConversionError: flash_attn is not supported by torch.export; '
         'hint: flash attention does not export: build the model with attn_implementation="sdpa" (or "eager")'),
    ],
)
def test_known_export_blockers_get_a_hint(message: str, hint: str) -> None:
    class ConversionError(Exception):
        pass

    assert one_line_reason("onnx-translate", ConversionError(message)) == hint


def test_a_file_that_cannot_be_written_is_the_machines_problem_not_the_models(tmp_path: Path) -> None:
    (tmp_path / "model").write_text("a file where a directory should be")
    verdict, stage, kind, reason = check(observed(MLP(), (torch.randn(2, 8),), (torch.randn(3, 8),)), tmp_path)
    assert (verdict, kind) == ("failed", "environment")
    assert reason.startswith("cannot write the ")
    assert str(tmp_path / "model") in reason


def test_an_export_cache_that_cannot_be_written_is_a_note_and_the_model_is_still_verified(tmp_path: Path) -> None:
    (tmp_path / "cache").write_text("a file where a directory should be")
    result = check_model(observed(MLP(), (torch.randn(2, 8),), (torch.randn(3, 8),)), CheckSettings(
        export_dir=tmp_path, examples=0))
    assert (result.verdict, result.stage, result.kind) == ("passed", "verify", None)
    (note,) = [n for n in result.notes if "export cache" in n]
    assert note.startswith(f"the export cache {tmp_path / 'cache'} cannot be written (")
    assert note.endswith("): the next run exports again")


def test_a_logging_handler_left_with_a_closed_stream_does_not_break_a_check(tmp_path: Path) -> None:
    """A library's handler made while another capture was active (transformers imported while a
    test's output was captured) keeps that capture's stream after it closed."""
    import io
    import logging

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("exportobs_test.closed_stream")
    logger.addHandler(handler)
    stream.close()
    try:
        group = observed(MLP().eval(), (torch.randn(2, 8),))
        result = check_model(group, CheckSettings(export_dir=tmp_path, examples=0))
    finally:
        logger.removeHandler(handler)
    assert result.verdict == "passed", result.reason
    assert handler.stream is stream  # given back as it was


def test_what_a_forward_assigns_in_the_checks_call_is_undone() -> None:
    """A forward rebinding a buffer, adding an attribute and a submodule: the check's call of it
    (at a size of its own) leaves the model as the tests left it; what raised is the model's."""
    class Remembers(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("scale", torch.ones(1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.scale = torch.full((1,), float(x.shape[-1]))
            self.last_width = x.shape[-1]
            self.head = torch.nn.Identity()
            if x.shape[0] > 4:
                raise ValueError("at most 4 rows")
            return x * self.scale

    model = Remembers()
    scale = model.scale
    assert torch.equal(call_model(model, torch.ones(2, 3)), torch.full((2, 3), 3.0))
    with pytest.raises(ModelRaised, match="at most 4 rows"):
        call_model(model.forward, torch.ones(5, 3))
    assert model.scale is scale and "scale" in model._buffers
    assert not hasattr(model, "last_width") and "head" not in model._modules


def test_hooks_a_forward_installs_once_and_flags_are_undone_together() -> None:
    """transformers installs its output-capturing hooks at a model's first call that needs them
    and flags the model: undoing the flag alone would have the next call install them again,
    and every hook capture twice."""
    class CapturesOnce(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = torch.nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
            if not getattr(self, "_hooks_installed", False):
                self.inner.register_forward_hook(lambda module, inputs, output: self.captured.append(output))
                self._hooks_installed = True
            self.captured: list[torch.Tensor] = []
            return self.inner(x), len(self.captured)

    model = CapturesOnce()
    assert [call_model(model, torch.ones(2, 3))[1] for _ in range(3)] == [1, 1, 1]
    assert not model.inner._forward_hooks and not hasattr(model, "_hooks_installed")
    assert model(torch.ones(2, 3))[1] == 1 and len(model.inner._forward_hooks) == 1  # the model's own call
