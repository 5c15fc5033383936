"""A float16/bfloat16 ONNX graph computed as a half-precision kernel computes it: in float32 inside
each op, rounded to the half type at the op's outputs.

onnxruntime's CPU provider lacks many half-precision kernels (``Add``, ``Mul``, ``Where`` in
bfloat16), and onnx's reference evaluator computes bfloat16 in numpy at every step of an op (a lone
bfloat16 ``GroupNorm`` comes out 3.35 off there, 0.012 in torch).  :func:`widened` rewrites the graph
so that every half-precision value is a float32 one: inputs, initializers and constants widened
exactly, each op's half-precision output rounded by a ``Cast`` to its type and back.  onnxruntime then
runs it with its float32 kernels, keeping its own output shapes; the runner widens the inputs and
narrows the outputs to their declared types.
"""

from __future__ import annotations

from typing import Any

import numpy as np

ROUNDED = "::wide"  # suffix of an op's float32 output, before its rounding to the half type


def half_types() -> frozenset[int]:
    import onnx

    return frozenset({onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16})


def widened(model: Any) -> tuple[Any, list[int]]:
    """``model`` (an ``onnx.ModelProto``) with its half-precision values in float32, rounded at
    each op's outputs; and the element type each graph output had."""
    import onnx

    inferred = onnx.shape_inference.infer_shapes(model)
    types = {value.name: value.type.tensor_type.elem_type
             for value in (*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output)}
    types.update({tensor.name: tensor.data_type for tensor in model.graph.initializer})
    outputs = [value.type.tensor_type.elem_type for value in model.graph.output]
    wide = onnx.ModelProto()
    wide.CopyFrom(model)
    _widen_graph(wide.graph, types)
    return wide, outputs


def _widen_graph(graph: Any, types: dict[str, int]) -> None:
    import onnx

    half = half_types()
    for value in (*graph.input, *graph.output):
        if value.type.tensor_type.elem_type in half:
            value.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
    del graph.value_info[:]  # the types are float32 now: let onnxruntime infer them again
    for index, tensor in enumerate(graph.initializer):
        if tensor.data_type in half:
            graph.initializer[index].CopyFrom(_widened_tensor(tensor))
    nodes = []
    for node in graph.node:
        for attribute in node.attribute:
            _widen_attribute(attribute, types)
        nodes.append(node)
        for position, name in enumerate(node.output):
            if name and types.get(name) in half:
                node.output[position] = name + ROUNDED
                nodes += [onnx.helper.make_node("Cast", [name + ROUNDED], [name + "::half"], to=types[name]),
                          onnx.helper.make_node("Cast", [name + "::half"], [name], to=onnx.TensorProto.FLOAT)]
    del graph.node[:]
    graph.node.extend(nodes)


def _widen_attribute(attribute: Any, types: dict[str, int]) -> None:
    """A type attribute (``Cast``'s ``to``, ``dtype``) naming a half type names float32; a tensor
    attribute (``Constant``'s, ``ConstantOfShape``'s ``value``) of a half type is widened; a
    subgraph (``If``, ``Loop``, ``Scan``) is widened as the graph."""
    import onnx

    half = half_types()
    if attribute.name in ("to", "dtype") and attribute.type == onnx.AttributeProto.INT and attribute.i in half:
        attribute.i = onnx.TensorProto.FLOAT
    elif attribute.type == onnx.AttributeProto.TENSOR and attribute.t.data_type in half:
        attribute.t.CopyFrom(_widened_tensor(attribute.t))
    for subgraph in [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else attribute.graphs:
        _widen_graph(subgraph, types)


def _widened_tensor(tensor: Any) -> Any:
    from onnx import numpy_helper

    return numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float32), tensor.name)
