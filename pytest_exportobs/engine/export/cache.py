"""The export cache: what torch.export, the ONNX translation and ExecuTorch's lowering produced.

A *trace* entry, keyed by everything the trace depends on except the weights' values, holds what
the trace established and the key of its graph: a hit skips torch.export.  An export that failed
(torch.export, the decomposition, the translation or the checker; not the machine's problems nor
a lack of memory) is a trace entry too, holding the failure: a rerun reports it again without
tracing, as nothing it depends on changed.  A *graph* entry, keyed
by the traced program itself, holds its ONNX file, optimized with the weights held as inputs (so
that none is folded into another initializer: they stay initializers named after the module's
state): a hit skips the decomposition and the translation, and graphs that differ only by
constants the trace never reads share one.  Other weights than those the file holds (a suite that
does not seed its models) are applied to it by name: never a stale weight.  A *lowered* entry,
keyed by the trace and the weights' values (an ExecuTorch program holds them, packed by its
delegate), holds the ``.pte`` file, what the delegate took and what the trace established, or how
the lowering failed.  An *exploration*
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

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...core.files import FileMark, copy_atomic, write_atomic
from ...core.versions import package_versions
from ...core.vocabulary import Kind, Stage
from ...observe.binding import value_text
from ...shapes.model import ShapeModel
from . import digests
from .digests import call_structure, tensor_bytes
from .domain import Refinement

# What an entry holds; a change makes earlier entries miss (3: trace and graph entries, weights
# applied by name; 4: the dims a trace made static among its refinements; 5: one file, optimized
# with the weights held as inputs; 6: its weights compared with the module's as they are
# written, no digest of them; 7: the graph file known by the digest of its content, which a
# cache copied or restored in CI keeps, not by its inode and modification time; 8: failed exports
# kept, the plugin's code in every key; 9: the graph file's size and time beside its digest, the
# order of a graph's outputs; 10: how torch.export captured the program; 11: the pinned variable
# of a failure, a probe's refinements replayed; 12: how many elements a trace's outputs hold)
ENTRY_FORMAT = 12
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
    the export's ``failure``, if it failed, how torch.export captured the program (``strict``,
    ``oblivious``: see :class:`~.tracing.Capture`) and how many elements the outputs hold (see
    :func:`~.domain.output_elements`)."""

    graph: str
    notes: list[str] = field(default_factory=list)
    refinements: list[Refinement] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    dims_form: str = ""
    failure: ExportFailure | None = None
    strict: bool = False
    oblivious: bool = True
    output_elements: str = ""


