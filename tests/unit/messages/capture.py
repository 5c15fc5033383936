"""Capture the text the parsers of ``pytest_exportobs.compat`` read, from the installed torch and
onnxruntime, into ``torch-<version>.json`` beside this file (``test_compat.py`` parses them all).

    python tests/unit/messages/capture.py     # once per supported torch, in its environment
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import numpy
import onnx
import onnxruntime
import torch
from onnx import TensorProto, helper

HERE = Path(__file__).parent


class FixedBatch(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(3, -1)


class FixedGrid(torch.nn.Module):
    """A stride-2 stem before position embeddings of a fixed 8x8 grid: solving the guards pins
    height and width (EfficientViT-M, TinyViT)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 3, 3, stride=2, padding=1)
        self.positions = torch.nn.Parameter(torch.zeros(1, 3, 8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stem(x) + self.positions


class ValueCheck(torch.nn.Module):
    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if labels.max() >= 5:
            raise ValueError("labels out of range")
        return x * 2


class Records(logging.Handler):
    """The records of torch's symbolic-shapes logger: message and arguments (integers kept)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[list[Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args if isinstance(record.args, tuple) else ()
        kept = [int(a) if getattr(a, "is_Integer", False) or isinstance(a, int) else str(a) for a in args]
        self.records.append([str(record.msg), kept])


def error_text(call: Any) -> str:
    try:
        call()
    except Exception as e:
        return str(e)
    raise AssertionError("expected an error")


def rejected_dims() -> tuple[str, list[list[Any]]]:
    """torch.export's message rejecting a dynamic batch the model pins to 3, and the log records."""
    logger = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    handler, saved = Records(), (logger.level, logger.propagate)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        message = error_text(lambda: torch.export.export(
            FixedBatch(), (torch.randn(3, 4),), dynamic_shapes=({0: torch.export.Dim("batch")},)))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]
    return message, handler.records


def specializations_required() -> str:
    """torch.export's message when solving its guards pins dims, as torch.onnx.export captures
    (size-oblivious, deferred runtime asserts)."""
    dims = {0: torch.export.Dim("batch"), 2: torch.export.Dim("height"), 3: torch.export.Dim("width")}
    with torch.fx.experimental._config.patch(backed_size_oblivious=True):
        return error_text(lambda: torch.export.export(
            FixedGrid(), (torch.randn(2, 3, 16, 16),), dynamic_shapes=(dims,),
            prefer_deferred_runtime_asserts_over_guards=True))


def untranslatable() -> str:
    """torch.onnx's message for an op without ONNX translation."""
    torch.library.define("exportobs_capture::opaque", "(Tensor x) -> Tensor")
    torch.library.impl("exportobs_capture::opaque", "CompositeExplicitAutograd")(lambda x: x.clone())
    torch.library.register_fake("exportobs_capture::opaque")(lambda x: torch.empty_like(x))

    class Opaque(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.ops.exportobs_capture.opaque(x) + 1

    return error_text(lambda: torch.onnx.export(Opaque(), (torch.randn(2, 3),), dynamo=True, verbose=False))


def missing_kernel(op: str) -> str:
    """onnxruntime's message for a bfloat16 ``op`` (of two inputs) its CPU provider cannot run."""
    node = helper.make_node(op, ["x", "w"], ["y"], name=f"node_{op}_0")
    one = helper.make_tensor("w", TensorProto.BFLOAT16, [1, 1, 1], [16256])  # 1.0 as bfloat16 bits
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [1, 1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, None)], [one],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    serialized = model.SerializeToString()
    return error_text(lambda: onnxruntime.InferenceSession(serialized, providers=["CPUExecutionProvider"]))


def failed_run() -> str:
    """onnxruntime's message for a node that fails at run time (a Reshape to a size the input
    does not have)."""
    node = helper.make_node("Reshape", ["x", "shape"], ["y"], name="node_view")
    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [2, 3])
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [shape],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return error_text(lambda: session.run(None, {"x": numpy.zeros(5, dtype=numpy.float32)}))


def main() -> int:
    constraints, records = rejected_dims()
    captured = {
        "torch": torch.__version__.split("+")[0], "onnxruntime": onnxruntime.__version__, "onnx": onnx.__version__,
        "constraints_violated": constraints,
        "specializations_required": specializations_required(),
        "shape_records": records,
        "data_dependent": error_text(lambda: torch.export.export(
            ValueCheck(), (torch.randn(2, 3), torch.tensor([1, 2])))),
        "untranslatable": untranslatable(),
        "type_error": missing_kernel("Conv"),  # the type check of an op at the graph's opset
        "not_implemented": missing_kernel("Add"),  # no kernel registered for the type
        "failed_run": failed_run(),
    }
    path = HERE / f"torch-{captured['torch']}.json"
    path.write_text(json.dumps(captured, indent=1) + "\n")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
