"""What torch.export says of named dims, read from its rejection and carried to a model's next
traces (``engine/export/learned``), on the messages the installed torch writes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.export import Dim

from pytest_exportobs import InputObserver
from pytest_exportobs.compat.torch_private import ExportUserError
from pytest_exportobs.compat.torch_text import Violation, affine_of_root, dim_range, suggested_fixes, violations
from pytest_exportobs.engine.base.settings import CheckSettings
from pytest_exportobs.engine.check import check_model
from pytest_exportobs.engine.export.learned import LearnedDims, LearnedFix
from pytest_exportobs.engine.export.tracing import Capture, Example, _unfixed, trace
from pytest_exportobs.observe.store import ObserveOptions, SessionStore
from pytest_exportobs.shapes.model import ShapeModel


class PairedPatches(torch.nn.Module):
    """Folds image rows and labels in pairs: torch.export takes neither at any size."""

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, channels, height, width = images.shape
        return images.reshape(batch, channels, height // 2, 2, width).sum(3), labels.reshape(-1, 2).sum(1)


class SixRows(PairedPatches):
    """As :class:`PairedPatches`, the folded images then laid out in six rows."""

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        folded, pairs = super().forward(images, labels)
        return folded.reshape(6, -1), pairs


NAMED = ({0: Dim("batch"), 2: Dim("height")}, {0: Dim("n")})
EXAMPLE = (torch.randn(3, 3, 16, 8), torch.zeros(6))


def export_outcomes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The outcome of each ``torch.export.export`` call from now on, in order: ``rejected`` (named
    dims torch rejects) or ``taken``."""
    outcomes: list[str] = []
    export = torch.export.export

    def counted_export(*args: object, **kwargs: object) -> torch.export.ExportedProgram:
        try:
            program = export(*args, **kwargs)
        except ExportUserError:
            outcomes.append("rejected")
            raise
        outcomes.append("taken")
        return program

    monkeypatch.setattr(torch.export, "export", counted_export)
    return outcomes


def rejection(model: torch.nn.Module, named: tuple = NAMED) -> str:
    with pytest.raises(ExportUserError, match="Constraints violated") as info:
        torch.export.export(model, EXAMPLE, dynamic_shapes=named)
    return info.value.msg


def test_torchs_derived_dims_and_the_dims_it_rejects_are_read() -> None:
    message = rejection(PairedPatches())
    rejected = violations(message)
    assert sorted(rejected) == ["height", "n"]
    assert rejected["n"].source == "L['labels'].size()[0]"
    assert "(L['labels'].size()[0] % 2) == 0" in rejected["n"].guards
    fixes = dict(suggested_fixes(message))
    assert (fixes["height"], fixes["n"]) == ("2*_height", "2*_n")
    assert affine_of_root(fixes["height"]) == (2, "_height", 0)
    assert fixes["_height"].startswith("Dim('_height'")


@pytest.mark.parametrize(("expression", "form"), [
    ("2*_height", (2, "_height", 0)), ("12*_height - 4", (12, "_height", -4)), ("_seq + 1", (1, "_seq", 1)),
    ("seq", None), ("2*seq", None), ("3", None), ("Dim('_height', min=1, max=oo)", None),
])
def test_only_a_new_roots_affine_form_is_a_derived_dim(expression: str, form: tuple | None) -> None:
    assert affine_of_root(expression) == form


@pytest.mark.parametrize(("fix", "limits"), [
    ("Dim('_height', min=1, max=oo)", (1, math.inf)), ("Dim('batch', max=63)", (0, 63)),
    ("Dim('seq', min=16)", (16, math.inf)), ("2*_height", None), ("3", None),
])
def test_the_range_of_a_suggested_dim_is_read(fix: str, limits: tuple | None) -> None:
    assert dim_range(fix) == limits


