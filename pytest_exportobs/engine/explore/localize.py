"""Which node of an ONNX graph makes it differ from eager, and the source line behind it.

Run from the graph's inputs, every value downstream of a wrong node is wrong too (the error
accumulates).  Here each ONNX node runs on **torch's own values** for its inputs instead: the
program torch.onnx translated runs in torch (an FX interpreter keeping every node's output), and
the ONNX graph is cut at every value named after an FX node (torch.onnx names a node's output
after the FX node it translates): each consumer reads torch's value through an input of its own.
One run of the cut graph gives the error each segment (the ONNX nodes that translate one FX node)
introduces; one run of the whole graph with the same values exposed gives the accumulated error.
The first segment beyond tolerance on torch's inputs is the culprit; when none is, the mismatch
accumulates from rounding.  Bounded: one call, graphs of at most :data:`MAX_NODES` nodes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...compat.torch_private import unchecked_module
from ...core.text import error_line
from ...core.trees import flat_outputs
from ...core.vocabulary import Runtime
from ..base.frames import quoted_model_line
from ..base.origins import STACK_TRACE
from ..export.onnx_stages import decompose
from ..verify.compare import Tolerance, compare
from ..verify.runtimes import OnnxRunner, ReferenceRunner, WidenedRunner

MAX_NODES = 20_000  # ONNX nodes of a graph localized (every value of the graph is kept in memory)
TOP = 5  # nodes reported beside the first one beyond tolerance
CUT = "::torch"  # suffix of the inputs that feed a consumer torch's value
REDUCTIONS = ("sum", "mean", "var", "std", "softmax", "norm", "mm", "matmul", "linear", "addmm", "bmm", "conv",
              "cumsum", "prod", "baddbmm", "einsum", "scaled_dot_product")


@dataclass(frozen=True)
class NodeError:
    """The error one FX node's ONNX translation makes on one call."""

    value: str  # the FX node's name, which its ONNX output bears
    torch_op: str  # ``aten.gelu.default``
    onnx_ops: tuple[str, ...]  # the op types of the ONNX nodes that compute it from cut inputs
    onnx_node: str  # the ONNX node producing the value
    line: str  # ``file:line: code`` of the model's (or library's) code behind it
    dtype: str
    introduced: float  # max |Δ| of the value computed on torch's inputs
    accumulated: float  # max |Δ| of the value computed from the graph's inputs
    beyond: bool  # the introduced error is beyond tolerance

    def describe(self) -> str:
        """``Erf, Mul (node_gelu) from aten.gelu.default at model.py:14: ...: |Δ| 0.31 introduced
        on torch's inputs, 0.35 accumulated``."""
        where = f" at {self.line}" if self.line else ""
        return (f"{', '.join(self.onnx_ops)} ({self.onnx_node}) from {self.torch_op}{where}: |Δ| "
                f"{self.introduced:.3g} introduced on torch's inputs, {self.accumulated:.3g} accumulated")

    def to_json(self) -> dict[str, Any]:
        values = asdict(self) | {"onnx_ops": list(self.onnx_ops)}
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in values.items()}


@dataclass
class Localization:
    """Where a mismatch comes from: the first node beyond tolerance on torch's inputs (``None``:
    the error accumulates), and the nodes introducing the largest errors (relative to their
    tolerance); ``why_not`` says why nothing could be compared."""

    compared: int = 0
    first: NodeError | None = None
    largest: list[NodeError] = field(default_factory=list)
    why_not: str = ""
    program_differs: str = ""  # the program translated already differs from eager: how much

    def summary(self) -> str:
        """One line for the failure message."""
        if self.program_differs:
            return (f"not the ONNX translation's: the program torch.export traced differs from eager already "
                    f"({self.program_differs})")
        if self.why_not:
            return f"not localized: {self.why_not}"
        if self.first is not None:
            return f"first diverging op: {self.first.describe()}"
        if not self.largest:
            return f"not localized: none of the {self.compared} values compared differs"
        worst = self.largest[0]
        kind = "a reduction" if _is_reduction(worst.torch_op) else "rounding"
        return (f"the mismatch accumulates: each of the {self.compared} values compared is within tolerance on torch's "
                f"own inputs ({kind} in {worst.dtype}; the largest error introduced: {worst.describe()})")

    def table(self) -> str:
        """The summary, then the nodes of the largest errors, one per line."""
        rows = [f"  {'beyond' if node.beyond else 'within'}  {node.describe()}" for node in self.largest]
        return "\n".join([self.summary(), *rows])

    def to_json(self) -> dict[str, Any]:
        return {"compared": self.compared, "first": self.first.to_json() if self.first else None,
                "largest": [node.to_json() for node in self.largest], "why_not": self.why_not,
                "program_differs": self.program_differs, "summary": self.summary()}


