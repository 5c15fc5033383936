"""ExecuTorch's side of an export (``--export-target executorch``): the traced program lowered to
the edge dialect, the XNNPACK delegate taking what it can, written as a ``.pte`` file.

ExecuTorch plans the memory of every tensor for its largest size, so every dynamic dim needs an
upper bound (:func:`upper_bounds`): a sequence's is the longest the model's configuration
declares (``max_position_embeddings``), any other's twice the largest size the tests used (at
least :data:`SMALLEST_BOUND`), which is as far as the variations reach.  The program traced for
every target is bounded while it is lowered, as an export with ``Dim(..., max=...)`` would have
traced it, and left as it was (see :func:`~...compat.torch_private.upper_bounded`).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import sympy
import torch

from ...compat.executorch_private import python_sym_functions_verified
from ...compat.torch_private import drop_runtime_asserts, flat_call_spec, size_oblivious, upper_bounded
from ...core.configuration import declared_limit, rope_factor
from ...core.vocabulary import AxisRole, Stage
from ...shapes.model import ShapeModel
from ..base.environment import writing
from ..base.frames import quoted_model_line
from ..base.reasons import op_name
from .domain import program_shapes

MARGIN = 2  # a bound no configuration declares: this many times the largest size observed
SMALLEST_BOUND = 16
SEQUENCES = (AxisRole.SEQ, AxisRole.PAST_SEQ, AxisRole.TOTAL_SEQ)  # bounded by a declared maximum
SHOWN_PORTABLE = 3  # the largest non-delegated ops a report names with their source lines
# ops of the edge program that compute nothing: the delegate's calls, tuple indexing, sizes
_BOOKKEEPING = ("executorch_call_delegate", "getitem", "sym_size", "sym_numel", "sym_storage_offset")


@dataclass(frozen=True)
class UpperBound:
    """The largest size of a dynamic dim ExecuTorch plans memory for, and where it comes from."""

    size: int
    source: str  # "max_position_embeddings = 512", "twice the largest size observed, 13"

    def to_json(self) -> dict[str, Any]:
        return {"max": self.size, "from": self.source}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> UpperBound:
        return cls(data["max"], data["from"])


def upper_bounds(shapes: ShapeModel, module: torch.nn.Module) -> dict[str, UpperBound]:
    """The upper bound of every variable of ``shapes``: a sequence's from the model's declared
    maximum (stretched by its rotary scaling factor), any other's :data:`MARGIN` times its
    largest size (at least :data:`SMALLEST_BOUND`)."""
    declared, factor = declared_limit(module), rope_factor(module)
    found = {}
    for var in shapes.variables:
        if var.role in SEQUENCES and declared is not None:
            stretched = f" x rope factor {factor:g}" if factor > 1 else ""
            found[var.name] = UpperBound(int(declared[1] * factor), f"{declared[0]} = {declared[1]}{stretched}")
            continue
        largest = var.bounds[1]
        size = max(MARGIN * largest, SMALLEST_BOUND)
        why = "twice" if size > SMALLEST_BOUND else "the smallest bound, over"
        found[var.name] = UpperBound(size, f"{why} the largest size observed, {largest}")
    return found


def bounds_note(bounds: dict[str, UpperBound]) -> str:
    """``ExecuTorch plans memory for batch <= 26 (twice ...), seq <= 512 (max_position_embeddings = 512)``."""
    shown = ", ".join(f"{name} <= {bound.size} ({bound.source})" for name, bound in bounds.items())
    return f"ExecuTorch plans memory for {shown}" if shown else ""


def symbol_maxima(
    program: torch.export.ExportedProgram, shapes: ShapeModel, inputs: list[int], bounds: dict[str, UpperBound],
) -> dict[str, int]:
    """The upper bound of every symbol of the program's input sizes (by its text, ``s23``), from
    the bounds of the variables whose axes it sizes: a symbol ``s`` of an axis sized ``a*s + b``
    is bounded so that the axis stays within its variable's bound (the tightest over its axes)."""
    maxima: dict[str, int] = {}
    for name, size in _axis_sizes(program, shapes, inputs):
        if not isinstance(size, sympy.Expr) or len(size.free_symbols) != 1 or name not in bounds:
            continue
        (symbol,) = size.free_symbols
        step, offset = size.subs(symbol, 1) - size.subs(symbol, 0), size.subs(symbol, 0)
        if not (step.is_Integer and offset.is_Integer and int(step) > 0 and size.equals(step * symbol + offset)):
            continue
        largest = (bounds[name].size - int(offset)) // int(step)
        maxima[str(symbol)] = min(maxima.get(str(symbol), largest), largest)
    return maxima


