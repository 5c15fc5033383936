"""The export cache: what torch.export and the ONNX translation produced, at two levels.

A *trace* entry, keyed by everything the trace depends on except the weights' values, holds what
the trace established and the key of its graph: a hit skips torch.export.  An export that failed
(torch.export, the decomposition, the translation or the checker; not the machine's problems nor
a lack of memory) is a trace entry too, holding the failure: a rerun reports it again without
tracing, as nothing it depends on changed.  A *graph* entry, keyed
by the traced program itself, holds its ONNX file, optimized with the weights held as inputs (so
that none is folded into another initializer: they stay initializers named after the module's
state): a hit skips the decomposition and the translation, and graphs that differ only by
constants the trace never reads share one.  Other weights than those the file holds (a suite that
does not seed its models) are applied to it by name: never a stale weight.  An *exploration*
entry, keyed by the trace and the exploration's settings, holds the outcome of variations the
graph passed: a rerun does not explore shapes again when nothing they depend on but the weights'
values changed.  A *probe* entry, keyed by the model and the shape model of a graph, holds the
dims eager rejected at another size: a rerun does not run eager to find them again.  A *check*
entry, keyed by what a model's check depends on that is known before it begins (the module, its
calls' structure, the settings), holds what its next check is expected to take: the next run
places its checks with it (see :mod:`..placement`), and no verdict depends on it.
Verification always runs.  Code paths chosen by environment variables or global state are not
part of the keys; the plugin's own code is (its source files' digest: an entry made by other code
of the same version misses).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree

from ...core.configuration import computation, configuration_text
from ...core.files import FileMark, copy_atomic, write_atomic
from ...core.versions import package_versions
from ...core.vocabulary import Kind, Stage
from ...observe.binding import value_text
from ...shapes.model import ShapeModel
from .domain import Refinement

# What an entry holds; a change makes earlier entries miss (3: trace and graph entries, weights
# applied by name; 4: the dims a trace made static among its refinements; 5: one file, optimized
# with the weights held as inputs; 6: its weights compared with the module's as they are
# written, no digest of them; 7: the graph file known by the digest of its content, which a
# cache copied or restored in CI keeps, not by its inode and modification time; 8: failed exports
# kept, the plugin's code in every key; 9: the graph file's size and time beside its digest, the
# order of a graph's outputs; 10: how torch.export captured the program; 11: the pinned variable
# of a failure, a probe's refinements replayed)
ENTRY_FORMAT = 11
PROBE_REFINEMENTS = ("without", "tied", "stepped")  # the ShapeModel refinements a probe entry replays


@dataclass
class ExportFailure:
    """How an export failed: the failing stage, the kind of failure, the exception's type, the
    one-line reason, the traceback and the variable a specialized failure names."""

    stage: Stage
    kind: Kind
    error_type: str
    reason: str
    traceback: str
    pinned: str = ""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ExportFailure:
        return cls(**data | {"stage": Stage(data["stage"]), "kind": Kind(data["kind"])})


@dataclass
class TraceEntry:
    """What a trace established: the key of its graph entry (``""`` when it failed), notes, the
    refinements of the shape model, the names of the graph's outputs, how torch was given the dims,
    the export's ``failure``, if it failed, and how torch.export captured the program (``strict``,
    ``oblivious``: see :class:`~.tracing.Capture`)."""

    graph: str
    notes: list[str] = field(default_factory=list)
    refinements: list[Refinement] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    dims_form: str = ""
    failure: ExportFailure | None = None
    strict: bool = False
    oblivious: bool = True


@dataclass
class GraphEntry:
    """What the translation of a traced program left besides its files: notes of the
    decomposition and translation, opset and op counts of the file, the initializers that are the
    module's state (``weight_names``), the axis names given to its symbolic dims and the order of
    its outputs (see :attr:`~.outcome.ExportOutcome.output_order`)."""

    opset: int | None = None
    op_counts: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    weight_names: list[str] = field(default_factory=list)
    axis_names: dict[str, str] = field(default_factory=dict)
    output_order: list[int] = field(default_factory=list)


@dataclass
class ProbeEntry:
    """What probing a shape model's unvaried dims found: the refinements it made, in order (each
    ``[method, *arguments]`` of :data:`PROBE_REFINEMENTS`: a variable kept static, axes tied to
    it, its steps), and the notes saying why."""

    changes: list[list[Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def applied(self, shapes: ShapeModel) -> ShapeModel:
        """``shapes`` refined as the probe refined it."""
        for method, *arguments in self.changes:
            if method not in PROBE_REFINEMENTS:
                raise ValueError(f"not a probe's refinement: {method!r}")
            shapes = getattr(shapes, method)(*arguments)
        return shapes


@dataclass(frozen=True)
class GraphHit:
    """A graph entry found intact: its metadata and its ONNX file."""

    entry: GraphEntry
    path: Path


@dataclass(frozen=True)
class ExportCache:
    """A directory of ``trace-<key>.json``, ``graph-<key>.{json,onnx}``, ``explored-<key>.json``,
    ``probed-<key>.json`` and ``check-<key>.json`` entries; ``extra`` (the export patches) is part
    of every key."""

    directory: Path
    extra: tuple[str, ...] = ()

    def trace_key(self, module: torch.nn.Module, method: str, shapes: ShapeModel, args: tuple, kwargs: dict) -> str:
        """Hash of what the trace depends on: the classes of the model and its submodules
        (qualified names and source files), its configuration, the method exported, the constant
        arguments bound, the input structure (tree, dtypes, ranks) and its dynamic dims, the names,
        dtypes and shapes of the weights (not their values), the values of tensors held as plain
        attributes, package versions, the plugin's code, patches and :data:`ENTRY_FORMAT`."""
        digest = _module_digest(module)
        constants = sorted((k, value_text(v)) for k, v in shapes.aligned.constants().items())
        digest.update(json.dumps([method, shapes.aligned.leaf_names, constants]).encode())
        digest.update(json.dumps(shapes.to_json(), sort_keys=True).encode())
        digest.update(call_structure(args, kwargs).encode())
        self._common(digest)
        return digest.hexdigest()[:32]

    def check_key(self, module: torch.nn.Module, calls: Iterable[tuple[tuple, dict, bool]], settings: object) -> str:
        """Hash of what a model's check depends on that is known before it begins: the module as
        in :meth:`trace_key`, the structure of its recorded ``calls`` (arguments, keyword
        arguments, training mode; tensors by dtype and shape), the check's JSON-native
        ``settings``, package versions, the plugin's code, patches and :data:`ENTRY_FORMAT`."""
        digest = _module_digest(module)
        for args, kwargs, training in calls:
            digest.update(f"{call_structure(args, kwargs)}:{training}".encode())
        digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
        self._common(digest)
        return digest.hexdigest()[:32]

    def load_check_seconds(self, key: str) -> float | None:
        """What the next check under ``key`` is expected to take; ``None`` when none is recorded."""
        found = self._read(f"check-{key}.json")
        seconds = found.get("seconds") if isinstance(found, dict) else None
        return float(seconds) if isinstance(seconds, (int, float)) else None

    def store_check_seconds(self, key: str, seconds: float) -> None:
        self._write(f"check-{key}.json", {"seconds": round(seconds, 3)})

    def graph_key(self, program: torch.export.ExportedProgram, axis_names: dict[str, str], state: set[str]) -> str:
        """Hash of the traced program: its code with every node's dtype and symbolic shape, its
        signature and ranges, the values of its constants that are not the module's ``state``,
        the axis names, package versions, the plugin's code, patches and :data:`ENTRY_FORMAT`."""
        digest = hashlib.sha256()
        code = program.graph_module.print_readable(print_output=False, include_stride=False, include_device=False)
        digest.update(code.encode())
        digest.update(f"{program.graph_signature}\n{program.range_constraints}".encode())
        for name, value in sorted(program.constants.items()):
            if name not in state:
                digest.update(name.encode())
                digest.update(tensor_bytes(value) if isinstance(value, torch.Tensor) else repr(value).encode())
        digest.update(json.dumps(axis_names, sort_keys=True).encode())
        self._common(digest)
        return digest.hexdigest()[:32]

    def _common(self, digest: Any) -> None:
        digest.update(json.dumps([package_versions(), list(self.extra), ENTRY_FORMAT, _plugin_digest()]).encode())

    def exploration_key(self, trace_key: str, settings: object) -> str:
        """Hash of a trace's key and the exploration's JSON-native ``settings``."""
        digest = hashlib.sha256(trace_key.encode())
        digest.update(json.dumps(settings, sort_keys=True).encode())
        return digest.hexdigest()[:32]

    def load_exploration(self, key: str) -> dict[str, Any] | None:
        found = self._read(f"explored-{key}.json")
        return found if isinstance(found, dict) else None

    def store_exploration(self, key: str, summary: dict[str, Any]) -> None:
        self._write(f"explored-{key}.json", summary)

    def probe_key(self, module: torch.nn.Module, method: str, shapes: ShapeModel) -> str:
        """Hash of what probing ``shapes``' unvaried dims in eager depends on: the module as in
        :meth:`trace_key`, the method, the constant arguments, the shape model and its calls'
        leaves (dtypes and shapes), package versions, the plugin's code, patches and :data:`ENTRY_FORMAT`."""
        digest = _module_digest(module)
        constants = sorted((k, value_text(v)) for k, v in shapes.aligned.constants().items())
        described = [method, shapes.aligned.leaf_names, constants, shapes.to_json()]
        digest.update(json.dumps(described, sort_keys=True).encode())
        for index in range(shapes.aligned.n_calls):
            digest.update(call_structure(tuple(shapes.call_leaves(index)), {}).encode())
        self._common(digest)
        return digest.hexdigest()[:32]

    def load_probe(self, key: str) -> ProbeEntry | None:
        try:
            return ProbeEntry(**self._read(f"probed-{key}.json"))
        except TypeError:  # missing, or not an entry's fields
            return None

    def store_probe(self, key: str, entry: ProbeEntry) -> None:
        self._write(f"probed-{key}.json", asdict(entry))

    def holds_traces(self) -> bool:
        """Whether an earlier run stored traces here (a rerun: most exports will be served)."""
        return self.directory.is_dir() and any(self.directory.glob("trace-*.json"))

    def load_trace(self, key: str) -> TraceEntry | None:
        meta = self._read(f"trace-{key}.json")
        try:
            meta["refinements"] = [Refinement.from_json(r) for r in meta["refinements"]]
            meta["failure"] = ExportFailure.from_json(meta["failure"]) if meta["failure"] else None
            return TraceEntry(**meta)
        except (ValueError, KeyError, TypeError):  # missing, or not an entry's fields
            return None

    def store_trace(self, key: str, entry: TraceEntry) -> None:
        self._write(f"trace-{key}.json", asdict(entry) | {"refinements": [r.to_json() for r in entry.refinements]})

    def load_graph(self, key: str) -> GraphHit | None:
        """The graph entry when its metadata describes the file there (the content the entry
        was stored with, wherever the directory was copied since: see :class:`FileMark`); else
        ``None``."""
        path = self._graph_file(key)
        try:
            meta = json.loads((self.directory / f"graph-{key}.json").read_text())
            if not FileMark(**meta.pop("file")).describes(path):
                return None
            return GraphHit(GraphEntry(**meta), path)
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def store_graph(self, key: str, path: Path, entry: GraphEntry) -> None:
        """Add the file under ``key``, the metadata last (atomically: a concurrent reader sees
        a whole entry or none; a process storing the same key meanwhile leaves a file the
        metadata does not describe, a miss)."""
        meta = asdict(entry) | {"file": asdict(copy_atomic(path, self._graph_file(key)))}
        write_atomic(self.directory / f"graph-{key}.json", json.dumps(meta))

    def _graph_file(self, key: str) -> Path:
        return self.directory / f"graph-{key}.onnx"

    def _read(self, name: str) -> Any:
        """The JSON value of the entry file ``name``; ``None`` when it is missing or not JSON."""
        try:
            return json.loads((self.directory / name).read_text())
        except (OSError, ValueError):
            return None

    def _write(self, name: str, value: Any) -> None:
        write_atomic(self.directory / name, json.dumps(value))


