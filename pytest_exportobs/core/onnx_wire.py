"""An ONNX file read and patched in place of being parsed whole.

An ONNX file is one ``ModelProto`` in protobuf's wire format: fields one after the other, each a
tag (field number and wire type) then its value; a message field is a length and the message's
own fields.  The graph's inputs, its element types and the raw bytes of its initializers can be
found by walking tags, without decoding the weights: a cached graph gets other weights of the
same shapes by overwriting their bytes, the rest of the file written as it was (see
:func:`write_with_weights`).
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

_MODEL_GRAPH = 7  # ModelProto.graph
_GRAPH_INITIALIZER, _GRAPH_INPUT, _GRAPH_OUTPUT, _GRAPH_VALUE_INFO = 5, 11, 12, 13  # GraphProto's
_TENSOR_DATA_TYPE, _TENSOR_NAME, _TENSOR_RAW_DATA = 2, 8, 9  # TensorProto's
_VALUE_TYPE, _TYPE_TENSOR, _TENSOR_ELEM_TYPE = 2, 1, 1  # ValueInfoProto.type, TypeProto.tensor_type, its elem_type
_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5  # wire types


def _varint(data: memoryview, position: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7


def _walk(data: memoryview, begin: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """``(field number, wire type, begin, end)`` of each field between ``begin`` and ``end`` (a
    message's fields): a length-delimited field's value, any other's encoded bytes."""
    position = begin
    while position < end:
        tag, position = _varint(data, position)
        kind, value = tag & 7, position
        if kind == _VARINT:
            _, position = _varint(data, position)
        elif kind == _FIXED64:
            position += 8
        elif kind == _FIXED32:
            position += 4
        elif kind == _LENGTH:
            length, value = _varint(data, position)
            position = value + length
        else:
            raise ValueError(f"wire type {kind} at byte {position}: not an ONNX file")
        yield tag >> 3, kind, value, position


def _fields(data: memoryview, begin: int, end: int) -> Iterator[tuple[int, int, int]]:
    """``(field number, begin, end)`` of each length-delimited field of a message."""
    return ((number, start, stop) for number, kind, start, stop in _walk(data, begin, end) if kind == _LENGTH)


def _varints(data: memoryview, begin: int, end: int) -> dict[int, int]:
    """The values of a message's integer fields, by field number."""
    return {number: _varint(data, start)[0] for number, kind, start, _ in _walk(data, begin, end) if kind == _VARINT}


def _graph(data: memoryview) -> tuple[int, int]:
    for number, begin, end in _fields(data, 0, len(data)):
        if number == _MODEL_GRAPH:
            return begin, end
    raise ValueError("the ONNX file has no graph")


def raw_data_spans(data: memoryview) -> dict[str, tuple[int, int]]:
    """Where the raw bytes of each initializer of the main graph are: ``{name: (begin, end)}``
    (initializers stored otherwise, as typed values or external data, are left out)."""
    spans = {}
    for number, begin, end in _fields(data, *_graph(data)):
        if number != _GRAPH_INITIALIZER:
            continue
        name, raw = None, None
        for field, field_begin, field_end in _fields(data, begin, end):
            if field == _TENSOR_NAME:
                name = bytes(data[field_begin:field_end]).decode()
            elif field == _TENSOR_RAW_DATA:
                raw = (field_begin, field_end)
        if name is not None and raw is not None:
            spans[name] = raw
    return spans


@contextlib.contextmanager
def _mapped(path: Path) -> Iterator[memoryview]:
    """The file's bytes, mapped (its pages read as they are touched, not copied into memory)."""
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        with memoryview(mapped) as data:
            yield data


def graph_inputs(path: Path) -> list[bytes]:
    """The serialized ``ValueInfoProto`` of each input of the file's main graph, in order."""
    with _mapped(path) as data:
        return [bytes(data[b:e]) for number, b, e in _fields(data, *_graph(data)) if number == _GRAPH_INPUT]


def element_types(path: Path) -> set[int]:
    """The element types (``onnx.TensorProto`` data types) of the main graph's inputs, outputs,
    typed values and initializers, read without decoding the weights."""
    types = set()
    with _mapped(path) as data:
        for number, begin, end in _fields(data, *_graph(data)):
            if number == _GRAPH_INITIALIZER:
                types.add(_varints(data, begin, end).get(_TENSOR_DATA_TYPE, 0))
            elif number in (_GRAPH_INPUT, _GRAPH_OUTPUT, _GRAPH_VALUE_INFO):
                for type_begin, type_end in _inner(data, begin, end, _VALUE_TYPE):
                    for tensor_begin, tensor_end in _inner(data, type_begin, type_end, _TYPE_TENSOR):
                        types.add(_varints(data, tensor_begin, tensor_end).get(_TENSOR_ELEM_TYPE, 0))
    return types


def _inner(data: memoryview, begin: int, end: int, number: int) -> Iterator[tuple[int, int]]:
    """``(begin, end)`` of each field ``number`` of the message between ``begin`` and ``end``."""
    return ((start, stop) for field, start, stop in _fields(data, begin, end) if field == number)


def write_with_weights(source: Path, weights: Mapping[str, bytes | memoryview], path: Path) -> bool:
    """Write ``source`` to ``path`` with the raw bytes of the initializers named in ``weights``
    replaced; whether any of them differed from the bytes ``source`` holds.  Raises
    ``ValueError`` when one is not stored as raw bytes of that length (and writes nothing).
    ``source`` is mapped, not read into memory: the file is written from its pages and from
    ``weights`` themselves (timm's graphs: about 0.8 GB a rerun)."""
    with _mapped(source) as view:
        return _write_replaced(view, raw_data_spans(view), weights, path)


def _write_replaced(
    view: memoryview, spans: Mapping[str, tuple[int, int]], weights: Mapping[str, bytes | memoryview], path: Path,
) -> bool:
    """Write the file ``view`` holds to ``path``, the ``spans`` of ``weights`` replaced by them
    (see :func:`write_with_weights`)."""
    replaced = []
    for name, values in weights.items():
        begin, end = spans.get(name, (0, -1))
        if end - begin != len(values):
            raise ValueError(f"the initializer {name} does not hold {len(values)} raw bytes")
        replaced.append((begin, end, values))
    changed = False
    position = 0
    with path.open("wb") as out:
        for begin, end, values in sorted(replaced, key=lambda span: span[0]):
            changed = changed or not np.array_equal(np.frombuffer(view[begin:end], np.uint8),
                                                    np.frombuffer(values, np.uint8))
            out.write(view[position:begin])
            out.write(values)
            position = end
        out.write(view[position:])
    return changed
