"""Parsers of onnxruntime's errors: which op of a graph has no kernel in the session's provider,
and which node failed a run.  Tested on messages captured from onnxruntime
(``tests/unit/test_compat.py``)."""

from __future__ import annotations

import re

# the type check of an op that takes no half-precision input at the graph's opset
_HALF_TYPE_ERROR = re.compile(r"Type Error: Type 'tensor\((bfloat16|float16)\)' of input parameter")


def lacks_kernel(message: str) -> bool:
    """Whether a session failed to load for want of a kernel (``NOT_IMPLEMENTED``, or a type
    error on a float16/bfloat16 input of an op at the graph's opset)."""
    return "NOT_IMPLEMENTED" in message or _HALF_TYPE_ERROR.search(message) is not None


def kernel_lacked(message: str) -> str:
    """The op without a kernel, as a user reads it: ``Conv (opset 18, node node_Conv_3)``, or
    ``Add (node n1) at the graph's opset``; ``"an op of the graph"`` when the message names none."""
    found = re.search(r"implementation for (\S+?)\((\d+)\) node with name '([^']*)'", message)
    if found:
        return f"{found[1]} (opset {found[2]}, node {found[3]})"
    typed = re.search(r"of operator \((\w+)\) in node \(([^)]*)\)", message)
    return f"{typed[1]} (node {typed[2]}) at the graph's opset" if typed else "an op of the graph"


def failing_node(message: str) -> str | None:
    """The name of the node a run failed in ("... while running Reshape node. Name:'node_view'
    ..."), ``None`` when the message names none."""
    found = re.search(r"while running \w+ node\. Name:'([^']*)'", message)
    return found[1] if found else None
