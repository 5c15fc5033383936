"""Write a self-contained script that reruns a failing export stage on the failing inputs.

:func:`write_repro` fills one directory with ``repro.py``, ``weights.pt`` (the ``state_dict``),
``inputs.pt`` (the flat inputs of the failing call and their pytree spec) and, for a transformers
model, ``config.json``.  ``python repro.py``, from any directory, rebuilds the model and the call,
reruns the stage and exits with 1 when the failure reproduces.
"""

from __future__ import annotations

import functools
import inspect
import json
import pprint
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree

from ..core.trees import flattening_context, spec_children
from ..core.vocabulary import STAGES, Stage, Target
from ..shapes.model import ShapeModel
from .export.tracing import Capture
from .repro_script import EXECUTORCH_IMPORTS, FLOWS, FUNCTIONS, SCRIPT, Flow

# The stages a script can rerun: from torch.export to the variations.
REPRO_STAGES = STAGES[STAGES.index(Stage.TORCH_EXPORT) : STAGES.index(Stage.VARIATIONS) + 1]


@dataclass
class Repro:
    """The script written; ``note`` says plainly why it is not runnable as written."""

    path: str
    runnable: bool
    note: str = ""


@dataclass
class _Builder:
    """How ``build_model()`` makes the model: import lines, its body, why it cannot (``why_not``)."""

    imports: list[str] = field(default_factory=list)
    body: str = ""
    why_not: str = ""
    config: str | None = None  # the configuration (transformers, diffusers), saved as config.json


def write_repro(
    directory: Path, module: torch.nn.Module, shapes: ShapeModel, leaves: list[Any], *, stage: str,
    target: str, method: str, atol: float | None, rtol: float | None, capture: Capture | None = None,
    upper_bounds: Mapping[str, int] | None = None,
) -> Repro:
    """Write the repro of ``module`` failing at ``stage`` on the call made of ``leaves``, captured
    by torch.export as the check captured it (``None``: as torch.onnx.export captures first);
    ExecuTorch's repro bounds the dynamic dims by ``upper_bounds`` (by name)."""
    if stage not in REPRO_STAGES:
        raise ValueError(f"no repro for stage {stage!r}; stages are {REPRO_STAGES}")
    directory.mkdir(parents=True, exist_ok=True)
    builder = _builder(module)
    with flattening_context():
        flat, spec = _pytree.tree_flatten(shapes.aligned.split_arguments(leaves))
        saved = {"leaves": [_detached(v) for v in flat], "spec": _pytree.treespec_dumps(spec)}
        transformers = _uses_transformers(type(module), spec)
    torch.save(saved, directory / "inputs.pt")
    torch.save(module.state_dict(), directory / "weights.pt")
    if builder.config is not None:
        (directory / "config.json").write_text(builder.config)
    path = directory / "repro.py"
    # ExecuTorch's repro lowers even when torch.export failed: the dims are bounded there
    flow = Flow.TORCH_EXPORT if stage == Stage.TORCH_EXPORT and target != Target.EXECUTORCH else FLOWS[Target(target)]
    path.write_text(_script(module, shapes, builder, transformers, stage, flow, method, atol, rtol,
                            capture or Capture(), dict(upper_bounds or {})))
    note = (
        f"repro needs the model: {_class_name(type(module))} cannot be rebuilt automatically ({builder.why_not})"
        if builder.why_not else ""
    )
    return Repro(str(path), not builder.why_not, note)


