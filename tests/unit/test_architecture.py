"""The package's layout: layers import only from below, no import cycle, small modules and functions.

Imports are read with ``ast`` from every module, those inside functions included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[2] / "pytest_exportobs"
# Bottom to top; a module may import from its own layer and the layers before it.
LAYERS = ("compat", "core", "observe", "shapes", "engine", "gate", "plugin", "api")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str) -> set[str]:
    """The package's modules imported by module ``name`` (anywhere in it)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            # ``from . import x``: the submodule x, else a name defined in the module ``base``
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names)
    return {m for m in found if m in MODULES and m != name}


def subpackage(name: str) -> str | None:
    """The layer a module belongs to; None for the package's top module and its top-level modules."""
    parts = name.split(".")
    if len(parts) == 1 or (len(parts) == 2 and MODULES[name].name != "__init__.py"):
        return None
    return parts[1]


def layer(name: str) -> int:
    """Index in LAYERS; the package's top module and its top-level modules (``python -m`` entry
    points) are façades above all of them."""
    found = subpackage(name)
    return LAYERS.index(found) if found is not None else len(LAYERS)


GRAPH = {name: imports_of(name) for name in MODULES}


def test_every_subpackage_is_a_declared_layer() -> None:
    subpackages = {subpackage(name) for name in MODULES} - {None}
    assert subpackages == set(LAYERS)


def test_layers_import_only_from_below() -> None:
    upward = [
        f"{name} -> {target}" for name, targets in GRAPH.items() for target in targets
        if layer(target) > layer(name)
    ]
    assert upward == []


def test_no_import_cycle() -> None:
    cycles: list[list[str]] = []
    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for target in sorted(GRAPH[name]):
            if state.get(target) == "open":
                cycles.append([*path[path.index(target):], target])
            elif target not in state:
                visit(target, [*path, target])
        state[name] = "done"

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])
    assert cycles == []


def test_the_graph_is_read() -> None:
    """The reader sees relative, absolute and function-level imports (a broken reader passes all)."""
    assert "pytest_exportobs.core.trees" in GRAPH["pytest_exportobs.observe.recorder"]
    assert "pytest_exportobs.engine.runner" in GRAPH["pytest_exportobs.plugin.roles"]  # inside a function
    assert "pytest_exportobs.shapes.model" in GRAPH["pytest_exportobs.api.observer"]
    assert "pytest_exportobs.gate.compare" in GRAPH["pytest_exportobs.compare"]


# The engine's rooms, in the order of its pipeline: each imports only from the rooms after it
# (its top-level modules — check, graph, planning, runner, repro — drive them all).
ENGINE_ROOMS = ("explore", "export", "verify", "base")


def engine_room(name: str) -> int:
    """Index in ENGINE_ROOMS; -1 for the engine's top-level modules."""
    parts = name.split(".")
    return ENGINE_ROOMS.index(parts[2]) if len(parts) > 3 and parts[2] in ENGINE_ROOMS else -1


def test_the_engines_rooms_import_only_from_the_rooms_below() -> None:
    engine = [name for name in MODULES if name.startswith("pytest_exportobs.engine.")]
    assert {name.split(".")[2] for name in engine if MODULES[name].name == "__init__.py"} == set(ENGINE_ROOMS)
    upward = [f"{name} -> {target}" for name in engine for target in GRAPH[name]
              if target.startswith("pytest_exportobs.engine") and engine_room(target) <= engine_room(name)
              and engine_room(name) >= 0 and engine_room(target) != engine_room(name)]
    assert upward == []
    assert engine_room("pytest_exportobs.engine.base.result") > engine_room("pytest_exportobs.engine.export.cache")


def test_top_level_modules_are_facades() -> None:
    assert layer("pytest_exportobs") == layer("pytest_exportobs.compare") == len(LAYERS)
    assert layer("pytest_exportobs.gate") == layer("pytest_exportobs.gate.compare") == LAYERS.index("gate")


def test_the_judge_decides_and_one_module_renders() -> None:
    """The gate's text (its terminal line, JSON, Markdown) is written in ``gate.render`` alone:
    the judge imports no renderer, and the report files take their text from it."""
    assert "pytest_exportobs.gate.render" not in GRAPH["pytest_exportobs.gate.judge"]
    assert "pytest_exportobs.gate.reports" not in GRAPH["pytest_exportobs.gate.judge"]
    assert "pytest_exportobs.gate.render" in GRAPH["pytest_exportobs.gate.reports"]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_and_function_sizes(name: str) -> None:
    text = MODULES[name].read_text()
    assert len(text.splitlines()) <= MAX_MODULE_LINES
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(text))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert long == []


def test_no_private_pytest_reports() -> None:
    users = [name for name in MODULES if "_pytest.reports" in MODULES[name].read_text()]
    assert users == []


def test_the_test_side_imports_none_of_the_export_machinery() -> None:
    """What a session imports to observe its tests (the plugin, its roles, the store) leaves
    torch.export's machinery out (dynamo, networkx: 400 modules whose objects every full garbage
    collection of the suite would walk); the checks import it."""
    import subprocess
    import sys

    heavy = ("torch._dynamo", "torch.export._trace", "networkx", "onnx", "onnxscript", "hypothesis")
    code = ("import sys, torch\n"
            "import pytest_exportobs.plugin, pytest_exportobs.plugin.roles, pytest_exportobs.observe.store\n"
            "import pytest_exportobs.observe.autoobserve\n"
            f"print(sorted(m for m in {heavy!r} if m in sys.modules))")
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert found.strip() == "[]"