def within_torch_bounds(
    program: torch.export.ExportedProgram, shapes: ShapeModel, inputs: list[int], bounds: dict[str, UpperBound],
) -> dict[str, UpperBound]:
    """``bounds`` with each variable's lowered to the bound torch.export put on its symbol where
    that one is tighter (a sliding window's ``past_seq <= 15``): the bound the program is planned for."""
    found = dict(bounds)
    for name, size in _axis_sizes(program, shapes, inputs):
        known = program.range_constraints.get(size) if isinstance(size, sympy.Symbol) else None
        if known is not None and name in found and known.upper.is_Integer and int(known.upper) < found[name].size:
            found[name] = UpperBound(int(known.upper), "torch.export's bound")
    return found


def _axis_sizes(
    program: torch.export.ExportedProgram, shapes: ShapeModel, inputs: list[int],
) -> Iterator[tuple[str, sympy.Expr | int | None]]:
    """(variable, the program's size of the axis) for every dynamic axis of the program's inputs
    (``inputs``: the leaves they are); ``None`` where the program has no such axis."""
    read, axes = program_shapes(program), shapes.leaf_axes()
    for position, leaf in enumerate(inputs):
        for dim, name in axes[leaf].items():
            yield name, read[position][dim] if position < len(read) and dim < len(read[position]) else None


@dataclass
class Delegation:
    """What the XNNPACK delegate took of a lowered program: its partitions and the ops in them,
    and the ops left to ExecuTorch's portable kernels (``portable``: op name -> count; ``lines``:
    the largest of them with the model's line each comes from)."""

    partitions: int = 0
    delegated: int = 0
    portable: dict[str, int] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    taken: dict[str, int] = field(default_factory=dict)  # the delegated ops: op name -> count
    mutated_inputs: int = 0  # inputs updated in place (a static cache): the runtime returns them first

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Delegation:
        return cls(**data)

    def taken_text(self) -> str:
        """The ops the delegate took, most frequent first: ``aten.convolution.default x2, ...``."""
        return _counted(self.taken)

    def note(self) -> str:
        """One line on what runs undelegated: ``""`` when the delegate took every op."""
        left = sum(self.portable.values())
        if not left:
            return ""
        total = left + self.delegated
        ops = _counted(self.portable)
        largest = f"; the largest: {'; '.join(self.lines)}" if self.lines else ""
        return (f"XNNPACK took {self.delegated} of {total} ops ({self.partitions} partitions); {left} run on "
                f"ExecuTorch's portable kernels, slower on a phone: {ops}{largest}")


def _counted(ops: dict[str, int]) -> str:
    return ", ".join(f"{op} x{count}" for op, count in sorted(ops.items(), key=lambda item: -item[1]))


