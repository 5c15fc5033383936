"""Image models as timm's own tests call them: one image size, pass-through heads, models on the
meta device, sides a model branches on or pins (no pytest session)."""

from __future__ import annotations

import contextlib
import math
import re
from pathlib import Path

import onnx
import onnxruntime
import pytest
import torch

from pytest_exportobs.engine.base.eager import ModelRaised, call_model
from pytest_exportobs.engine.base.settings import CheckSettings
from pytest_exportobs.engine.check import check_model
from pytest_exportobs.engine.export.tracing import NON_STRICT, Example
from pytest_exportobs.observe.store import ModelGroup, ObserveOptions, SessionStore

from models import ConvNet, FixedGrid, PatchMixer


def observed(module: torch.nn.Module, *calls: tuple, name: str = "model") -> ModelGroup:
    store = SessionStore()
    torch.manual_seed(0)
    with store.observe(module, name, ObserveOptions(), "test_vision_models.py::test") as group, torch.no_grad():
        for args in calls:
            module(*args)
    return group


def settings(tmp_path: Path, examples: int = 10) -> CheckSettings:
    return CheckSettings(export_dir=tmp_path, examples=examples, hypothesis_seed=0, use_cache=False)


def line_of(text: str, path: Path = Path(__file__).parent.parent / "models.py") -> str:
    """``tests/models.py:<n>: <code>`` of the line holding ``text``."""
    lines = path.read_text().splitlines()
    number = next(i for i, line in enumerate(lines, 1) if text in line)
    return f"tests/models.py:{number}: {lines[number - 1].strip()}"


def failing_and_alike(note: str, line: str) -> dict[str, int]:
    """The sides of a note's ``fails at width=9 (in <line>), and alike at height=9 alone``: the
    failing example's side, then the one failing alike, with their sizes."""
    match = re.search(rf"fails at (\w+)=(\d+) \(in {re.escape(line)}\), and alike at (\w+)=(\d+) alone", note)
    assert match, note
    return {match[1]: int(match[2]), match[3]: int(match[4])}


def run_onnx(path: str, images: torch.Tensor) -> torch.Tensor:
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    return torch.from_numpy(session.run(None, {session.get_inputs()[0].name: images.numpy()})[0])


