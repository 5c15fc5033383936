"""The kept models' weights on disk while forked checks run."""

from __future__ import annotations

from pathlib import Path

import torch

from pytest_exportobs.engine import runner
from pytest_exportobs.engine.base.settings import CheckSettings
from pytest_exportobs.engine.spilled import SpilledWeights
from pytest_exportobs.observe.store import ModelGroup, ObserveOptions, SessionStore
from pytest_exportobs.observe.weights import weights_digest

from models import MLP, TiedHead


def observed(module: torch.nn.Module, name: str, *calls: tuple) -> ModelGroup:
    store = SessionStore()
    with torch.no_grad(), store.observe(module, name, ObserveOptions(), f"test_spilled.py::{name}") as group:
        for args in calls:
            module(*args)
    return group


def stored_bytes(module: torch.nn.Module) -> int:
    return sum(t.untyped_storage().nbytes() for t in (*module.parameters(), *module.buffers()))


def test_spilled_weights_leave_one_element_stand_ins_and_come_back_the_same(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TiedHead().eval()
    group = observed(model, "tied", (torch.randint(0, 50, (2, 5)),))
    values = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    digest, versions = weights_digest(model), [p._version for p in model.parameters()]
    spilled = SpilledWeights.spill([group], tmp_path)
    assert spilled is not None and spilled.directory.parent == tmp_path
    assert [path.name for path in spilled.directory.iterdir()] == ["0.pt"]
    assert stored_bytes(model) == 2 * 4  # the tied weight and the buffer, one float each
    assert [tuple(p.shape) for p in model.parameters()] == [(50, 16)] and model.scale.shape == (16,)
    assert all(t.untyped_storage().nbytes() == 4 for t in group.weights.values())
    spilled.remove()
    assert not spilled.directory.exists()
    assert model.state_dict().keys() == values.keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, values[name]), name
    assert weights_digest(model) == digest and [p._version for p in model.parameters()] == versions
    assert model.head.weight is model.embed.weight
    assert group.weights["head.weight"].data_ptr() == group.weights["embed.weight"].data_ptr()


def test_a_child_restores_its_own_groups_weights_only(tmp_path: Path) -> None:
    torch.manual_seed(0)
    first, second = (observed(MLP().eval(), f"mlp{i}", (torch.randn(2, 8),)) for i in range(2))
    values = {name: tensor.clone() for name, tensor in first.module.state_dict().items()}
    spilled = SpilledWeights.spill([first, second], tmp_path)
    assert spilled is not None
    spilled.restore(first)
    assert all(torch.equal(t, values[name]) for name, t in first.module.state_dict().items())
    assert all(t.untyped_storage().nbytes() == 4 for t in second.module.parameters())
    spilled.remove()
    assert all(t.untyped_storage().nbytes() > 4 for t in second.module.parameters())


def test_nothing_is_spilled_when_the_file_cannot_be_written(tmp_path: Path) -> None:
    group = observed(MLP().eval(), "mlp", (torch.randn(2, 8),))
    before = stored_bytes(group.module)
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert SpilledWeights.spill([group], blocked / "below") is None
    assert stored_bytes(group.module) == before


def test_forked_checks_run_on_the_weights_restored_in_each_child_and_the_parent_gets_them_back(
        tmp_path: Path) -> None:
    """The children verify against the recorded outputs (the weights a child restores are those
    the calls were made with: no reference recomputed), the parent's models hold their values
    again afterwards, and the file is gone."""
    torch.manual_seed(0)
    groups = [observed(MLP().eval(), f"mlp{i}", (torch.randn(2, 8),), (torch.randn(5, 8),)) for i in range(2)]
    values = [{name: t.clone() for name, t in g.module.state_dict().items()} for g in groups]
    results = list(runner.check_all(groups, CheckSettings(export_dir=tmp_path, examples=0), isolate=True, jobs=2))
    assert sorted((r.name, r.verdict, r.reference) for r in results) == [
        ("mlp0", "passed", "recorded"), ("mlp1", "passed", "recorded")]
    for group, before in zip(groups, values):
        for name, tensor in group.module.state_dict().items():
            assert torch.equal(tensor, before[name]), name
    assert not list(tmp_path.glob("weights-*"))


def test_the_parent_gets_a_groups_weights_back_as_soon_as_its_check_is_over(tmp_path: Path) -> None:
    """Not once every check is: the first result comes with its model's values, while the model
    whose result has not come yet still holds its stand-ins."""
    torch.manual_seed(0)
    groups = {f"mlp{i}": observed(MLP().eval(), f"mlp{i}", (torch.randn(2, 8),), (torch.randn(5, 8),))
              for i in range(2)}
    values = {name: {key: t.clone() for key, t in g.module.state_dict().items()} for name, g in groups.items()}
    results = runner.check_all(list(groups.values()), CheckSettings(export_dir=tmp_path, examples=0), isolate=True,
                               jobs=2)
    first = next(results)
    second = next(name for name in groups if name != first.name)
    assert all(torch.equal(t, values[first.name][key]) for key, t in groups[first.name].module.state_dict().items())
    assert stored_bytes(groups[second].module) == 4 * len(list(groups[second].module.parameters()))
    assert [r.name for r in results] == [second]
    assert all(torch.equal(t, values[second][key]) for key, t in groups[second].module.state_dict().items())
    assert not list(tmp_path.glob("weights-*"))


def test_a_group_released_after_its_check_holds_stand_ins_again_and_its_values_on_the_next_restore(
        tmp_path: Path) -> None:
    """A child checking several groups in turn: each group's weights mapped for its check only."""
    torch.manual_seed(0)
    models = [TiedHead().eval(), MLP().eval()]
    groups = [observed(models[0], "tied", (torch.randint(0, 50, (2, 5)),)),
              observed(models[1], "mlp", (torch.randn(2, 8),))]
    values = [{name: tensor.clone() for name, tensor in model.state_dict().items()} for model in models]
    spilled = SpilledWeights.spill(groups, tmp_path)
    assert spilled is not None
    spilled.restore(groups[0])
    assert stored_bytes(models[0]) > 2 * 4 and stored_bytes(models[1]) == 4 * len(list(models[1].parameters()))
    spilled.release(groups[0])
    spilled.restore(groups[1])
    assert stored_bytes(models[0]) == 2 * 4 and stored_bytes(models[1]) > 4 * len(list(models[1].parameters()))
    spilled.remove()
    for model, before in zip(models, values, strict=True):
        assert all(torch.equal(tensor, before[name]) for name, tensor in model.state_dict().items())
