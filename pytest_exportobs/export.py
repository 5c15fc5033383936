"""Export one module to ONNX through explicit, separately timed stages.

``torch.export`` → decompositions → ONNX translation → ``onnx.checker`` (ORT loading is the
verifier's first step).  Every failure becomes an :class:`ExportOutcome` naming the stage, the
exception type and a one-line reason; nothing raises.  A content-addressed cache in the export
directory skips capture and translation when nothing that matters changed.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import os
import re
import shutil
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .results import first_line
from .shapes import ShapeModel

PACKAGE_DIR = str(Path(__file__).parent)


@dataclass
class ExportSettings:
    """How to export: ``target`` ``onnx`` (translate) or ``torch`` (stop after torch.export)."""

    target: str = "onnx"
    cache_dir: Path | None = None
    fingerprint_extra: tuple[str, ...] = ()


@dataclass
class ExportOutcome:
    """Result of the export stages; ``stage`` is the failing stage, or the last one done."""

    ok: bool
    stage: str
    error_type: str = ""
    reason: str = ""
    traceback: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    program: Any = None
    onnx_path: str = ""
    cache_hit: bool = False
    opset: int | None = None
    op_counts: dict[str, int] = field(default_factory=dict)
    bound: bool = False  # the exported module is a BoundConstants: its inputs are tensors only
    equalities: list[tuple[str, str]] = field(default_factory=list)  # dims torch found equal


class StageFailed(Exception):
    """Raised inside :class:`Stages` to stop at the failing stage."""


class Stages:
    """Times named stages and turns the first exception into a failing outcome."""

    def __init__(self, outcome: ExportOutcome):
        self.outcome = outcome

    @contextlib.contextmanager
    def run(self, name: str) -> Iterator[None]:
        self.outcome.stage = name
        begin = time.perf_counter()
        try:
            yield
        except Exception as e:
            self.outcome.ok = False
            self.outcome.error_type = type(e).__name__
            self.outcome.reason = one_line_reason(name, e)
            self.outcome.traceback = "".join(traceback.format_exception(e))
            raise StageFailed(name) from e
        finally:
            self.outcome.timings[name] = self.outcome.timings.get(name, 0.0) + time.perf_counter() - begin


def export_model(
    module: torch.nn.Module, shapes: ShapeModel, settings: ExportSettings, onnx_path: Path | None = None,
    method: str = "forward",
) -> ExportOutcome:
    """Export ``module.<method>`` called on ``shapes``' example inputs with its dynamic dimensions."""
    outcome = ExportOutcome(ok=True, stage="torch.export")
    stages = Stages(outcome)
    exported = bind_constants(module, method, shapes.aligned)
    outcome.bound = exported is not module
    leaves, small = _example(getattr(module, method), shapes, outcome)
    args, kwargs = shapes.aligned.split_arguments(leaves, constants=not outcome.bound)
    key = None
    if settings.target == "onnx" and settings.cache_dir is not None and onnx_path is not None:
        key = fingerprint(module, shapes, args, kwargs, settings)
        if _load_cached(settings.cache_dir, key, onnx_path, outcome):
            return outcome
    try:
        with stages.run("torch.export"):
            program = _torch_export(exported, shapes, args, kwargs, small, outcome)
        outcome.program = program
        if settings.target == "torch":
            return outcome
        with stages.run("decompose"):
            program = _decompose(program)
        with stages.run("onnx-translate"):
            onnx_program = _translate(program)
            _rename_axes(onnx_program, shapes)
            assert onnx_path is not None
            onnx_path.parent.mkdir(parents=True, exist_ok=True)
            onnx_program.save(str(onnx_path))
        with stages.run("onnx-checker"):
            _check_onnx(onnx_path, outcome)
        outcome.onnx_path = str(onnx_path)
        if key is not None:
            _store_cached(settings.cache_dir, key, onnx_path, outcome)
    except StageFailed:
        pass
    return outcome