def test_sides_torch_pins_solving_its_guards_are_kept_static_with_the_line_and_the_batch_serves(
        tmp_path: Path) -> None:
    """EfficientViT-M and TinyViT at one image size: torch says "Specializations unexpectedly
    required (height, width)"; the sides are guesses (the tests never varied them), so they stay
    static with a note, and the batch, which a deployment varies, stays dynamic."""
    model = FixedGrid().eval()
    group = observed(model, (torch.randn(2, 3, 16, 16),))
    result = check_model(group, settings(tmp_path))
    assert (result.verdict, result.stage) == ("passed", "variations"), result.reason
    assert result.dims == {"images": {"0": "batch"}}
    line = line_of("if features.shape[-2:] != self.positions.shape[-2:]:")
    assert [n for n in result.notes if "kept static" in n] == [
        f"height kept static: torch.export specializes it to 16 at {line}",
        f"width kept static: torch.export specializes it to 16 at {line}",
    ]
    unseen = torch.randn(5, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(run_onnx(result.onnx_path, unseen), model(unseen), rtol=1e-4, atol=1e-5)


def test_a_rerun_on_the_export_cache_keeps_the_sides_torch_pinned_static(tmp_path: Path) -> None:
    """The graph the cache serves has the pinned sides static: so has the shape model the rerun
    verifies and varies (it once kept them dynamic, failed its variations on the static graph
    and exported again)."""
    group = observed(FixedGrid().eval(), (torch.randn(2, 3, 16, 16),))
    cached = CheckSettings(export_dir=tmp_path, examples=10, hypothesis_seed=0)
    first, rerun = check_model(group, cached), check_model(group, cached)
    assert [(r.verdict, r.cache_hit, r.dims) for r in (first, rerun)] == [
        ("passed", False, {"images": {"0": "batch"}}), ("passed", True, {"images": {"0": "batch"}})]
    assert rerun.graphs[0].timings.keys() <= {"ort-load", "verify", "variations"}, rerun.graphs[0].timings
    assert [n for n in rerun.notes if "kept static" in n] == [n for n in first.notes if "kept static" in n]


@pytest.mark.slow
def test_guessed_sides_the_graph_raises_at_when_odd_are_kept_in_steps_of_two_with_the_failing_line(
        tmp_path: Path) -> None:
    """MobileViT at one image size: eager interpolates sides that are no multiple of its patch,
    a branch torch traces once; the graph raises at odd sides (its reshape), the tests never varied
    them: they are kept in multiples of 2, the note naming the node's line, and the ONNX serves
    even sides the tests never used, raising (never wrong) at odd ones."""
    model = PatchMixer().eval()
    group = observed(model, (torch.randn(2, 3, 8, 8),), (torch.randn(3, 3, 8, 8),))
    result = check_model(group, settings(tmp_path))
    assert (result.verdict, result.stage) == ("passed", "variations"), result.reason
    assert result.dims == {"pixel_values": {"0": "batch", "2": "height", "3": "width"}}
    (stepped,) = [n for n in result.notes if " in multiples of 2" in n]  # both sides found on one graph
    reshape = line_of("patches = x.reshape(batch, channels, new_h // p, p, new_w // p, p)")
    assert stepped.startswith("height in multiples of 2, width in multiples of 2: the graph fails at "), stepped
    assert stepped.endswith(" alone, where eager runs; the tests never varied them"), stepped
    assert failing_and_alike(stepped, reshape) == {"width": 9, "height": 9}, stepped
    unseen = torch.randn(4, 3, 10, 12)
    with torch.no_grad():
        torch.testing.assert_close(run_onnx(result.onnx_path, unseen), model(unseen), rtol=1e-4, atol=1e-5)
    with pytest.raises(Exception, match="cannot be reshaped"):
        run_onnx(result.onnx_path, torch.randn(2, 3, 9, 8))


@pytest.mark.slow
def test_a_rerun_keeps_the_guessed_sides_in_steps_without_varying_them_again(tmp_path: Path) -> None:
    """The explorations that failed on the guessed sides and passed in steps are kept with the
    trace: a rerun takes the same decisions from them (the same notes, the same dims) without
    running the model again."""
    group = observed(PatchMixer().eval(), (torch.randn(2, 3, 8, 8),), (torch.randn(3, 3, 8, 8),))
    cached = CheckSettings(export_dir=tmp_path, examples=10, hypothesis_seed=0)
    first, rerun = check_model(group, cached), check_model(group, cached)
    dims = {"pixel_values": {"0": "batch", "2": "height", "3": "width"}}
    assert [(r.verdict, r.dims) for r in (first, rerun)] == [("passed", dims)] * 2
    stepped = [n for n in first.notes if " in multiples of 2: " in n]
    assert stepped and [n for n in rerun.notes if " in multiples of 2: " in n] == stepped
    assert "variations" in first.graphs[0].timings and "variations" not in rerun.graphs[0].timings
    assert "variations: as explored on an earlier check of this trace (failing on sizes of dims the tests never " \
           "varied), not again (the export cache holds the outcome)" in rerun.notes
    assert not list(tmp_path.rglob("repro*.py"))  # the failure withdrawn: no repro written


def test_sides_the_tests_vary_stay_dynamic_and_the_failure_names_the_line(tmp_path: Path) -> None:
    model = PatchMixer().eval()
    group = observed(model, (torch.randn(2, 3, 8, 8),), (torch.randn(3, 3, 12, 10),))
    result = check_model(group, settings(tmp_path))
    assert (result.verdict, result.stage, result.kind) == ("failed", "variations", "variation")
    reshape = line_of("patches = x.reshape(batch, channels, new_h // p, p, new_w // p, p)")
    assert f" in {reshape}: " in result.reason, result.reason
    sizes = dict(pair.split("=") for pair in result.reason.split(" in ")[0].removeprefix("fails at ").split(", "))
    assert int(sizes["height"]) % 2 or int(sizes["width"]) % 2  # an odd side takes the other branch


def test_a_pass_through_module_exports_a_valid_onnx_file(tmp_path: Path) -> None:
    """timm's heads with ``num_classes=0`` are ``nn.Identity``: a graph without ops still imports
    the default opset."""
    group = observed(torch.nn.Identity(), (torch.randn(2, 8),), (torch.randn(3, 8),))
    result = check_model(group, settings(tmp_path))
    assert (result.verdict, result.stage) == ("passed", "variations"), result.reason
    assert result.dims == {"input": {"0": "batch"}}
    model = onnx.load(result.onnx_path)
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 18)]
    assert model.graph.node[0].op_type == "Identity" and result.opset == 18


def test_a_model_on_the_meta_device_is_skipped_with_the_reason(tmp_path: Path) -> None:
    """timm's default-config tests build and call models on the meta device: shapes, no values."""
    with torch.device("meta"):
        model = ConvNet().eval()
    group = observed(model, (torch.randn(1, 3, 8, 8, device="meta"),))
    result = check_model(group, settings(tmp_path))
    assert (result.verdict, result.stage, result.kind) == ("skipped", "observe", None)
    assert result.reason == (
        "its calls ran on the meta device (shapes, no values): nothing to run eagerly, export or compare")
    assert not (tmp_path / "model").exists()