@dataclass
class LoweredEntry:
    """What lowering a trace for ExecuTorch left besides its ``.pte`` file: what the trace
    established (its entry), what the XNNPACK delegate took, the upper bounds memory was planned
    for (by variable) and its failure, if it failed (then no file)."""

    trace: TraceEntry
    delegation: dict[str, Any] = field(default_factory=dict)
    upper_bounds: dict[str, dict[str, Any]] = field(default_factory=dict)
    failure: ExportFailure | None = None


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
    """A directory of ``trace-<key>.json``, ``graph-<key>.{json,onnx}``, ``lowered-<key>.{json,pte}``,
    ``explored-<key>.json``, ``verified-<key>.json``,
    ``probed-<key>.json`` and ``check-<key>.json`` entries; ``extra`` (the export patches) is part
    of every key."""

    directory: Path
    extra: tuple[str, ...] = ()
    # the checked module's digest as its check found it: the check's own calls may change what a
    # digest reads (diffusers' tests count an attention processor's calls in a public attribute)
    module_digest: Any = None

    def _module(self, module: torch.nn.Module) -> Any:
        """``module``'s digest: the one taken before its check called it, else read now."""
        return self.module_digest.copy() if self.module_digest is not None else digests.module_digest(module)

    def trace_key(self, module: torch.nn.Module, method: str, shapes: ShapeModel, args: tuple, kwargs: dict) -> str:
        """Hash of what the trace depends on: the classes of the model and its submodules
        (qualified names and source files), its configuration, the method exported, the constant
        arguments bound, the input structure (tree, dtypes, ranks) and its dynamic dims, the names,
        dtypes and shapes of the weights (not their values), the values of tensors held as plain
        attributes, package versions, the plugin's code, patches and :data:`ENTRY_FORMAT`."""
        digest = self._module(module)
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
        digest = self._module(module)
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
        common = [package_versions(), list(self.extra), ENTRY_FORMAT, digests.plugin_digest()]
        digest.update(json.dumps(common).encode())

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
        digest = self._module(module)
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

    def verified_key(self, graph: str, runtime: str, calls: Iterable[Sequence[Any]],
                     references: Iterable[Sequence[Any]], settings: object) -> str:
        """Hash of what comparing a graph's runs with their references gives: the ``graph``
        file's digest, the ``runtime`` running it, each call's leaves and reference (their
        values), the comparison's JSON-native ``settings``, package versions, the plugin's code,
        patches and :data:`ENTRY_FORMAT`."""
        digest = hashlib.sha256(f"{graph}:{runtime}".encode())
        for leaves, reference in zip(calls, references, strict=True):
            for value in (*leaves, "|", *reference, "||"):
                if isinstance(value, torch.Tensor):
                    digest.update(f"{value.dtype}{tuple(value.shape)}".encode())
                    digest.update(tensor_bytes(value))
                else:
                    digest.update(value_text(value).encode())
        digest.update(json.dumps(settings, sort_keys=True, default=repr).encode())
        self._common(digest)
        return digest.hexdigest()[:32]

    def load_verified(self, key: str) -> list[dict[str, Any]] | None:
        found = self._read(f"verified-{key}.json")
        return found if isinstance(found, list) else None

    def store_verified(self, key: str, found: list[dict[str, Any]]) -> None:
        self._write(f"verified-{key}.json", found)

    def load_trace(self, key: str) -> TraceEntry | None:
        try:
            return _trace_entry(self._read(f"trace-{key}.json"))
        except (ValueError, KeyError, TypeError):  # missing, or not an entry's fields
            return None

    def store_trace(self, key: str, entry: TraceEntry) -> None:
        self._write(f"trace-{key}.json", _trace_json(entry))

    def lowered_key(self, trace_key: str, state: dict[str, torch.Tensor]) -> str:
        """Hash of a trace's key and the values of the module's ``state`` (by name)."""
        digest = hashlib.sha256(trace_key.encode())
        for name, tensor in sorted(state.items()):
            digest.update(name.encode())
            digest.update(tensor_bytes(tensor))
        return digest.hexdigest()[:32]

    def load_lowered(self, key: str) -> tuple[LoweredEntry, Path] | None:
        """The lowering for ExecuTorch under ``key`` (:meth:`lowered_key`) and its ``.pte`` file
        (as in :meth:`load_graph`); ``None`` when missing, or its file is not the one stored."""
        path = self.directory / f"lowered-{key}.pte"
        meta = self._read(f"lowered-{key}.json")
        if not isinstance(meta, dict):
            return None
        try:
            mark = meta.pop("file")
            entry = LoweredEntry(**meta | {"trace": _trace_entry(meta["trace"]),
                                           "failure": meta["failure"] and ExportFailure.from_json(meta["failure"])})
            if entry.failure is None and not FileMark(**mark).describes(path):
                return None
            return entry, path
        except (ValueError, KeyError, TypeError):
            return None

    def store_lowered(self, key: str, entry: LoweredEntry, path: Path | None) -> None:
        """Add the ``.pte`` file (``None``: the lowering failed) and its entry, the metadata last."""
        file = asdict(copy_atomic(path, self.directory / f"lowered-{key}.pte")) if path else None
        self._write(f"lowered-{key}.json", asdict(entry) | {"trace": _trace_json(entry.trace), "file": file})

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


def _trace_entry(meta: dict[str, Any]) -> TraceEntry:
    meta = meta | {"refinements": [Refinement.from_json(r) for r in meta["refinements"]],
                   "failure": ExportFailure.from_json(meta["failure"]) if meta["failure"] else None}
    return TraceEntry(**meta)


def _trace_json(entry: TraceEntry) -> dict[str, Any]:
    return asdict(entry) | {"refinements": [r.to_json() for r in entry.refinements]}