class BoundConstants(torch.nn.Module):
    """``module.<method>`` with the calls' constant arguments bound: torch.export then sees tensor
    inputs only, under a plain signature (it cannot take a constant collected by ``**kwargs``,
    as transformers' ``return_dict``)."""

    def __init__(self, module: torch.nn.Module, method: str, constants: dict[str, Any]):
        super().__init__()
        self.module = module
        self.method = method
        self.constants = constants

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.module, self.method)(*args, **kwargs, **self.constants)


def bind_constants(module: torch.nn.Module, method: str, aligned: Any) -> torch.nn.Module:
    """``module`` itself when its ``forward`` takes the recorded tensors as they are, else a
    :class:`BoundConstants` whose ``forward`` signature names the tensor arguments."""
    if method == "forward" and not aligned.constants() and not any(s.var_keyword for s in aligned.slots):
        return module
    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    for slot in aligned.slots:
        if slot.is_constant:
            continue
        if slot.var_positional:
            parameters.append(inspect.Parameter(slot.name, inspect.Parameter.VAR_POSITIONAL))
            kind = inspect.Parameter.KEYWORD_ONLY
        else:
            parameters.append(inspect.Parameter(slot.name, kind))

    def forward(self: BoundConstants, *args: Any, **kwargs: Any) -> Any:
        return BoundConstants.forward(self, *args, **kwargs)

    forward.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    bound_class = type(f"Bound{type(module).__name__}", (BoundConstants,), {"forward": forward})
    return bound_class(module, method, aligned.constants())


def _example(call: Any, shapes: ShapeModel, outcome: ExportOutcome) -> tuple[list[Any], list[str]]:
    """Example leaves and the dims that are still 0 or 1 in them.

    A recorded call with every dynamic size >= 2, else synthesized inputs (checked by running
    the module eagerly), else the richest recorded call, exported size-oblivious.
    """
    index = shapes.safe_call()
    if index is None:
        from .observer import detached_clone

        leaves = shapes.example_leaves()
        args, kwargs = detached_clone(shapes.aligned.split_arguments(leaves))  # the call grows caches in place
        try:
            with torch.no_grad():
                call(*args, **kwargs)
        except Exception as e:
            outcome.notes.append(f"synthesized example rejected by eager ({type(e).__name__}); using a recorded call")
        else:
            outcome.notes.append("no recorded call has every dynamic size >= 2: exported on synthesized inputs")
            return leaves, []
        index = shapes.aligned.complete_call()
    small = shapes.small_variables(index)
    if small:
        outcome.notes.append(f"dims {', '.join(small)} are 0 or 1 in the example: exported size-oblivious")
    return shapes.call_leaves(index), small


def _torch_export(
    module: torch.nn.Module, shapes: ShapeModel, args: tuple, kwargs: dict, small: list[str], outcome: ExportOutcome
) -> torch.export.ExportedProgram:
    """``torch.export.export`` with named dims; falls back to independent ``Dim.DYNAMIC`` when
    torch rejects a relation, and captures size-oblivious when a dynamic size is 0 or 1."""
    config = (
        torch.fx.experimental._config.patch(backed_size_oblivious=True) if small else contextlib.nullcontext()
    )
    constants = not isinstance(module, BoundConstants)
    named = shapes.to_dynamic_shapes(named=True, constants=constants)
    with config:
        try:
            return torch.export.export(module, args, kwargs, dynamic_shapes=named)
        except torch._dynamo.exc.UserError as e:
            if "Constraints violated" not in str(e):
                raise
            rejection = e
        try:  # torch's suggested fixes: derived dims (total = past + seq), ranges (seq <= 128)
            refined = torch.export.dynamic_shapes.refine_dynamic_shapes_from_suggested_fixes(rejection.msg, named)
            program = torch.export.export(module, args, kwargs, dynamic_shapes=refined)
        except Exception:
            outcome.notes.append(
                f"torch.export rejected the named dims ({first_line(str(rejection))}): "
                "exported with independent Dim.DYNAMIC dims"
            )
            return torch.export.export(module, args, kwargs, dynamic_shapes=shapes.to_dynamic_shapes(constants=constants))
        fixes = _suggested_fixes(rejection.msg)
        outcome.notes.append(f"named dims refined with torch's suggested fixes: {'; '.join(fixes) or 'none listed'}")
        outcome.equalities = [
            (left.strip(), right.strip()) for left, _, right in (fix.partition("=") for fix in fixes)
            if right.strip().isidentifier()
        ]
        return program