def _script(
    module: torch.nn.Module, shapes: ShapeModel, builder: _Builder, transformers: bool, stage: str, flow: Flow,
    method: str, atol: float | None, rtol: float | None, capture: Capture, upper_bounds: dict[str, int],
) -> str:
    """The text of repro.py, with only the functions its flow needs."""
    constants = [f"SIZE_OBLIVIOUS, STRICT = {capture.oblivious}, {capture.strict}  # how the check captured the model"]
    if flow != Flow.TORCH_EXPORT:
        constants.append(f"ATOL, RTOL = {atol!r}, {rtol!r}  # None: pytest-exportobs' default for the dtype")
    if flow == Flow.EXECUTORCH:
        constants.append(f"UPPER_BOUNDS = {upper_bounds!r}  # the largest sizes ExecuTorch plans memory for")
    return SCRIPT.format(
        model=type(module).__qualname__, stage=stage,
        config_file=", config.json" if builder.config is not None else "",
        imports=_imports(flow, builder, transformers),
        dynamic_shapes=_literal(shapes.to_axis_names(), indent=len("DYNAMIC_SHAPES = ")),
        constants="\n".join(constants), build=builder.body, functions="\n".join(FUNCTIONS[flow]),
        method="" if method == "forward" else f"    model.forward = model.{method}  # the observed method\n",
        context="register_flattening_functions(), " if transformers else "export_patches(), ",
    )


def _imports(flow: Flow, builder: _Builder, transformers: bool) -> str:
    """Import lines grouped as isort does: standard, third party, the model's, pytest-exportobs."""
    standard = ["import json"] * (builder.config is not None) + ["import pathlib", "import sys"]
    third_party = ["import onnx", "import onnxruntime"] * (flow == Flow.ONNX) + [
        "import torch"] + EXECUTORCH_IMPORTS * (flow == Flow.EXECUTORCH) + ["from torch.utils import _pytree"]
    ours = [f"from pytest_exportobs import {'register_flattening_functions' if transformers else 'export_patches'}"] + [
        "from pytest_exportobs.engine.explore.localize import localize"] * (flow == Flow.ONNX) + [
        "from pytest_exportobs.engine.verify.compare import Tolerance, compare"] * (flow != Flow.TORCH_EXPORT)
    return "\n\n".join("\n".join(group) for group in (standard, third_party, builder.imports, ours) if group)


def _builder(module: torch.nn.Module) -> _Builder:
    """Rebuild from the configuration (transformers: ``cls(Config.from_dict(...))``, diffusers:
    ``cls.from_config(...)``), else with ``cls()``, else ask the user."""
    cls = type(module)
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "to_json_string") and hasattr(type(config), "from_dict"):
        why_not = _not_importable(cls) or _not_importable(type(config))
        return _manual_builder(cls, why_not) if why_not else _config_builder(cls, config)
    if isinstance(config, Mapping) and callable(getattr(cls, "from_config", None)):
        text, not_json = _json_text(config)
        why_not = _not_importable(cls) or not_json
        body = f'    return {cls.__qualname__}.from_config(json.loads((HERE / "config.json").read_text()))'
        return _manual_builder(cls, why_not) if why_not else _Builder(_import_lines(cls), body, config=text)
    why_not = _not_importable(cls) or _constructor_problem(cls, module)
    if why_not:
        return _manual_builder(cls, why_not)
    return _Builder(_import_lines(cls), f"    return {cls.__qualname__}()")


def _config_builder(cls: type, config: Any) -> _Builder:
    """``cls(ConfigClass.from_dict(...))`` with the attention implementation in use."""
    attention = getattr(config, "_attn_implementation", None)
    options = f", attn_implementation={attention!r}" if attention else ""
    body = (
        f'    config = {type(config).__qualname__}.from_dict(json.loads((HERE / "config.json").read_text()){options})\n'
        f"    return {cls.__qualname__}(config)"
    )
    return _Builder(_import_lines(type(config), cls), body, config=config.to_json_string(use_diff=False))


def _manual_builder(cls: type, why_not: str) -> _Builder:
    """A ``build_model()`` the user completes."""
    body = (
        f"    # repro needs the model: {_class_name(cls)} cannot be rebuilt automatically ({why_not})\n"
        '    raise NotImplementedError("build the model in build_model() of repro.py")'
    )
    return _Builder(body=body, why_not=why_not)


