"""The ONNX file walked in protobuf's wire format: spans of raw initializer bytes, graph inputs,
weights overwritten in a copy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

from pytest_exportobs.core.onnx_wire import element_types, graph_inputs, raw_data_spans, write_with_weights


def _model(path: Path) -> onnx.ModelProto:
    """``y = x @ w + b`` plus a scalar ``abcd`` whose raw bytes spell its own name, a second
    bias with the same values as the first, and a typed (not raw) initializer."""
    w = numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "w")
    b = numpy_helper.from_array(np.zeros(3, dtype=np.float32), "b")
    b_twin = numpy_helper.from_array(np.zeros(3, dtype=np.float32), "b_twin")
    scalar = numpy_helper.from_array(np.frombuffer(b"abcd", dtype=np.float32).copy(), "abcd")
    typed = helper.make_tensor("typed", TensorProto.FLOAT, [1], [2.0])
    nodes = [helper.make_node("MatMul", ["x", "w"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["y0"]),
             helper.make_node("Add", ["y0", "b_twin"], ["y1"]), helper.make_node("Mul", ["y1", "abcd"], ["y2"]),
             helper.make_node("Mul", ["y2", "typed"], ["y"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])], [w, b, b_twin, scalar, typed])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(path))
    return model


def test_raw_data_spans_are_each_initializers_own_bytes(tmp_path: Path) -> None:
    model = _model(tmp_path / "m.onnx")
    data = (tmp_path / "m.onnx").read_bytes()
    spans = raw_data_spans(memoryview(data))
    assert sorted(spans) == ["abcd", "b", "b_twin", "w"]  # "typed" holds float_data, not raw bytes
    for initializer in model.graph.initializer:
        if initializer.name in spans:
            begin, end = spans[initializer.name]
            assert data[begin:end] == initializer.raw_data
    assert spans["b"] != spans["b_twin"]
    assert data.find(b"abcd") < spans["abcd"][0]  # the name comes first: a search for the bytes finds it


def test_graph_inputs_are_the_value_infos_onnx_parses(tmp_path: Path) -> None:
    model = _model(tmp_path / "m.onnx")
    assert [onnx.ValueInfoProto.FromString(b) for b in graph_inputs(tmp_path / "m.onnx")] == list(model.graph.input)


def test_element_types_are_those_of_the_inputs_outputs_values_and_initializers_onnx_parses(tmp_path: Path) -> None:
    model = _model(tmp_path / "m.onnx")
    assert element_types(tmp_path / "m.onnx") == {TensorProto.FLOAT}
    model.graph.value_info.append(helper.make_tensor_value_info("xw", TensorProto.BFLOAT16, ["batch", 3]))
    model.graph.initializer.append(helper.make_tensor("half", TensorProto.FLOAT16, [1], [1.0]))
    model.graph.output.append(helper.make_tensor_value_info("index", TensorProto.INT64, []))
    onnx.save(model, str(tmp_path / "typed.onnx"))
    graph = onnx.load(str(tmp_path / "typed.onnx")).graph
    parsed = {v.type.tensor_type.elem_type for v in [*graph.input, *graph.output, *graph.value_info]}
    assert element_types(tmp_path / "typed.onnx") == parsed | {t.data_type for t in graph.initializer} == {
        TensorProto.FLOAT, TensorProto.BFLOAT16, TensorProto.FLOAT16, TensorProto.INT64}


def test_weights_written_over_a_copy_are_the_ones_onnxruntime_runs(tmp_path: Path) -> None:
    _model(tmp_path / "m.onnx")
    w = np.full((2, 3), 0.5, dtype=np.float32)
    b_twin = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    assert write_with_weights(tmp_path / "m.onnx", {"w": w.tobytes(), "b_twin": b_twin.tobytes()},
                              tmp_path / "new.onnx") is True
    written = onnx.load(str(tmp_path / "new.onnx"))
    values = {i.name: numpy_helper.to_array(i) for i in written.graph.initializer}
    np.testing.assert_array_equal(values["w"], w)
    np.testing.assert_array_equal(values["b_twin"], b_twin)
    np.testing.assert_array_equal(values["b"], np.zeros(3, dtype=np.float32))
    x = np.array([[1.0, 2.0], [3.0, -1.0]], dtype=np.float32)
    scale = np.frombuffer(b"abcd", dtype=np.float32)[0] * 2.0
    (y,) = onnxruntime.InferenceSession(str(tmp_path / "new.onnx")).run(None, {"x": x})
    np.testing.assert_allclose(y, (x @ w + b_twin) * scale, rtol=1e-6)


def test_the_same_weights_write_the_same_file_and_say_none_differed(tmp_path: Path) -> None:
    model = _model(tmp_path / "m.onnx")
    same = {i.name: i.raw_data for i in model.graph.initializer if i.raw_data}
    assert write_with_weights(tmp_path / "m.onnx", same, tmp_path / "new.onnx") is False
    assert (tmp_path / "new.onnx").read_bytes() == (tmp_path / "m.onnx").read_bytes()
    one_changed = same | {"b": np.ones(3, dtype=np.float32).tobytes()}
    assert write_with_weights(tmp_path / "m.onnx", one_changed, tmp_path / "new.onnx") is True


def test_a_weight_of_another_size_or_not_stored_raw_is_refused_and_nothing_written(tmp_path: Path) -> None:
    _model(tmp_path / "m.onnx")
    with pytest.raises(ValueError, match="the initializer w does not hold 4 raw bytes"):
        write_with_weights(tmp_path / "m.onnx", {"w": b"\0" * 4}, tmp_path / "new.onnx")
    with pytest.raises(ValueError, match="the initializer typed does not hold 4 raw bytes"):
        write_with_weights(tmp_path / "m.onnx", {"typed": b"\0" * 4}, tmp_path / "new.onnx")
    assert not (tmp_path / "new.onnx").exists()
    with pytest.raises(ValueError, match="not an ONNX file|has no graph"):
        raw_data_spans(memoryview(b"\x0f\x01\x02"))
