"""ONNX translations of ops torch's torchlib cannot translate, registered before a translation.

The mixture-of-experts matmul: transformers' experts run ``grouped_mm`` (the custom op
``transformers.grouped_mm_fallback``, or ``aten._grouped_mm`` with offsets in half precision);
torchlib has no translation of the first and refuses offsets in the second ("Grouped matmul
with offsets (ragged/MoE) is not supported").  The translation here is the one transformers'
own exporter ships (``transformers.exporters.exporter_onnx``), written anew: one ``MatMul`` per
group of rows, the number of groups being static (the experts' weights).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch


def grouped_matmul(mat_a: Any, mat_b: Any, offs: Any, bias: Any = None, out_dtype: Any = None) -> Any:
    """``out[r] = mat_a[r] @ mat_b[g] (+ bias[g])`` for the rows ``r`` of group ``g``:
    ``mat_a`` ``(M, K)`` holds the rows sorted by group, ``offs`` ``(G,)`` the end of each group,
    ``mat_b`` ``(G, K, N)`` the weights of each."""
    from onnxscript import INT64, opset18

    op: Any = opset18  # called on the exporter's symbolic values, which onnxscript's stubs do not type

    groups = mat_b.shape[0]
    if not isinstance(groups, int) or out_dtype is not None:
        raise ValueError("grouped_mm translates with a static number of groups and no out_dtype")
    ends = op.Cast(offs, to=INT64.dtype)
    start = op.Constant(value_int=0)
    outputs = []
    for group in range(groups):
        index = op.Constant(value_int=group)
        end = op.Gather(ends, index, axis=0)
        rows = op.Gather(mat_a, op.Range(start, end, op.Constant(value_int=1)), axis=0)
        product = op.MatMul(rows, op.Gather(mat_b, index, axis=0))
        outputs.append(product if bias is None else op.Add(product, op.Gather(bias, index, axis=0)))
        start = end
    return op.Concat(*outputs, axis=0)


def custom_translations() -> dict[Any, Callable[..., Any]]:
    """The ops of this module's translations that exist in this process (transformers' custom op
    once transformers is imported)."""
    found: dict[Any, Callable[..., Any]] = {torch.ops.aten._grouped_mm.default: grouped_matmul}
    if "transformers" in sys.modules and hasattr(torch.ops.transformers, "grouped_mm_fallback"):
        found[torch.ops.transformers.grouped_mm_fallback.default] = grouped_matmul
    return found