def test_derived_dims_learned_from_a_rejection_name_the_next_traces_dims_and_torch_takes_them() -> None:
    learned = LearnedDims()
    learned.learn(suggested_fixes(rejection(PairedPatches())))
    assert learned.fixes["height"] == LearnedFix("height", ("_height = Dim('_height', min=1, max=oo)",
                                                            "height = 2*_height"), 2, 0, 1)
    named, taken = learned.refine(NAMED, {"batch": [3], "height": [16], "n": [6]})
    assert [dim.name for dim in taken] == ["height", "n"]
    assert [{axis: str(dim) for axis, dim in shapes.items()} for shapes in named] == [
        {0: "Dim('batch', min=0)", 2: "2*_height"}, {0: "2*_n"}]
    program = torch.export.export(PairedPatches(), EXAMPLE, dynamic_shapes=named)  # traced once
    assert program.module()(torch.randn(5, 3, 10, 8), torch.zeros(4))[0].shape == (5, 3, 5, 8)


def test_a_derived_dim_is_named_only_where_every_size_of_the_dim_is_of_its_form() -> None:
    learned = LearnedDims()
    learned.learn([("_height", "Dim('_height', min=1, max=oo)"), ("height", "12*_height - 4"),
                   ("_n", "Dim('_n', min=2, max=oo)"), ("n", "2*_n")])
    assert [dim.name for dim in learned.refine(NAMED, {"height": [32, 20], "n": [6]})[1]] == ["height", "n"]
    assert [dim.name for dim in learned.refine(NAMED, {"height": [32, 24], "n": [2]})[1]] == []  # 24; _n = 1 < 2
    batch_only = ({0: Dim("batch")},)
    assert learned.refine(batch_only, {"batch": [3], "height": [32]}) == (batch_only, [])


def test_a_range_torch_puts_on_a_dim_is_learned_and_named_where_the_sizes_are_within() -> None:
    learned = LearnedDims()
    learned.learn([("batch", "Dim('batch', max=63)"), ("_height", "Dim('_height', min=1, max=oo)"),
                   ("height", "2*_height")])
    assert learned.fixes["batch"] == LearnedFix("batch", ("batch = Dim('batch', max=63)",), 1, 0, 0, 63)
    named, taken = learned.refine(NAMED, {"batch": [3, 63], "height": [16]})
    assert [fix.name for fix in taken] == ["batch", "height"]
    assert (str(named[0][0]), str(named[0][2])) == ("Dim('batch', min=0, max=63)", "2*_height")
    assert [fix.name for fix in learned.refine(NAMED, {"batch": [64], "height": [16]})[1]] == ["height"]


def test_equalities_constants_and_derived_dims_of_an_unknown_root_are_not_learned() -> None:
    learned = LearnedDims()
    learned.learn([("encoder_seq", "seq"), ("batch", "3"), ("width", "2*_width")])
    assert learned.fixes == {}


def test_a_rejected_dim_torch_suggests_no_fix_for_on_its_own_guards_ends_the_refining() -> None:
    message = rejection(SixRows())
    fixes = suggested_fixes(message)
    assert violations(message)["batch"] == Violation("L['images'].size()[0]", [
        "L['images'].size()[0] != 6", "(L['images'].size()[0] % 6) != 0", "((3*L['images'].size()[0]) % 6) != 0"])
    assert "batch" not in dict(fixes)
    assert _unfixed(message, fixes) == {"batch"}
    assert _unfixed(rejection(PairedPatches()), suggested_fixes(rejection(PairedPatches()))) == set()
    refined = torch.export.dynamic_shapes.refine_dynamic_shapes_from_suggested_fixes(message, NAMED)
    with pytest.raises(ExportUserError, match=r"Constraints violated \(batch\)"):  # what refining would meet
        torch.export.export(SixRows(), EXAMPLE, dynamic_shapes=refined)


def test_a_rejected_dim_without_a_fix_whose_guards_involve_a_fixed_dim_is_refined_as_before() -> None:
    """Refining ``height`` may settle a guard on ``batch*height``: torch is asked again."""
    broken = "in the specified range satisfy the generated guard"
    message = "\n".join([
        'Constraints violated (batch, height)! For more information, run with TORCH_LOGS="+dynamic".',
        f"  - Not all values of batch = L['x'].size()[0] {broken} ((L['x'].size()[0]*L['x'].size()[2]) % 4) == 0.",
        f"  - Not all values of height = L['x'].size()[2] {broken} (L['x'].size()[2] % 2) == 0.",
        "Suggested fixes:", "  _height = Dim('_height', min=1, max=oo)", "  height = 2*_height"])
    assert sorted(violations(message)) == ["batch", "height"]
    assert _unfixed(message, suggested_fixes(message)) == set()