def test_a_model_moved_to_the_meta_device_after_its_calls_is_skipped_with_the_reason(tmp_path: Path) -> None:
    model = ConvNet().eval()
    group = observed(model, (torch.randn(1, 3, 8, 8),))
    model.to("meta")  # as timm's tests of reset_classifier do
    result = check_model(group, settings(tmp_path))
    assert (result.verdict, result.reason) == (
        "skipped", "its weights are on the meta device (shapes, no values), moved there after its calls: "
                   "nothing to export or compare")


def test_calls_on_the_meta_device_of_a_module_without_weights_are_left_out(tmp_path: Path) -> None:
    """A module without parameters (timm's ``nn.Identity`` heads, activations) called on real and
    on meta tensors: one group, checked on the real calls, the meta ones left out with a note."""
    module = torch.nn.SiLU()
    group = observed(module, (torch.randn(2, 8),), (torch.randn(1, 8, device="meta"),), (torch.randn(3, 8),))
    result = check_model(group, settings(tmp_path))
    assert result.verdict == "passed", result.reason
    assert ("call 1 from test_vision_models.py::test left out: it ran on the meta device (shapes, no values)"
            in result.model_notes)
    only_meta = observed(torch.nn.SiLU(), (torch.randn(1, 8, device="meta"),))
    skipped = check_model(only_meta, settings(tmp_path / "meta"))
    assert (skipped.verdict, skipped.stage) == ("skipped", "observe")


def test_a_model_on_the_meta_device_gets_a_group_of_its_own() -> None:
    """The instance a group exports must hold values: a meta copy of a model never joins its group."""
    store = SessionStore()
    real = ConvNet()
    with torch.device("meta"):
        meta = ConvNet()
    for module, device in ((meta, "meta"), (real, "cpu")):
        with store.observe(module, "ConvNet", ObserveOptions(), "t::test"):
            module(torch.randn(1, 3, 8, 8, device=device))
    assert len(store.groups) == 2 and all(name.startswith("ConvNet[ConvNet-") for name in store.groups)
    assert sorted(group.module is real for group in store.groups.values()) == [False, True]


@pytest.mark.parametrize("guessed", [True, False])
def test_an_image_model_keeps_dynamic_sides_it_serves(tmp_path: Path, guessed: bool) -> None:
    """Sides a convolutional model serves at any size stay dynamic, varied by the tests or not."""
    calls = [(torch.randn(2, 3, 16, 20),)] + ([] if guessed else [(torch.randn(3, 3, 24, 12),)])
    result = check_model(observed(ConvNet().eval(), *calls, name="images"), settings(tmp_path))
    assert result.verdict == "passed", result.reason
    assert result.dims == {"images": {"0": "batch", "2": "height", "3": "width"}}


class WidePatchMixer(PatchMixer):
    """MobileViT's unfold with patches of 4: traced at 8, its graph raises at 9 and at 10."""

    patch = 4


