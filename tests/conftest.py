"""Fixtures shared by the test modules."""

from __future__ import annotations

import functools

import pytest

from models import tiny_llama_config


def pytest_configure(config: pytest.Config) -> None:
    """Import the exporter (torch.export, torch.onnx, onnxscript's torchlib, onnxruntime) once per
    process, before any test: pytester's fixture removes from ``sys.modules`` what its test
    imported, and a translation registry built from those modules would then mix two copies of
    them ("cannot translate aten.sym_size.int")."""
    from pytest_exportobs.core.vocabulary import Target
    from pytest_exportobs.engine.export.pipeline import prepare

    prepare((Target.ONNX,))


SESSION_TIMEOUT = 600
"""Seconds a pytester subprocess session may take unless its test says otherwise: a hung session
fails its test (pytester kills it) instead of holding the whole run until CI gives up."""


@pytest.fixture
def pytester(pytester: pytest.Pytester) -> pytest.Pytester:
    """pytest's own fixture, its subprocess sessions bounded by :data:`SESSION_TIMEOUT`."""
    pytester.runpytest_subprocess = functools.partial(  # type: ignore[method-assign]
        pytester.runpytest_subprocess, timeout=SESSION_TIMEOUT)
    return pytester


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """pytester sessions print whole lines (short summary lines are not cut)."""
    monkeypatch.setenv("COLUMNS", "400")


@pytest.fixture(autouse=True)
def checks_at_the_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """pytester sessions check their models at the end only: a check begun during the tests
    (``--export-overlap auto``) serves the end's from the cache when it finishes in time, which
    would make a first run's report depend on timing.  ``tests/plugin/test_overlap.py`` asks
    for it on its command lines, which come after these options."""
    monkeypatch.setenv("PYTEST_ADDOPTS", "--export-overlap=off")


@pytest.fixture(scope="module")
def tiny_llama():
    """A 2-layer LlamaForCausalLM with random weights (no download), in eval mode."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(tiny_llama_config()).eval()
