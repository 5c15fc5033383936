"""Dims as a torch ShapesSpec (torch >= 2.14): relations the exported program checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pytest_exportobs import InputObserver, ObserverError, make_dynamic_cache, register_flattening_functions
from pytest_exportobs.core.vocabulary import Target
from pytest_exportobs.engine.base.settings import CheckSettings
from pytest_exportobs.engine.check import check_model
from pytest_exportobs.observe.store import ObserveOptions, SessionStore
from pytest_exportobs.shapes.spec import spec_api

from models import tiny_llama_config

NEEDS_SPEC = pytest.mark.skipif(spec_api() is None, reason="torch.fx.experimental.dynamic_spec needs torch >= 2.14")


def step(batch: int, seq: int, past: int) -> dict[str, Any]:
    pairs = [(torch.randn(batch, 2, past, 16), torch.randn(batch, 2, past, 16))] * 2
    return {
        "input_ids": torch.randint(0, 100, (batch, seq)),
        "attention_mask": torch.ones(batch, past + seq, dtype=torch.int64),
        "past_key_values": make_dynamic_cache(pairs),
    }


@pytest.fixture(scope="module")
def llama() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(tiny_llama_config()).eval()


DECODE_STEPS = [(2, 3, 4), (3, 1, 6), (1, 4, 2), (2, 2, 7)]  # (batch, seq, past): a cache in every call


def observed(llama: torch.nn.Module, steps: list[tuple[int, int, int]] = DECODE_STEPS) -> InputObserver:
    observer = InputObserver()
    with observer(llama), torch.no_grad():
        for batch, seq, past in steps:
            llama(**step(batch, seq, past))
    return observer


@NEEDS_SPEC
@pytest.mark.parametrize("steps", [DECODE_STEPS, [(2, 3, 0), *DECODE_STEPS[1:]]], ids=["decode", "prefill-and-decode"])
def test_the_observer_gives_a_spec_whose_relation_the_program_checks(
    llama: torch.nn.Module, steps: list[tuple[int, int, int]]
) -> None:
    observer = observed(llama, steps)
    spec = observer.infer_dynamic_shapes(as_spec=True)
    with register_flattening_functions():  # the caches registered, transformers patched for export
        program = torch.export.export(llama, (), kwargs=observer.infer_arguments(), dynamic_shapes=spec)
        program.module()(**step(4, 2, 5))  # other sizes keeping total_seq = past_seq + seq
        with pytest.raises(RuntimeError, match="Runtime assertion failed"):
            broken = step(2, 3, 5)
            broken["attention_mask"] = torch.ones(2, 9, dtype=torch.int64)  # 5 + 3 is 8
            program.module()(**broken)


@pytest.mark.skipif(spec_api() is not None, reason="the error of an older torch")
def test_a_spec_on_an_older_torch_is_a_clear_error(llama: torch.nn.Module) -> None:
    with pytest.raises(ObserverError, match=r"as_spec=True needs torch >= 2.14 \(torch.fx.experimental.dynamic_spec\)"):
        observed(llama).infer_dynamic_shapes(as_spec=True)


@pytest.mark.slow
def test_the_engine_says_which_form_of_dims_torch_was_given(llama: torch.nn.Module, tmp_path: Path) -> None:
    store = SessionStore()
    with store.observe(llama, "llama", ObserveOptions(), "t") as group, torch.no_grad():
        for batch, seq, past in [(2, 3, 4), (3, 1, 6)]:
            llama(**step(batch, seq, past))
    result = check_model(group, CheckSettings(export_dir=tmp_path, examples=0, targets=(Target.TORCH,)))
    assert result.verdict == "passed", result.reason
    assert result.relations == ["total_seq = past_seq + seq"]
    graph = result.graphs[0]
    assert graph.dims_form == ("ShapesSpec" if spec_api() is not None else "Dim")
    if not graph.program_path:  # transformers 4.57 builds masks with an operator torch.export.save refuses
        assert any(note.startswith("the exported program was not saved (SerializeError") for note in graph.notes)
        return
    assert Path(graph.program_path) == tmp_path / "llama" / "model.pt2"
    with register_flattening_functions():
        program = torch.export.load(graph.program_path)
        program.module()(**step(4, 2, 5))
        if spec_api() is not None:
            assert "dims as a torch ShapesSpec: relations are checked by the exported program" in graph.notes
            broken = step(2, 3, 5)
            broken["attention_mask"] = torch.ones(2, 9, dtype=torch.int64)
            with pytest.raises(RuntimeError, match="Runtime assertion failed"):
                program.module()(**broken)