@pytest.mark.slow
def test_guessed_sides_the_graph_serves_in_no_step_are_kept_static_with_the_failing_line(tmp_path: Path) -> None:
    """Steps of 2 do not help (the graph raises at 10), and 16 does not divide the traced 8: the
    sides stay static, named as the axes they are, the note naming the node's line."""
    model = WidePatchMixer().eval()
    group = observed(model, (torch.randn(2, 3, 8, 8),), (torch.randn(3, 3, 8, 8),))
    result = check_model(group, settings(tmp_path))
    assert (result.verdict, result.stage) == ("passed", "variations"), result.reason
    assert result.dims == {"pixel_values": {"0": "batch"}}
    (kept,) = [n for n in result.notes if "kept static" in n]  # both sides found on one graph
    reshape = line_of("patches = x.reshape(batch, channels, new_h // p, p, new_w // p, p)")
    assert kept.startswith("height, width kept static: the tests never varied them and the graph fails at "), kept
    assert kept.endswith(" alone, where eager runs"), kept
    assert failing_and_alike(kept, reshape) == {"width": 10, "height": 10}, kept
    unseen = torch.randn(4, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(run_onnx(result.onnx_path, unseen), model(unseen), rtol=1e-4, atol=1e-5)


class ColumnMixer(torch.nn.Module):
    """Columns of 4 mixed across the width only: a width that is no multiple of 4 is interpolated
    to one first (a branch traced once), any height is served."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = torch.nn.Linear(4, 4)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        batch, channels, height, width = pixel_values.shape
        columns = math.ceil(width / 4) * 4
        x = pixel_values
        if columns != width:
            x = torch.nn.functional.interpolate(x, size=(height, columns), mode="bilinear")
        mixed = self.mix(x.reshape(batch, channels, height, columns // 4, 4)).reshape(batch, channels, height, columns)
        return mixed[..., :width]


@pytest.mark.slow
def test_a_side_the_graph_serves_stays_dynamic_beside_one_it_fails_on(tmp_path: Path) -> None:
    """The width fails the graph (its reshape into columns), the height moved alone does not: the
    width alone is refined, the height stays dynamic and the ONNX serves heights never used."""
    model = ColumnMixer().eval()
    group = observed(model, (torch.randn(2, 3, 8, 8),), (torch.randn(3, 3, 8, 8),))
    result = check_model(group, settings(tmp_path))
    assert (result.verdict, result.stage) == ("passed", "variations"), result.reason
    assert result.dims == {"pixel_values": {"0": "batch", "2": "height"}}
    refined = [n for n in result.notes if "the graph fails at" in n]
    assert refined and all(n.startswith("width ") and "alike" not in n for n in refined), refined
    unseen = torch.randn(4, 3, 13, 8)
    with torch.no_grad():
        torch.testing.assert_close(run_onnx(result.onnx_path, unseen), model(unseen), rtol=1e-4, atol=1e-5)


def tiny_swin() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.SwinConfig(image_size=32, patch_size=2, embed_dim=16, depths=[1, 2], num_heads=[2, 4],
                                     window_size=4, mlp_ratio=2.0, num_labels=3)
    return transformers.SwinForImageClassification(config).eval()


def test_calls_breaking_the_sides_torch_restricts_a_graph_to_get_a_graph_of_their_own(tmp_path: Path) -> None:
    """Swin at 32 pads nothing to its 4-patch windows, at 40 it pads: torch.export traced at 32
    restricts the sides to multiples of 16, which the ONNX file does not check.  The call at 40
    gets a graph of its own instead of failing in onnxruntime's Reshape; each graph serves sizes
    of its own padding class the tests never used."""
    model = tiny_swin()
    group = observed(model, (torch.randn(2, 3, 32, 32),), (torch.randn(3, 3, 32, 32),), (torch.randn(2, 3, 40, 40),))
    result = check_model(group, settings(tmp_path, examples=4))
    assert (result.verdict, result.stage) == ("passed", "variations"), result.reason
    whole, apart = result.graphs
    assert (whole.name, whole.calls, apart.name, apart.calls) == ("", [0, 1], "width=40, height=40", [2])
    assert whole.relations == ["width = 16*width_div16", "height = 16*height_div16"]
    assert whole.dims == apart.dims == {"pixel_values": {"0": "batch", "2": "height", "3": "width"}}
    assert "calls [2] break width = 16*width_div16; height = 16*height_div16 (torch.export's restriction of this " \
           "graph): checked on a graph of their own" in whole.notes
    for graph, side in ((whole, 48), (apart, 56)):  # sizes no test used, in each graph's class
        images = torch.randn(5, 3, side, side)
        with torch.no_grad():
            expected = model(images).logits
        torch.testing.assert_close(run_onnx(graph.onnx_path, images), expected, atol=1e-4, rtol=1e-4)


def windows(model: torch.nn.Module) -> list[tuple[int, int]]:
    return [(layer.window_size, layer.shift_size) for layer in model.modules() if hasattr(layer, "shift_size")]


@pytest.mark.parametrize(("side", "changed"), [(8, [(4, 0), (2, 0), (4, 2)]), (16, [(4, 0), (4, 0), (4, 0)])])
def test_the_checks_calls_and_traces_at_other_sizes_leave_the_model_as_the_tests_left_it(
    side: int, changed: list[tuple[int, int]],
) -> None:
    """Swin's layers take the side they see as their window when it is no larger, and keep it:
    after a call at 8x8 (which raises) its second stage windows 2x2, after 16x16 its last block
    no longer shifts; its calls at the tests' 32x32 then fail or compute otherwise.  The check's
    own calls and traces at such sizes leave the model's attributes as they were."""
    other = torch.randn(2, 3, side, side)
    unchecked = tiny_swin()
    with contextlib.suppress(RuntimeError), torch.no_grad():
        unchecked(other)
    assert windows(unchecked) == changed  # what the model's own call does to it

    model = tiny_swin()
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        before = model(images).logits
    if side == 16:  # traced, torch.export undoing what the trace assigns (at 8 it raises as eager does)
        NON_STRICT.export(model, Example([other], (other,), {}), ({0: torch.export.Dim("batch")},))
        assert windows(model) == [(4, 0), (4, 0), (4, 2)]
    with contextlib.suppress(ModelRaised), torch.no_grad():
        call_model(model, other)
    assert windows(model) == [(4, 0), (4, 0), (4, 2)]
    with torch.no_grad():
        assert torch.equal(model(images).logits, before)
