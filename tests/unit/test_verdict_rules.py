"""The verdict judges the model as its tests ran it: export patches for tracing only, bounds judged on
the graph, torch.onnx's own capture, pins at a special size (no pytest session)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import onnxruntime
import pytest
import torch

from pytest_exportobs.engine.base.settings import CheckSettings
from pytest_exportobs.engine.check import check_model
from pytest_exportobs.observe.store import ModelGroup, ObserveOptions, SessionStore

HERE = Path(__file__)
SCALE = {"value": 1.0}  # what Scaled multiplies by; a patch changes it while torch.export traces


@contextlib.contextmanager
def doubled_scale() -> Iterator[None]:
    """An export patch that changes what the model computes (as a patched mask would)."""
    SCALE["value"] = 2.0
    try:
        yield
    finally:
        SCALE["value"] = 1.0


class Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * SCALE["value"]


def observed(module: torch.nn.Module, *calls: tuple, name: str = "model") -> ModelGroup:
    store = SessionStore()
    torch.manual_seed(0)
    with store.observe(module, name, ObserveOptions(), "test_verdict_rules.py::test") as group, torch.no_grad():
        for args in calls:
            module(*args)
    return group


def settings(tmp_path: Path, examples: int = 6, patches: tuple[str, ...] = ()) -> CheckSettings:
    return CheckSettings(export_dir=tmp_path, examples=examples, hypothesis_seed=0, use_cache=False, patches=patches)


def line_of(text: str) -> str:
    lines = HERE.read_text().splitlines()
    number = next(i for i, line in enumerate(lines, 1) if text in line)
    return f"tests/unit/test_verdict_rules.py:{number}: {lines[number - 1].strip()}"


def onnx_outputs(path: str, *inputs: torch.Tensor) -> list[torch.Tensor]:
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    return [torch.from_numpy(o) for o in session.run(None, {n: t.numpy() for n, t in zip(names, inputs)})]


# -- export patches are for tracing only ------------------------------------------------------


@pytest.mark.parametrize("patched", [False, True])
def test_a_patch_that_changes_what_the_model_computes_fails_the_model_naming_it(tmp_path: Path, patched: bool) -> None:
    """Eager, as the tests ran it, is the reference: the graph traced under a patch that changes
    the model's outputs differs from it, whatever eager gives under the patch."""
    group = observed(Scaled().eval(), (torch.randn(2, 4),), (torch.randn(3, 4),))
    path = "test_verdict_rules.doubled_scale"
    result = check_model(group, settings(tmp_path, patches=(path,) if patched else ()))
    if not patched:
        assert result.verdict == "passed", result.reason
        return
    assert (result.verdict, result.stage, result.kind) == ("failed", "verify", "mismatch")
    assert result.reason.endswith(
        f": the export patch {path} changes what the model computes here (eager under it differs from eager as the "
        "tests ran it), and the graph, traced under it, follows the patched model"), result.reason
    assert result.reference == "recorded"  # never replaced by the patched eager's outputs