def localize_call(
    traced: Callable[[], torch.export.ExportedProgram], onnx_path: str | Path, leaves: Sequence[Any],
    tolerance: Tolerance, runtime: Runtime, expected: Sequence[Any],
) -> Localization:
    """:func:`localize` on a check's failing call (its flat ``leaves``), the program ``traced()``
    gives decomposed as the export decomposed it; a failure is the localization's ``why_not``."""
    try:
        program = decompose(traced(), [])
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        return localize(program, onnx_path, tensors, tolerance, runtime, expected)
    except Exception as e:
        return Localization(why_not=f"localizing failed ({type(e).__name__}: {error_line(e)})")


def localize(
    program: torch.export.ExportedProgram, onnx_path: str | Path, inputs: Sequence[torch.Tensor],
    tolerance: Tolerance, runtime: Runtime = Runtime.ONNXRUNTIME, expected: Sequence[Any] = (),
) -> Localization:
    """Localize the mismatch of the ONNX graph at ``onnx_path`` on one call (its ``inputs``, the
    graph's inputs in order); ``program`` is the one torch.onnx translated (decomposed), whose
    node names the graph's values bear; ``runtime`` is the one the graph was verified with;
    ``expected``, eager's flat outputs, tells a program that differs from eager already."""
    import onnx

    model = onnx.load(str(onnx_path))
    if len(model.graph.node) > MAX_NODES:
        return Localization(why_not=f"{len(model.graph.node)} ONNX nodes, over the limit of {MAX_NODES}")
    feeds = dict(zip([i.name for i in model.graph.input], inputs, strict=True))
    values, nodes, outputs = _torch_values(program, feeds)
    if expected:
        traced = compare(outputs, expected, tolerance)
        if not traced.ok:
            return Localization(program_differs=f"max |Δ| {traced.max_abs:.3g}: {traced.detail or traced.kind}")
    producers = {output: node for node in model.graph.node for output in node.output}
    declared = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.value_info, *model.graph.output]}
    aligned = [name for name in producers if name in values and _same_type(declared.get(name, 0), values[name])]
    if not aligned:
        return Localization(why_not="no value of the ONNX graph bears the name of a node of the program")
    try:
        accumulated = _run(_exposing(model, aligned), feeds, aligned, runtime)
        introduced = _run(_cut(model, aligned, values), feeds | {n + CUT: values[n] for n in aligned}, aligned, runtime)
    except Exception as e:  # a runtime failing on the graph it verified would have failed the graph
        return Localization(why_not=f"the cut graph does not run ({error_line(e)})")
    cut = set(aligned)
    found = (_node_error(name, values[name], nodes[name], producers, cut, introduced[name], accumulated[name],
                         tolerance) for name in aligned)
    errors = [error for error in found if error is not None]
    first = next((e for e in errors if e.beyond), None)
    ranked = sorted(errors, key=lambda e: _ratio(e, tolerance), reverse=True)
    return Localization(len(errors), first, [e for e in ranked if e.introduced > 0][:TOP])


def _torch_values(
    program: torch.export.ExportedProgram, feeds: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.fx.Node], list[torch.Tensor | None]]:
    """Every tensor an FX node of ``program`` computes on ``feeds`` (by the placeholders' names,
    which the ONNX graph's inputs bear), the nodes, by name, and the program's flat outputs."""
    module = unchecked_module(program)
    values: dict[str, torch.Tensor] = {}
    nodes: dict[str, torch.fx.Node] = {}

    class Recording(torch.fx.Interpreter):
        def run_node(self, node: torch.fx.Node) -> Any:
            result = super().run_node(node)
            if node.op == "call_function" and isinstance(result, torch.Tensor):
                values[node.name], nodes[node.name] = result.detach(), node
            return result

    placeholders = [n.name for n in module.graph.nodes if n.op == "placeholder"]
    with torch.no_grad():
        outputs = Recording(module).run(*[feeds.get(name) for name in placeholders])
    return values, nodes, flat_outputs(outputs)


def _exposing(model: Any, names: Sequence[str]) -> Any:
    """A copy of ``model`` whose outputs are the values ``names``."""
    import onnx

    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    del exposed.graph.output[:]
    exposed.graph.output.extend(onnx.ValueInfoProto(name=name) for name in names)
    return exposed


