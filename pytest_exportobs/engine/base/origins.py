"""Where a node of an exported ONNX graph comes from: the model's source line torch.onnx records
on it (``pkg.torch.onnx.stack_trace``, the stack trace of the FX node it translates)."""

from __future__ import annotations

from pathlib import Path

from ...compat.onnxruntime_text import failing_node
from .frames import quoted_model_line

STACK_TRACE = "pkg.torch.onnx.stack_trace"


def node_line(onnx_path: str | Path, node_name: str) -> str:
    """``file:line: code`` of the model's code behind node ``node_name`` (innermost frame of the
    model's code in its stack trace); ``""`` when the file, the node or its trace is missing."""
    import onnx
    from google.protobuf.message import DecodeError

    try:
        model = onnx.load(str(onnx_path), load_external_data=False)
    except (OSError, DecodeError):
        return ""
    graphs = [model.graph.node, *(function.node for function in model.functions)]
    for nodes in graphs:
        for node in nodes:
            if node.name == node_name:
                trace = next((p.value for p in node.metadata_props if p.key == STACK_TRACE), "")
                return quoted_model_line(trace)
    return ""


def failure_line(onnx_path: str | Path, message: str) -> str:
    """The model's line behind the node onnxruntime names in a failed run's ``message``; ``""``
    when it names none or the node has no trace."""
    node = failing_node(message)
    return node_line(onnx_path, node) if node and onnx_path else ""