@pytest.mark.slow
def test_paligemma_attending_bidirectionally_fails_where_transformers_masking_patch_makes_it_causal(
        tmp_path: Path) -> None:
    """PaliGemma attends bidirectionally over a prompt whose mask is all ones; under the export
    patches transformers builds a causal mask: the graph differs from eager at every shape."""
    transformers = pytest.importorskip("transformers")
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=37, num_hidden_layers=1,
                                             num_attention_heads=4, image_size=16, patch_size=4)
    text = transformers.GemmaConfig(vocab_size=120, hidden_size=32, intermediate_size=37, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    config = transformers.PaliGemmaConfig(vision_config=vision.to_dict(), text_config=text.to_dict(),
                                          image_token_index=100, projection_dim=32)
    torch.manual_seed(0)
    model = transformers.PaliGemmaForConditionalGeneration(config).eval()

    def call(batch: int, text_tokens: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 99, (batch, 16 + text_tokens))
        ids[:, :16] = 100  # the image's tokens first, as the processor puts them
        return dict(input_ids=ids, pixel_values=torch.randn(batch, 3, 16, 16), attention_mask=torch.ones_like(ids))

    store = SessionStore()
    with store.observe(model, "paligemma", ObserveOptions(), "t::test") as group, torch.no_grad():
        model(**call(2, 5))
        model(**call(3, 7))
    result = check_model(group, settings(tmp_path, examples=0))
    assert (result.verdict, result.stage, result.kind) == ("failed", "verify", "mismatch")
    assert "the export patch explicit_attention_masks changes what the model computes" in result.reason, result.reason


# -- bounds torch puts on a dim, judged on the graph ---------------------------------------------


class Upsample(torch.nn.Module):
    """diffusers' Upsample2D: a layout-only branch on a large batch."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.shape[0] >= 64:
            hidden_states = hidden_states.contiguous()
        return self.conv(torch.nn.functional.interpolate(hidden_states, scale_factor=2.0, mode="nearest"))


def test_a_bound_on_a_layout_only_branch_passes_with_a_note_and_the_graph_serves_past_it(tmp_path: Path) -> None:
    model = Upsample().eval()
    group = observed(model, (torch.randn(2, 4, 8, 8),), (torch.randn(3, 4, 8, 8),))
    result = check_model(group, settings(tmp_path))
    assert result.verdict == "passed", result.reason
    assert result.dims == {"hidden_states": {"0": "batch", "2": "height", "3": "width"}}
    assert (f"torch.export bounds batch to at most 63 where the model takes another branch "
            f"(at {line_of('if hidden_states.shape[0] >= 64:')}); the graph, without torch's assert, serves "
            "batch=64 as eager does") in result.notes
    large = torch.randn(65, 4, 5, 6)
    with torch.no_grad():
        torch.testing.assert_close(onnx_outputs(result.onnx_path, large)[0], model(large), rtol=1e-4, atol=1e-5)


class GrowingTable(torch.nn.Module):
    """M2M100's sinusoidal positions: the table covers the declared maximum, eager regrows it past."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(max_position_embeddings=16)
        self.embed = torch.nn.Embedding(50, 8)
        self.register_buffer("table", self._sinusoids(16), persistent=False)

    @staticmethod
    def _sinusoids(length: int) -> torch.Tensor:
        return torch.sin(torch.arange(length, dtype=torch.float32)[:, None] / torch.arange(1, 9, dtype=torch.float32))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        table = self.table
        if input_ids.shape[1] > table.shape[0]:
            table = self._sinusoids(input_ids.shape[1])
        return self.embed(input_ids) + table[: input_ids.shape[1]]


def test_a_bound_at_the_maximum_the_model_declares_passes_with_a_note(tmp_path: Path) -> None:
    model = GrowingTable().eval()
    group = observed(model, (torch.randint(0, 50, (2, 5)),), (torch.randint(0, 50, (3, 9)),))
    result = check_model(group, settings(tmp_path))
    assert result.verdict == "passed", result.reason
    assert result.dims == {"input_ids": {"0": "batch", "1": "seq"}}
    assert ("torch.export bounds seq to at most 16, the model's declared max_position_embeddings = 16 "
            f"(at {line_of('if input_ids.shape[1] > table.shape[0]:')})") in result.notes


def test_a_bound_below_what_eager_runs_that_the_graph_does_not_serve_still_fails(tmp_path: Path) -> None:
    """Without a declared maximum, the same table fails: past 16 the graph's table is too short."""
    model = GrowingTable().eval()
    del model.config
    group = observed(model, (torch.randint(0, 50, (2, 5)),), (torch.randint(0, 50, (3, 9)),))
    result = check_model(group, settings(tmp_path))
    assert (result.verdict, result.stage, result.kind) == ("failed", "torch.export", "specialized")
    assert result.reason.startswith("seq (input_ids.1, the tests vary it) bounded to at most 16 (eager runs seq=17)")


# -- what torch.onnx.export captures, the check captures ------------------------------------------


class Lengths(torch.nn.Module):
    """Masks positions past each row's length, sized by the longest (a data-dependent size)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        longest = int(lengths.max().item())
        mask = torch.arange(longest) < lengths[:, None]
        return (self.proj(x) * mask[..., None]).sum(1) / lengths[:, None]


def test_a_size_read_from_values_exports_as_torch_onnx_captures_it_and_serves_unseen_lengths(tmp_path: Path) -> None:
    model = Lengths().eval()
    group = observed(model, (torch.randn(2, 5, 8), torch.tensor([5, 3])),
                     (torch.randn(3, 7, 8), torch.tensor([7, 2, 7])))
    result = check_model(group, settings(tmp_path))
    assert result.verdict == "passed", result.reason
    assert result.dims == {"x": {"0": "batch", "1": "seq"}, "lengths": {"0": "batch"}}
    assert any(note.startswith("captured by torch.export(strict=True): torch.export(), as torch.onnx.export captures "
                               "first, failed (GuardOnDataDependentSymNode") for note in result.notes), result.notes
    x, lengths = torch.randn(4, 11, 8), torch.tensor([11, 1, 6, 11])
    with torch.no_grad():
        torch.testing.assert_close(onnx_outputs(result.onnx_path, x, lengths)[0], model(x, lengths),
                                   rtol=1e-4, atol=1e-5)


# -- a dim pinned at a size the model treats specially -------------------------------------------


class DinoPositions(torch.nn.Module):
    """DINOv2's embeddings: the position table as it is when the patches number its positions and
    the image is square (at the configured 32 pixels), else interpolated to the patch grid."""

    def __init__(self, image_size: int = 32, patch: int = 8, dim: int = 16) -> None:
        super().__init__()
        self.patch, self.side = patch, image_size // patch
        self.proj = torch.nn.Conv2d(3, dim, patch, stride=patch)
        self.positions = torch.nn.Parameter(torch.randn(1, self.side * self.side, dim))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.proj(pixel_values).flatten(2).transpose(1, 2)
        height, width = pixel_values.shape[-2:]
        if patches.shape[1] == self.positions.shape[1] and height == width:
            return patches + self.positions
        grid = self.positions.reshape(1, self.side, self.side, -1).permute(0, 3, 1, 2)
        grid = torch.nn.functional.interpolate(grid, size=(height // self.patch, width // self.patch), mode="bicubic")
        return patches + grid.flatten(2).transpose(1, 2)


def test_a_pin_whose_unnamed_export_rejects_a_recorded_call_is_traced_again_on_that_call(tmp_path: Path) -> None:
    """Traced at 32 pixels, the Dim.DYNAMIC program asserts ``(height//8)**2 == 16`` and its graph
    fails the recorded 48-pixel call: traced again at 48, the graph serves both."""
    model = DinoPositions().eval()
    group = observed(model, (torch.randn(2, 3, 32, 32),), (torch.randn(2, 3, 48, 48),))
    result = check_model(group, settings(tmp_path))
    assert result.verdict == "passed", result.reason
    assert result.dims == {"pixel_values": {"0": "batch", "2": "height", "3": "width"}}
    assert any(note.startswith("traced on call 1: on the first example torch pinned height") for note in result.notes)
    assert not any(note.startswith("exported with Dim.DYNAMIC dims") for note in result.notes)
    for size in (32, 40, 48):
        images = torch.randn(3, 3, size, size)
        with torch.no_grad():
            torch.testing.assert_close(onnx_outputs(result.onnx_path, images)[0], model(images), rtol=1e-4, atol=1e-4)