def lower(program: torch.export.ExportedProgram, maxima: dict[str, int], path: Path,
          delegate: bool = True) -> Delegation:
    """Lower ``program`` (its sizes bounded by ``maxima``, see :func:`symbol_maxima`) to the edge
    dialect with the XNNPACK partitioner (none without ``delegate``: every op on ExecuTorch's
    portable kernels), write the ExecuTorch program to ``path``; what the delegate took.  Raises
    :class:`Unbounded` for a size memory planning finds no bound for.
    The program loses its runtime asserts on sizes (the last use of a program traced for
    several targets: ExecuTorch's comes last)."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    drop_runtime_asserts(program)  # as ExecuTorch does, before its verifier rejects some
    # sizes 0 and 1 not specialized while the edge dialect decomposes, as while torch.onnx does
    with upper_bounded(program, maxima), size_oblivious(), python_sym_functions_verified():
        edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()] if delegate else [])
        lowered = edge.exported_program()
        delegation = _delegation(lowered)  # before to_executorch plans memory in its graph
        try:
            with flat_call_spec(lowered):  # the runtime takes and gives flat lists
                buffer = edge.to_executorch().buffer
        except RuntimeError as e:
            unbounded = _UNBOUNDED.search(str(e))
            if unbounded is None:
                raise
            raise Unbounded(unbounded.group(1), _sized_by(lowered, unbounded.group(1))) from e
    with writing(Stage.LOWER, f"the ExecuTorch program {path}"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(buffer)
    return delegation


_UNBOUNDED = re.compile(r"Cannot evaluate a finite upper bound for symbolic expression (\S+)")


class Unbounded(Exception):
    """Memory planning found no upper bound for a size computed from data (``.item()``, ``nonzero``)."""

    def __init__(self, symbol: str, line: str):
        at = f" (made at {line})" if line else ""
        super().__init__(
            f"the size {symbol}{at} comes from the data and has no upper bound: ExecuTorch plans memory for the "
            "largest size; bound it in the model with torch._check(size <= N)")


def _sized_by(program: torch.export.ExportedProgram, symbol: str) -> str:
    """The model's line of the first node whose output is sized by ``symbol``, else of the first
    that makes a size from data (``.item()``, ``nonzero``: ExecuTorch's passes may rename the
    symbol); ``""`` if none."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    made = ""
    for node in program.graph.nodes:
        value = node.meta.get("val")
        sizes = value.shape if isinstance(value, torch.Tensor) else [value] if isinstance(value, torch.SymInt) else []
        line = quoted_model_line(node.meta.get("stack_trace") or "")
        if any(isinstance(s, torch.SymInt) and symbol in {str(f) for f in s.node.expr.free_symbols} for s in sizes):
            return line
        if not made and isinstance(value, torch.SymInt) and free_unbacked_symbols(value):
            made = line
    return made


def _delegation(program: torch.export.ExportedProgram) -> Delegation:
    """Count the ops in the delegate's partitions and those left out, the largest of the latter
    (by the elements of their output at the traced sizes) with their source lines."""
    module = program.graph_module
    found = Delegation()
    left: list[tuple[int, str, str]] = []
    portable: Counter[str] = Counter()
    taken: Counter[str] = Counter()
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        name = op_name(node.target)
        if name == "executorch_call_delegate":
            found.partitions += 1
            inner = getattr(module, node.args[0].target).original_module.graph.nodes
            taken.update(name for inside in inner if inside.op == "call_function"
                         and (name := op_name(inside.target)) not in _BOOKKEEPING)
        elif name not in _BOOKKEEPING and _computes_tensors(node):
            portable[name] += 1
            left.append((_elements(node.meta.get("val")), name, quoted_model_line(node.meta.get("stack_trace") or "")))
    found.portable, found.taken, found.delegated = dict(portable), dict(taken), sum(taken.values())
    mutation = torch.export.graph_signature.OutputKind.USER_INPUT_MUTATION
    found.mutated_inputs = sum(spec.kind == mutation for spec in program.graph_signature.output_specs)
    largest = sorted(left, key=lambda item: -item[0])[:SHOWN_PORTABLE]
    found.lines = [f"{name} at {line}" if line else name for _, name, line in largest]
    return found


def _computes_tensors(node: torch.fx.Node) -> bool:
    """Whether a node's output is a tensor or tensors (not a size, a condition or nothing)."""
    value = node.meta.get("val")
    values = value if isinstance(value, (tuple, list)) else [value]
    return any(isinstance(v, torch.Tensor) for v in values)


def _elements(value: Any) -> int:
    """Elements of a fake output at the sizes it was traced at (0 when unknown)."""
    if not isinstance(value, torch.Tensor):
        return 0
    numel = value.numel()
    hint = numel if isinstance(numel, int) else numel.node.hint  # None: a size from data
    return int(hint) if hint is not None else 0
