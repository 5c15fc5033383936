"""What torch.export's runtime asserts say about a dim's domain (engine.domain)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sympy
import torch

from pytest_exportobs import InputObserver, ShapeModel
from pytest_exportobs.core.vocabulary import RefinementKind
from pytest_exportobs.engine.base.eager import call_model
from pytest_exportobs.engine.explore.variations import explore
from pytest_exportobs.engine.export.domain import Refinement, _asserted_divisor, conditions, expression, satisfied
from pytest_exportobs.engine.export.integers import integer_value
from pytest_exportobs.engine.export.pipeline import export_model
from pytest_exportobs.engine.verify.compare import Tolerance
from pytest_exportobs.shapes.inference import DimPolicy

from models import AttentionMaps

s, b = sympy.Symbol("s76", integer=True, positive=True), sympy.Symbol("s6", integer=True, positive=True)
floor = sympy.floor


@pytest.mark.parametrize(("asserts", "divisor"), [
    # a stride-2 layer whose output is added to its input (a UNet's skip connection)
    ([sympy.Eq(s, 2 * floor((s - 1) / 2) + 2)], 2),
    # two of them, and a lower bound
    ([sympy.Eq(sympy.Mod(s, 4), 0), s >= 16], 4),
    # a lower bound alone
    ([s >= 60], None),
    # wav2vec2's feature encoder (strides 5, 2, 2): a few lengths excluded, any other allowed
    ([sympy.Ne(b * (floor(s / 5) - 1), 1), b * (floor(s / 20) - 1) >= 0, sympy.Ne(floor(s / 20), 2)], None),
    # nothing on this dim alone
    ([sympy.Ne(b * s, 1)], None),
], ids=["skip-connection", "two-strides-and-a-bound", "lower-bound", "wav2vec2", "other-dims"])
def test_only_a_periodic_assert_restricts_a_dim_to_multiples(asserts: list[sympy.Basic], divisor: int | None) -> None:
    assert _asserted_divisor(s, asserts) == divisor


def test_a_refinement_is_kept_in_the_export_cache_as_a_plain_list() -> None:
    merge = Refinement(RefinementKind.MERGE, "y_dim0", "x_dim0")
    assert json.dumps(merge.to_json()) == '["merge", "y_dim0", "x_dim0"]'
    assert Refinement.from_json(json.loads(json.dumps(merge.to_json()))) == merge
    assert Refinement.from_json(["scale", "height", 2]) == Refinement(RefinementKind.SCALE, "height", 2)
    split = Refinement(RefinementKind.SPLIT, "past_seq", 4095, ((2, 2), (3, 2)))
    assert json.dumps(split.to_json()) == '["split", "past_seq", 4095, [[2, 2], [3, 2]]]'
    assert Refinement.from_json(json.loads(json.dumps(split.to_json()))) == split
    with pytest.raises(ValueError):
        Refinement.from_json(["halve", "height", 2])  # a cache entry of another vocabulary: not read


class PatchGrid(torch.nn.Module):
    """A vision encoder made for 20x20 images: a grid of 4x4 patches of 5 pixels, each with its
    position.  In eager a 5x5 image (one patch) broadcasts over the 16 positions; the export
    asserts 16 patches."""

    def __init__(self) -> None:
        super().__init__()
        self.patches = torch.nn.Conv2d(3, 8, kernel_size=5, stride=5)
        self.positions = torch.nn.Parameter(torch.randn(1, 16, 8))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        embeddings = self.patches(pixel_values).flatten(2).transpose(1, 2) + self.positions
        return embeddings.softmax(-1).mean(1)


def test_a_runtime_assert_the_shape_model_does_not_imply_is_kept_as_a_condition_on_variables(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = PatchGrid().eval()
    observer = InputObserver()
    with observer(model), torch.no_grad():
        for batch in (2, 3):
            model(torch.randn(batch, 3, 20, 20))
    shapes = ShapeModel.from_aligned(observer.aligned(), policy=DimPolicy(roles=True))
    assert [v.name for v in shapes.variables] == ["batch", "height", "width"]
    outcome = export_model(model, shapes, "torch", tmp_path / "model.onnx")
    assert outcome.ok, outcome.reason

    asserted = [r for r in outcome.refinements if r.kind == RefinementKind.ASSERT]
    found = conditions(asserted)
    assert "Eq(((height//5))*((width//5)), 16)" in map(str, found)  # the grid; not torch's Ne(batch, 1)
    assert not any(c.free_symbols == {sympy.Symbol("batch", integer=True)} for c in found)
    assert conditions([Refinement.from_json(json.loads(json.dumps(r.to_json()))) for r in asserted]) == found
    assert satisfied(found, {"batch": 3, "height": 24, "width": 20})
    assert not satisfied(found, {"batch": 3, "height": 5, "width": 5})  # eager broadcasts one patch
    assert model(torch.randn(3, 3, 5, 5)).shape == (3, 8)
    # torch 2.15 also asserts height >= 5 and width >= 5, the kernel's size
    (note,) = [note for note in outcome.notes if note.startswith("torch.export asserts ")]
    assert "Eq(((height//5))*((width//5)), 16)" in note and "&" not in note


def test_an_example_outside_the_conditions_is_invalid_whatever_eager_makes_of_it(tmp_path: Path) -> None:
    """Eager takes the 5x5 to 9x9 images (one patch) the export does not serve: with the grid's
    condition those examples are invalid, not failures."""
    torch.manual_seed(0)
    model = PatchGrid().eval()
    observer = InputObserver()
    with observer(model), torch.no_grad():
        for size in (20, 24):
            model(torch.randn(2, 3, size, size))
    shapes = ShapeModel.from_aligned(observer.aligned())  # what the calls vary: the side of square images
    (side,) = [v.name for v in shapes.variables]
    grid = expression(json.dumps(["Equality", ["Pow", ["FloorDiv", ["Symbol", side], 5], 2], 16]))

    def eager(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        with torch.no_grad():
            return [call_model(model, *leaves)]

    def graph(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        if (leaves[0].shape[2] // 5) ** 2 != 16:
            raise RuntimeError("MatMul dimension mismatch")  # what onnxruntime said of Siglip's graph there
        return eager(leaves)

    found = {}
    for asserted in ([], [grid]):
        found[len(asserted)] = explore(eager=eager, run=graph, shapes=shapes, tolerance=Tolerance(), examples=40,
                                       seed=0, database_dir=tmp_path, asserted=asserted)
    assert found[0].failed and (found[0].failing_sizes[side] // 5) ** 2 != 16  # off the grid
    assert not found[1].failed and found[1].valid > 0


def test_a_condition_sympy_cannot_decide_at_some_sizes_excludes_none_of_them() -> None:
    frames = expression(json.dumps(["Equality", ["FloorDiv", 6, ["Symbol", "frames"]], 2]))
    assert satisfied([frames], {"frames": 3}) and not satisfied([frames], {"frames": 4})
    assert satisfied([frames], {"frames": 0})  # 6 // 0: undecided, not a size outside the domain
    assert satisfied([frames], {"batch": 4})  # a condition on a variable the sizes lack


def _sympy_holds(condition: sympy.Basic, sizes: dict[str, int]) -> bool:
    """What sympy makes of ``condition`` at ``sizes`` (an undecided one excludes nothing)."""
    try:
        return bool(condition.xreplace({v: sympy.Integer(sizes[str(v)]) for v in condition.free_symbols}))
    except (TypeError, ZeroDivisionError):
        return True


@pytest.mark.parametrize("tree", [
    ["Equality", ["Mul", ["FloorDiv", ["Symbol", "height"], 5], ["FloorDiv", ["Symbol", "width"], 5]], 16],
    ["And", ["GreaterThan", ["FloorDiv", ["Add", ["Symbol", "height"], -1], 4], 7],
     ["GreaterThan", ["Symbol", "width"], 29]],
    ["Equality", ["Mod", ["Symbol", "height"], 16], 0],
    ["Equality", ["PythonMod", ["Add", ["Symbol", "width"], -3], 7], 0],
    ["Or", ["Equality", ["Symbol", "height"], ["Symbol", "width"]],
     ["StrictLessThan", ["Max", ["Symbol", "height"], 9], 12]],
    ["Unequality", ["Pow", ["Symbol", "height"], 2], 256],
    ["Not", ["Equality", ["CleanDiv", ["Mul", 4, ["Symbol", "width"]], 4], 3]],
    ["Equality", ["FloorDiv", 6, ["Symbol", "width"]], 2],
], ids=["patch-grid", "bounds", "multiple", "python-mod", "or-max", "power", "not-clean-div", "divided-by-size"])
def test_a_condition_computed_on_integers_says_what_sympy_says_at_every_size(tree: list) -> None:
    condition = expression(json.dumps(tree))
    for height in range(0, 40):
        for width in (0, 1, 3, 5, 12, 29, 30, 31, 35):
            sizes = {"height": height, "width": width}
            assert satisfied([condition], sizes) == _sympy_holds(condition, sizes), sizes



def test_the_outputs_elements_are_read_from_the_program_as_a_function_of_the_variables(tmp_path: Path) -> None:
    """tokens: batch x seq x 16, maps: batch x 8 x seq x seq."""
    model = AttentionMaps().eval()
    observer = InputObserver()
    with observer(model), torch.no_grad():
        for batch, seq in ((2, 5), (3, 7)):
            model(torch.randn(batch, seq, 16))
    shapes = ShapeModel.from_aligned(observer.aligned(), dim_names={"tokens:0": "batch", "tokens:1": "seq"})
    outcome = export_model(model, shapes, "torch", tmp_path / "model.pt2")
    assert outcome.ok, outcome.reason
    batch, seq = sympy.symbols("batch seq", integer=True)
    assert expression(outcome.output_elements) == 16 * batch * seq + 8 * batch * seq**2
    assert integer_value(expression(outcome.output_elements), {"batch": 3, "seq": 7}) == 16 * 21 + 8 * 3 * 49
    assert integer_value(expression(outcome.output_elements), {"batch": 3}) is None  # seq unknown