def _json_text(config: Mapping[str, Any]) -> tuple[str, str]:
    """The config as JSON text, and why it cannot be ('' when it can)."""
    try:
        return json.dumps(dict(config), indent=1), ""
    except (TypeError, ValueError) as e:
        return "", f"its config is not JSON: {e}"


def _not_importable(cls: type) -> str:
    """Why a fresh process cannot import ``cls`` ('' when it can)."""
    if cls.__module__ == "__main__":
        return "it is defined in __main__"
    if "<locals>" in cls.__qualname__:
        return "it is defined inside a function"
    if _resolve(cls.__module__, cls.__qualname__) is not cls:
        return f"it is not reachable as {_class_name(cls)}"
    try:
        inspect.getfile(cls)
    except TypeError:
        return f"its module {cls.__module__} has no source file"
    return ""


def _constructor_problem(cls: type, module: torch.nn.Module) -> str:
    """Why ``cls()`` does not build a model with ``module``'s parameters ('' when it does)."""
    signature = inspect.signature(cls)
    required = [
        name for name, p in signature.parameters.items()
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if required:
        return f"its constructor needs arguments: {', '.join(required)}"
    with torch.random.fork_rng(devices=[]):  # the constructor may draw random weights or seed
        try:
            built = cls()
        except Exception as e:  # whatever the user's constructor raises
            return f"{cls.__name__}() raises {type(e).__name__}"
    if _parameter_shapes(built) != _parameter_shapes(module):
        return f"{cls.__name__}() has other parameters than the observed instance, built with arguments"
    return ""


def _parameter_shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Shape of every entry of the ``state_dict``."""
    return {name: tuple(t.shape) for name, t in module.state_dict().items()}


def _import_lines(*classes: type) -> list[str]:
    """Lines importing ``classes`` by their qualified names (from the top-level package when
    exported there), after putting their source directories on ``sys.path`` when needed."""
    paths: list[str] = []
    names: dict[str, list[str]] = {}
    for cls in classes:
        package = cls.__module__.split(".")[0]
        source = package if _resolve(package, cls.__qualname__) is cls else cls.__module__
        names.setdefault(source, []).append(cls.__qualname__.split(".")[0])
        root = _source_root(cls)
        if root:
            paths.append(f"sys.path.insert(0, {root!r})  # where pytest imported {cls.__module__} from")
    imports = [f"from {source} import {', '.join(dict.fromkeys(heads))}" for source, heads in names.items()]
    return [*dict.fromkeys(paths), *imports]


def _source_root(cls: type) -> str | None:
    """The directory to put on ``sys.path`` to import ``cls``'s module; None in site-packages."""
    file = Path(inspect.getfile(cls)).resolve()
    if {"site-packages", "dist-packages"} & set(file.parts):
        return None
    return str(file.parents[cls.__module__.count(".") + (file.name == "__init__.py")])


def _resolve(module_name: str, qualname: str) -> Any:
    """The object at ``qualname`` in the already imported module ``module_name`` (None if absent)."""
    return functools.reduce(lambda obj, name: getattr(obj, name, None), qualname.split("."),
                            sys.modules.get(module_name))


def _uses_transformers(cls: type, spec: _pytree.TreeSpec) -> bool:
    """True when the model or a node of its inputs comes from transformers (caches need flattening)."""
    types = [*cls.__mro__, *_node_types(spec)]
    return any(t.__module__.split(".")[0] == "transformers" for t in types)


def _node_types(spec: _pytree.TreeSpec) -> list[type]:
    if spec.is_leaf():
        return []
    return [spec.type, *(t for child in spec_children(spec) for t in _node_types(child))]


def _literal(value: Any, indent: int) -> str:
    """``value`` as a Python literal whose continuation lines are indented by ``indent``."""
    return pprint.pformat(value, width=100 - indent, sort_dicts=False).replace("\n", "\n" + " " * indent)


def _detached(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