def test_a_models_next_trace_names_the_dims_as_torch_suggested_on_its_first_and_is_traced_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two traces of one model (two graphs of its check) sharing what torch said: the first is
    rejected once and refined, the second names the dims so up front, torch takes them at once,
    and the program's inputs are those of the first."""
    model = PairedPatches()
    observer = InputObserver()
    with observer(model), torch.no_grad():
        model(torch.randn(3, 3, 16, 8), torch.zeros(6))
        model(torch.randn(4, 3, 12, 8), torch.zeros(10))
    shapes = ShapeModel.from_aligned(observer.aligned(), None, None)
    outcomes = export_outcomes(monkeypatch)
    capture = Capture(oblivious=False, learned=LearnedDims())  # torch.export's own sizes: it rejects the pairs
    exports, notes, inputs = [], [], []
    for call in (0, 1):
        outcomes.clear()
        notes.append([])
        program = trace(model, shapes, Example.of(shapes, shapes.call_leaves(call), True), True, notes[-1], None,
                        capture).program
        exports.append(outcomes[:])
        inputs.append([node.meta["val"].shape for node in program.graph.nodes if node.op == "placeholder"])
    assert exports == [["rejected", "taken"], ["taken"]]
    assert len(notes[0]) == 1 and notes[0][0].startswith("named dims refined with torch's suggested fixes: ")
    assert notes[1] == ["named dims as torch suggested on an earlier graph of the model: "
                        "_images_dim2 = Dim('_images_dim2', min=1, max=oo); images_dim2 = 2*_images_dim2; "
                        "_batch = Dim('_batch', max=oo); batch = 2*_batch"]
    assert [[str(size) for size in shape] for shape in inputs[1]] == [[str(size) for size in shape]
                                                                      for shape in inputs[0]]
    (images, labels) = inputs[1]
    assert str(images[2]).startswith("2*") and str(labels[0]).startswith("2*")  # the sides and labels in pairs
    assert [images[1], images[3]] == [3, 8]


class LargeEnough(torch.nn.Module):
    """Rejects images smaller than its kernel of 5 (a branch on the sides: torch takes sides from
    5 on only), then shifts each image by its ``shift``, of one value or a column of them."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 5)

    def forward(self, images: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        if images.shape[2] < 5 or images.shape[3] < 5:
            raise ValueError("images smaller than the kernel")
        return self.conv(images) + shift.reshape(-1, 1, 1, 1)


def test_the_families_of_a_models_calls_share_what_torch_said_of_its_dims(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls of two input structures (shifts of rank 1 and 2) are two families of the model, each
    with its graphs: torch rejects the named sides of the first family's only, the second names
    them as torch suggested there; both keep the same dynamic dims."""
    outcomes = export_outcomes(monkeypatch)
    store, model = SessionStore(), LargeEnough()
    with store.observe(model, "shifted", ObserveOptions(), "test_learned.py::test") as group, torch.no_grad():
        for batch, height, rank in ((2, 16, 1), (3, 12, 1), (2, 20, 2), (4, 8, 2)):
            model(torch.randn(batch, 3, height, 8 + batch), torch.randn(batch, *[1] * (rank - 1)))
    result = check_model(group, CheckSettings(export_dir=tmp_path, examples=2, hypothesis_seed=0, use_cache=False))
    assert result.verdict == "passed", result.reason
    assert [g.dims["images"] for g in result.graphs] == [{"0": "batch", "2": "height", "3": "width"}] * 2
    assert outcomes.count("rejected") == 1
    assert [n for g in result.graphs for n in g.notes if n.startswith("named dims")] == [
        "named dims refined with torch's suggested fixes: height = Dim('height', min=5); width = Dim('width', min=5)",
        "named dims as torch suggested on an earlier graph of the model: height = Dim('height', min=5); "
        "width = Dim('width', min=5)"]