def _cut(model: Any, names: Sequence[str], values: dict[str, torch.Tensor]) -> Any:
    """:func:`_exposing`, each consumer of a value ``names`` reading torch's value from an input
    of its own (``<name>::torch``), in subgraphs too."""
    import onnx

    cut = _exposing(model, names)
    wanted = set(names)
    _rename_inputs(cut.graph, wanted)
    for name in names:
        tensor = values[name]
        cut.graph.input.append(onnx.helper.make_tensor_value_info(
            name + CUT, _onnx_dtype(tensor.dtype), list(tensor.shape)))
    return cut


def _rename_inputs(graph: Any, names: set[str]) -> None:
    for node in graph.node:
        node.input[:] = [name + CUT if name in names else name for name in node.input]
        for attribute in node.attribute:
            for subgraph in [attribute.g, *attribute.graphs] if attribute.HasField("g") else attribute.graphs:
                _rename_inputs(subgraph, names)


def _same_type(declared: int, value: torch.Tensor) -> bool:
    """Whether torch's ``value`` can stand for an ONNX value of element type ``declared`` (0:
    not declared)."""
    try:
        return declared in (0, _onnx_dtype(value.dtype))
    except (TypeError, KeyError):  # a dtype numpy has not (float8, complex32)
        return False


def _onnx_dtype(dtype: torch.dtype) -> int:
    import onnx

    if dtype == torch.bfloat16:
        return onnx.TensorProto.BFLOAT16
    return onnx.helper.np_dtype_to_tensor_dtype(torch.empty((), dtype=dtype).numpy().dtype)


def _run(model: Any, feeds: dict[str, torch.Tensor], names: Sequence[str], runtime: Runtime) -> dict[str, Any]:
    """The values ``names`` of ``model`` run on ``feeds`` by the runtime the graph was verified with."""
    runner: OnnxRunner | WidenedRunner | ReferenceRunner
    if runtime == Runtime.REFERENCE:
        runner = ReferenceRunner(model)
    else:
        runner = WidenedRunner(model) if runtime == Runtime.WIDENED else OnnxRunner(model)
    inputs = [feeds[name] for name in runner.input_names]
    return dict(zip(names, runner(inputs), strict=True))


def _node_error(
    name: str, expected: torch.Tensor, node: torch.fx.Node, producers: dict[str, Any], cut: set[str],
    introduced: Any, accumulated: Any, tolerance: Tolerance,
) -> NodeError | None:
    """The errors of value ``name``; ``None`` when ONNX's value does not hold torch's (another shape)."""
    own, total = _tensor(introduced), _tensor(accumulated)
    if own.numel() != expected.numel():
        return None
    own, total = own.reshape(expected.shape), total.reshape(expected.shape)
    found = compare([own], [expected], tolerance)
    producer = producers[name]
    return NodeError(
        value=name, torch_op=str(node.target), onnx_ops=_segment_ops(producer, producers, cut),
        onnx_node=producer.name, line=_line(producer, node), dtype=str(expected.dtype).removeprefix("torch."),
        introduced=found.max_abs, accumulated=compare([total], [expected], tolerance).max_abs, beyond=not found.ok,
    )


def _segment_ops(last: Any, producers: dict[str, Any], cut: set[str]) -> tuple[str, ...]:
    """The op types of the ONNX nodes computing ``last``'s output from cut values, inputs and
    initializers: the translation of one FX node, each type once, ``last``'s the last."""
    segment, pending = [last], list(last.input)
    while pending:
        name = pending.pop()
        node = producers.get(name)
        if node is None or name in cut or any(node is seen for seen in segment):
            continue
        segment.append(node)
        pending.extend(node.input)
    return tuple(dict.fromkeys(node.op_type for node in reversed(segment)))


def _line(producer: Any, node: torch.fx.Node) -> str:
    trace = next((p.value for p in producer.metadata_props if p.key == STACK_TRACE), "")
    return quoted_model_line(trace or node.meta.get("stack_trace") or "")


def _ratio(error: NodeError, tolerance: Tolerance) -> float:
    """The introduced error relative to the tolerance of its dtype (at least its ``atol``)."""
    atol, rtol = tolerance.for_dtype(getattr(torch, error.dtype))
    return error.introduced / max(atol, rtol, 1e-12)


def _is_reduction(torch_op: str) -> bool:
    return any(word in torch_op for word in REDUCTIONS)


def _tensor(value: Any) -> torch.Tensor:
    """A runtime's output as a tensor (numpy has no bfloat16: a widened graph's come as tensors)."""
    return value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
