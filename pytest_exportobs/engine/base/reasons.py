"""One-line reasons a user can act on, from the exceptions of the export stages."""

from __future__ import annotations

from typing import Any

import torch

from ...compat.torch_text import translated_op, unsupported_ops
from ...core.text import first_line
from ...core.vocabulary import Stage
from .frames import quoted_model_line, user_frame

# What a failure mentions -> the known way around it.
HINTS = {
    "grouped_mm": 'transformers\' MoE experts ("grouped_mm") translate with a static number of experts and no '
                  'out_dtype: else build the model with experts_implementation="batched_mm" in its config',
    "flash_attn": 'flash attention does not export: build the model with attn_implementation="sdpa" (or "eager")',
    "flex_attention": 'flex attention does not export: build the model with attn_implementation="sdpa" (or "eager")',
    "not in Core ATen opset": "ExecuTorch's edge dialect takes core ATen ops only: the op needs a decomposition "
                              "(or a kernel of a backend that takes it)",
}


def one_line_reason(stage: Stage, error: BaseException) -> str:
    """A single line a user can act on: the message's first line, the unsupported ops of an ONNX
    translation failure, the user source line where torch.export failed, and a hint when the
    failure has a known way around it."""
    message = first_line(str(error)) or type(error).__name__
    if stage == Stage.LOWER:
        return _with_hint(f"{type(error).__name__}: {message}{_lowered_node(error)}", error)
    ops = unsupported_ops(str(error)) if stage in (Stage.DECOMPOSE, Stage.ONNX_TRANSLATE) else []
    location = user_frame(error)
    node = translated_op(str(error))
    if ops:
        reason = f"no ONNX translation for {', '.join(ops)}"
    elif stage == Stage.ONNX_TRANSLATE and node:
        reason = f"{type(error).__name__}: cannot translate {node} to ONNX"
    else:
        reason = f"{type(error).__name__}: {message}" + (f" (at {location})" if location else "")
    return _with_hint(reason, error)


def _with_hint(reason: str, error: BaseException) -> str:
    hint = next((text for key, text in HINTS.items() if key in _full_text(error)), "")
    return f"{reason}; hint: {hint}" if hint else reason


def _lowered_node(error: BaseException) -> str:
    """`` (aten.view_copy.default at model.py:12: code)``: the op ExecuTorch's lowering failed on,
    the innermost graph node among the locals of ``error``'s frames, and the model's line it
    comes from; ``""`` when no frame holds one."""
    frames = []
    tb = error.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        node = next((v for v in frame.f_locals.values() if isinstance(v, torch.fx.Node) and v.op == "call_function"),
                    None)
        if node is not None:
            line = quoted_model_line(node.meta.get("stack_trace") or "")
            return f" ({op_name(node.target)}{f' at {line}' if line else ''})"
    return ""


def op_name(target: Any) -> str:
    """``aten.index.Tensor`` of an edge op, the function's name of anything else."""
    if isinstance(getattr(target, "_op", None), torch._ops.OpOverload):  # an EdgeOpOverload
        target = target._op
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return getattr(target, "__name__", str(target))


def _full_text(error: BaseException) -> str:
    """The messages of an error and of its causes."""
    texts: list[str] = []
    current: BaseException | None = error
    while current is not None and len(texts) < 10:
        texts.append(str(current))
        current = current.__cause__ or current.__context__
    return "\n".join(texts)