def module_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers by qualified name, tied ones under each of their names (the names
    torch.export gives the program's state and torch.onnx its initializers)."""
    return {**dict(module.named_parameters(remove_duplicate=False)),
            **dict(module.named_buffers(remove_duplicate=False))}


def _module_digest(module: torch.nn.Module) -> Any:
    """A SHA-256 object fed with what a trace of ``module`` depends on but its inputs: the classes
    of the model and its submodules (qualified names and source files), its configuration, what
    its submodules compute with besides their weights (see :func:`~...core.configuration.computation`),
    the names, dtypes and shapes of the weights (not their values) and the values of tensors held
    as plain attributes."""
    digest = hashlib.sha256()
    classes = sorted({f"{type(m).__module__}.{type(m).__qualname__}" for m in module.modules()})
    digest.update(json.dumps([classes, configuration_text(module), computation(module, constants=True)]).encode())
    for source in _source_files(module):
        digest.update(source.encode())
    for name, tensor in module_state(module).items():
        digest.update(f"{name}:{tensor.dtype}:{tensor.layout}:{tuple(tensor.shape)}".encode())
    for name, tensor in _tensor_attributes(module):
        digest.update(name.encode())
        digest.update(tensor_bytes(tensor))
    return digest


def call_structure(args: tuple, kwargs: dict) -> str:
    """The tree of ``args`` and ``kwargs``, tensors by dtype and shape, other leaves by value
    (an opaque object by type): what the keys read of a call."""
    flat, spec = _pytree.tree_flatten((args, kwargs))
    described = [repr((t.dtype, tuple(t.shape))) if isinstance(t, torch.Tensor) else value_text(t) for t in flat]
    return f"{spec}[{', '.join(described)}]"


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The values of any tensor as bytes, without a copy of a contiguous one: 0-dim,
    non-contiguous, sparse, bfloat16 (which numpy lacks) included."""
    value = tensor.detach().cpu()
    if value.layout != torch.strided:
        value = value.to_dense()
    return value.contiguous().reshape(-1).view(torch.uint8).numpy().data


def _tensor_attributes(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Tensors held as plain attributes (neither parameters nor buffers): torch.export lifts
    them into the program as constants, with their values."""
    return [(f"{prefix}.{name}", value) for prefix, sub in module.named_modules(remove_duplicate=False)
            for name, value in vars(sub).items() if isinstance(value, torch.Tensor)]


def _source_files(module: torch.nn.Module) -> list[str]:
    """Text of the files defining the classes of the module and its submodules (outside torch)."""
    classes = {cls for sub in module.modules() for cls in type(sub).__mro__}
    texts: dict[Any, str] = {}
    for cls in classes:
        if cls.__module__.startswith(("torch.", "builtins")) or cls is object:
            continue
        try:
            path = inspect.getsourcefile(cls)
            texts[path] = _source_text(path) if path else cls.__qualname__
        except (OSError, TypeError):
            texts[cls.__qualname__] = f"{cls.__module__}.{cls.__qualname__}"
    return [texts[k] for k in sorted(texts, key=str)]


@functools.cache
def _plugin_digest() -> str:
    """Digest of the plugin's own source files, read once per process."""
    digest = hashlib.sha256()
    package = Path(__file__).parents[2]
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.cache
def _source_text(path: str) -> str:
    """A source file's text, read once per process: the code a process runs is the code it
    imported, whatever happens to the file afterwards."""
    return Path(path).read_text()