def _suggested_fixes(message: str) -> list[str]:
    """The ``name = expression`` lines torch suggests after 'Suggested fixes:'."""
    fixes = message.partition("Suggested fixes:")[2]
    return [line.strip() for line in fixes.splitlines() if "=" in line]


# The two steps ``torch.onnx.export(exported_program)`` runs, called apart so that each is timed
# and reported on its own, with one torchlib registry per process.
@functools.cache
def _registry() -> Any:
    from torch.onnx._internal.exporter import _registration

    return _registration.ONNXRegistry.from_torchlib()


def _decompose(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    from torch.onnx._internal.exporter import _core

    return _core._prepare_exported_program_for_export(program, registry=_registry())


def _translate(program: torch.export.ExportedProgram) -> Any:
    from torch.onnx._internal.exporter import _core

    onnx_program = _core._exported_program_to_onnx_program(program, registry=_registry())
    onnx_program.optimize()
    return onnx_program


def _rename_axes(onnx_program: Any, shapes: ShapeModel) -> None:
    """Name the symbolic dims of the ONNX inputs (and through them the outputs) after the variables."""
    inputs = onnx_program.model.graph.inputs
    tensor_axes = [
        axes for axes, value in zip(shapes.leaf_axes(), shapes.aligned.calls[shapes.aligned.complete_call()])
        if value is None or isinstance(value, torch.Tensor)
    ]
    mapping: dict[str, str] = {}
    for value, axes in zip(inputs, tensor_axes):
        for dim, name in axes.items():
            symbol = value.shape[dim] if value.shape is not None else None
            if symbol is not None and not isinstance(symbol, int) and str(symbol) not in mapping:
                mapping.setdefault(str(symbol), name)
    if mapping:
        onnx_program.rename_axes(mapping)


def _check_onnx(path: Path, outcome: ExportOutcome) -> None:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    onnx.checker.check_model(str(path))
    outcome.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    outcome.op_counts = dict(sorted(Counter(n.op_type for n in model.graph.node).items()))


# -- reasons ------------------------------------------------------------------------------------
def one_line_reason(stage: str, error: BaseException) -> str:
    """A single line a user can act on: the message's first line, the unsupported ops of an ONNX
    translation failure, and the user source line where torch.export failed."""
    message = first_line(str(error)) or type(error).__name__
    if stage in ("decompose", "onnx-translate"):
        ops = unsupported_ops(str(error))
        if ops:
            return f"no ONNX translation for {', '.join(ops)}"
    location = user_frame(error)
    return f"{type(error).__name__}: {message}" + (f" (at {location})" if location else "")


def unsupported_ops(message: str) -> list[str]:
    """Operator names mentioned by a translation error next to 'No ONNX function' / 'unsupported'."""
    ops: list[str] = []
    for line in message.splitlines():
        if re.search(r"no onnx function|unsupported|not supported|dispatch", line, re.IGNORECASE):
            ops.extend(m for m in re.findall(r"\b[a-z_]+(?:::|\.)[a-zA-Z_]\w*(?:\.\w+)?", line) if "aten" in m or "::" in m)
    return sorted(set(ops))


def user_frame(error: BaseException) -> str:
    """``file:line: code`` of the innermost frame of user code (outside torch, site-packages, us)."""
    frames = traceback.extract_tb(error.__traceback__)
    for cause in (error.__cause__, error.__context__):
        if cause is not None:
            frames = frames + traceback.extract_tb(cause.__traceback__)
    user = [
        f for f in frames
        if "site-packages" not in f.filename and not f.filename.startswith(PACKAGE_DIR)
        and "/torch/" not in f.filename and not f.filename.startswith("<")
    ]
    if not user:
        found = re.findall(r'File "([^"]+)", line (\d+)', str(error))
        user_paths = [(p, n) for p, n in found if "site-packages" not in p and "/torch/" not in p]
        return f"{_short(user_paths[-1][0])}:{user_paths[-1][1]}" if user_paths else ""
    frame = user[-1]
    return f"{_short(frame.filename)}:{frame.lineno}" + (f": {frame.line.strip()}" if frame.line else "")


def _short(path: str) -> str:
    try:
        return os.path.relpath(path)
    except ValueError:
        return path


# -- cache --------------------------------------------------------------------------------------
def fingerprint(
    module: torch.nn.Module, shapes: ShapeModel, args: tuple, kwargs: dict, settings: ExportSettings
) -> str:
    """Hash of what the ONNX file depends on: the source files of the model's classes, its
    weights, shapes, package versions and patches.  Code paths chosen by environment variables
    or global state are not seen (verification still runs on every hit)."""
    digest = hashlib.sha256()
    for source in _source_files(module):
        digest.update(source.encode())
    for name, tensor in (*module.named_parameters(), *module.named_buffers()):
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    digest.update(json.dumps(shapes.to_json(), sort_keys=True).encode())
    leaves = torch.utils._pytree.tree_leaves((args, kwargs))
    digest.update(repr([(t.dtype, tuple(t.shape)) if isinstance(t, torch.Tensor) else t for t in leaves]).encode())
    digest.update(json.dumps([_versions(), list(settings.fingerprint_extra)]).encode())
    return digest.hexdigest()[:32]


def _source_files(module: torch.nn.Module) -> list[str]:
    """Text of the files defining the classes of the module and its submodules (outside torch)."""
    classes = {cls for sub in module.modules() for cls in type(sub).__mro__}
    texts = {}
    for cls in classes:
        if cls.__module__.startswith(("torch.", "builtins")) or cls is object:
            continue
        try:
            path = inspect.getsourcefile(cls)
            texts[path] = Path(path).read_text() if path else cls.__qualname__
        except (OSError, TypeError):
            texts[cls.__qualname__] = f"{cls.__module__}.{cls.__qualname__}"
    return [texts[k] for k in sorted(texts, key=str)]


def _versions() -> dict[str, str]:
    import onnx
    import onnxruntime
    import onnxscript

    return {"torch": torch.__version__, "onnx": onnx.__version__, "onnxscript": onnxscript.__version__,
            "onnxruntime": onnxruntime.__version__}


def _file_digest(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _load_cached(cache_dir: Path, key: str, onnx_path: Path, outcome: ExportOutcome) -> bool:
    """Reuse a cache entry whose metadata and file digest agree; anything else is a miss."""
    entry, meta_path = cache_dir / f"{key}.onnx", cache_dir / f"{key}.json"
    try:
        meta = json.loads(meta_path.read_text())
        if meta["sha256"] != _file_digest(entry):
            return False
        onnx_path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(entry, onnx_path)
    except (OSError, ValueError, KeyError, TypeError):
        return False
    outcome.stage, outcome.cache_hit, outcome.onnx_path = "onnx-checker", True, str(onnx_path)
    outcome.opset, outcome.op_counts, outcome.notes = meta.get("opset"), meta.get("op_counts", {}), meta.get("notes", [])
    outcome.equalities = [tuple(pair) for pair in meta.get("equalities", [])]
    outcome.notes = [*outcome.notes, "export cache hit: torch.export and translation skipped"]
    return True


def _store_cached(cache_dir: Path | None, key: str, onnx_path: Path, outcome: ExportOutcome) -> None:
    assert cache_dir is not None
    cache_dir.mkdir(parents=True, exist_ok=True)
    entry = cache_dir / f"{key}.onnx"
    _atomic_copy(onnx_path, entry)
    meta = {"sha256": _file_digest(entry), "opset": outcome.opset, "op_counts": outcome.op_counts,
            "notes": outcome.notes, "equalities": outcome.equalities}
    with tempfile.NamedTemporaryFile("w", dir=cache_dir, delete=False, suffix=".tmp") as f:
        json.dump(meta, f)
    os.replace(f.name, cache_dir / f"{key}.json")


def _atomic_copy(source: Path, target: Path) -> None:
    with tempfile.NamedTemporaryFile(dir=target.parent, delete=False, suffix=".tmp") as f:
        temp = Path(f.name)
    shutil.copyfile(source, temp)
    os.replace(temp, target)
