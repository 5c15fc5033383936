"""The verdict on the example suite (examples/, tests written as ML engineers write them): every
model's outcome in junitxml equals the expert's (examples/expectations.py), and every ONNX graph
of a passing model serves deployment inputs the tests never used.
"""

from __future__ import annotations

import importlib
import json
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils import _pytree

pytestmark = pytest.mark.slow  # the example suite's sessions

EXAMPLES = Path(__file__).parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
expectations = importlib.import_module("expectations")
sys.path.remove(str(EXAMPLES))


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The example project run once with the export check (no baseline: each verdict on its own): junitxml
    outcomes (the testcases of class ``exportobs``, one per model) and the JSON report."""
    project = tmp_path_factory.mktemp("examples")
    shutil.copytree(EXAMPLES, project, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns(".exportobs", "__pycache__", "export-baseline.json"))
    command = [
        sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--export-check", "--junitxml=junit.xml",
        "--export-report=report.json", "-q",
    ]
    completed = subprocess.run(command, cwd=project, capture_output=True, text=True, timeout=1800)
    report = json.loads((project / "report.json").read_text())
    sys.path.insert(0, str(project))
    yield {
        "outcomes": junit_outcomes(project / "junit.xml"), "models": {m["name"]: m for m in report["models"]},
        "stdout": completed.stdout, "project": project,
    }
    sys.path.remove(str(project))


def junit_outcomes(path: Path) -> dict[str, str]:
    outcomes = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        if case.get("classname") == "exportobs":
            failed = case.find("failure") is not None or case.find("error") is not None
            outcomes[case.get("name")] = (
                "failed" if failed else "skipped" if case.find("skipped") is not None else "passed")
    return outcomes


@pytest.mark.parametrize("name", sorted(expectations.EXPECTED))
def test_verdict_is_the_experts(session: dict[str, Any], name: str) -> None:
    expected, model = expectations.EXPECTED[name], session["models"][name]
    assert session["outcomes"][name] == expected.verdict, model["reason"]
    assert (model["verdict"], model["kind"]) == (expected.verdict, expected.kind), model["reason"]
    if expected.stages:
        assert model["stage"] in expected.stages, model["reason"]
    for graph in model["graphs"]:
        taken = set(graph["inputs"])
        missing = {
            leaf: sorted(set(axes) - {int(a) for a in graph["dims"].get(leaf, {})})
            for leaf, axes in expected.dynamic.items() if leaf in taken
        }
        assert {leaf: axes for leaf, axes in missing.items() if axes} == {}, graph["name"]
    assert set(expected.relations) <= set(model["relations"])


def test_every_observed_model_is_expected(session: dict[str, Any]) -> None:
    assert sorted(session["models"]) == sorted(expectations.EXPECTED)


@pytest.mark.parametrize("name", sorted(expectations.HELD_OUT))
def test_passing_graphs_serve_held_out_inputs(session: dict[str, Any], name: str) -> None:
    model_result = session["models"][name]
    if model_result["verdict"] != "passed":
        pytest.fail(f"{name} did not pass: {model_result['reason']}")
    model = expectations.BUILDERS[name]()
    from pytest_exportobs import register_flattening_functions

    with register_flattening_functions(), torch.no_grad():
        for call in expectations.HELD_OUT[name](model):
            call = cache_named_as_the_graphs(model_result["graphs"], call)
            graph = serving_graph(model_result["graphs"], call)
            call = {k: v for k, v in call.items() if any(i == k or i.startswith(f"{k}.") for i in graph["inputs"])}
            outputs = model(**_pytree.tree_map(_copy, call), **graph["constants"])
            expected = [t for t in _pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor)]
            names, tensors = flat_inputs(call)
            actual = run_onnx(session["project"] / graph["onnx_path"], dict(zip(names, tensors)), graph["inputs"])
            assert len(actual) == len(expected)
            for got, ref in zip(actual, expected):
                torch.testing.assert_close(torch.from_numpy(got), ref, atol=1e-4, rtol=1e-3)


def cache_named_as_the_graphs(graphs: list[dict[str, Any]], call: dict[str, Any]) -> dict[str, Any]:
    """The call with its cache under the name the graphs take it by: transformers 5.24's
    generate() passes ``cache``, a test's own call may still pass ``past_key_values``."""
    names = {name.split(".")[0] for g in graphs for name in g["inputs"]}
    for old, new in (("past_key_values", "cache"), ("cache", "past_key_values")):
        if old in call and old not in names and new in names:
            call = {new if key == old else key: value for key, value in call.items()}
    return call


def serving_graph(graphs: list[dict[str, Any]], call: dict[str, Any]) -> dict[str, Any]:
    """The graph taking the most of the call's inputs, and none it lacks."""
    names = set(flat_inputs(call)[0])
    serving = [g for g in graphs if set(g["inputs"]) <= names]
    assert serving, f"no graph takes some of {sorted(names)}: {[g['inputs'] for g in graphs]}"
    return max(serving, key=lambda g: len(g["inputs"]))


def flat_inputs(call: dict[str, Any]) -> tuple[list[str], list[torch.Tensor]]:
    """Leaf names as the plugin spells them (``past_key_values.key_0``) and the tensors."""
    paths, _ = _pytree.tree_flatten_with_path(call)
    names = [".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
             for path, _ in paths]
    return names, [value for _, value in paths]


def run_onnx(path: Path, feeds: dict[str, torch.Tensor], order: list[str]) -> list[Any]:
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    inputs = [i.name for i in session.get_inputs()]
    return session.run(None, {onnx: feeds[leaf].numpy() for onnx, leaf in zip(inputs, order)})


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value
