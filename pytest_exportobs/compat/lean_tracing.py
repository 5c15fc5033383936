"""What a check turns off in torch's tracing machinery for speed, with the private torch names it
takes (``tests/unit/test_compat.py`` checks them against the installed torch): each part leaves
the traced program as it is.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any, NamedTuple

import torch
import torch.fx.proxy as fx_proxy

__all__ = ["dispatches_cached", "lean_tracing", "sympy_caches_widened"]

_LAYER_NORM = torch.ops.aten.native_layer_norm.default
_ADDMM = torch.ops.aten.addmm.default


@contextlib.contextmanager
def lean_tracing() -> Iterator[None]:
    """torch's tracing machinery without four costs that buy a check nothing, for the block
    (entered by a ``with`` statement: the frame of that statement is where the stacks read at
    traced nodes stop being walked).

    - The fake tensors' dispatch cache (``torch._dynamo.config.fake_tensor_cache_enabled``): with
      symbolic sizes, each hit rebuilds its outputs' sizes from the entry by symbolic arithmetic
      and each miss records them, which costs more than computing them again (torch.export of a
      2-layer GPT-2 with two dynamic dims: 0.51 s -> 0.32 s on torch 2.13, 0.41 -> 0.32 s on 2.15).
      The cache is a memo of the same computation: the traced program does not change.  The
      fake tensors' mode keeps the setting it was made with: :func:`dispatches_cached` turns
      the cache on again for what is later traced on the program's values.
    - The handlers pytest's logging plugin attaches to every non-propagating logger, torch's
      structured trace (``torch.__trace``) among them: with a handler there, torch builds each
      event's record (a symbolized stack per guard, graphs printed) for pytest to capture and
      nobody to read.  Other handlers (torch's own for ``TORCH_TRACE``) stay.
    - The symbolization of every frame of the stack at each traced node (``torch.fx.proxy``'s
      ``CapturedTraceback``): the tracer keeps the frames from the model's ``forward`` on, as
      text; :class:`_FramesBelow` reads the same frames from Python, those outside the block
      once, and the source lines of those kept only, which makes the same ``stack_trace`` (a
      trace under pytest's 80 frames: 10 % of torch.export's time).
    - The sizes of the outputs of a layer norm and of a matrix product with a bias (``nn.Linear``,
      GPT-2's ``Conv1D``) computed op by op in symbolic arithmetic by torch's decompositions
      (together a third of a GPT-2's forward as traced): :func:`_layer_norm_sizes`, :func:`_addmm_sizes`.

    It also widens sympy's caches for the rest of the process (:func:`sympy_caches_widened`).
    """
    sympy_caches_widened()
    import torch._dynamo.config as dynamo_config
    from torch._subclasses.fake_impls import get_fast_op_impls

    trace_log = logging.getLogger("torch.__trace")
    pytests = [handler for handler in trace_log.handlers if type(handler).__module__ == "_pytest.logging"]
    for handler in pytests:
        trace_log.removeHandler(handler)
    symbolized = fx_proxy.CapturedTraceback
    fx_proxy.CapturedTraceback = _FramesBelow.of(sys._getframe(2))  # type: ignore[misc, assignment]  # 2: past contextlib's __enter__
    fast = get_fast_op_impls()
    previous = {op: fast[op] for op in _SIZES if op in fast}
    fast.update(_SIZES)
    try:
        with dynamo_config.patch(fake_tensor_cache_enabled=False):
            yield
    finally:
        for op in _SIZES:
            fast.pop(op)
        fast.update(previous)
        fx_proxy.CapturedTraceback = symbolized  # type: ignore[misc]
        for handler in pytests:
            trace_log.addHandler(handler)


# entries per cached sympy function for the checks (sympy's default: 1000).  A Swin's trace
# builds about 8000 distinct sums and products: with 1000 the cache of ``AssocOp.__new__`` turns
# over within a trace and a second trace of the model builds 3800 of them again (2.7 s -> 1.9 s).
_SYMPY_CACHE_ENTRIES = 50_000


def sympy_caches_widened() -> None:
    """sympy's caches (``sympy.core.cache.CACHE``, one ``lru_cache`` per cached function, of
    ``SYMPY_CACHE_SIZE`` entries) made :data:`_SYMPY_CACHE_ENTRIES` deep for the rest of the
    process, their entries dropped once: symbolic sizes are sympy expressions, and torch.export
    builds the same ones over and over within a trace and from one trace of a model to the next.
    Nothing changes when the user set ``SYMPY_CACHE_SIZE`` or turned the cache off, nor for a
    cache already as deep.  What a cached function returns does not depend on the cache."""
    if "SYMPY_CACHE_SIZE" in os.environ:
        return
    from sympy.core.cache import CACHE

    for cached in CACHE:
        cell = dict(zip(cached.__code__.co_freevars, cached.__closure__ or ())).get("cfunc")
        memo = getattr(cell, "cell_contents", None)
        if cell is None or not isinstance(memo, functools._lru_cache_wrapper):
            continue
        depth = memo.cache_parameters()["maxsize"]
        if depth is None or depth >= _SYMPY_CACHE_ENTRIES:
            continue
        wider = functools.lru_cache(_SYMPY_CACHE_ENTRIES, typed=True)(memo.__wrapped__)
        cell.cell_contents = wider
        cached.cache_info, cached.cache_clear = wider.cache_info, wider.cache_clear


class _Frame(NamedTuple):
    """A frame as ``traceback.StackSummary.from_list`` takes it: torch's tracer reads the name
    and file of every frame, and makes a ``FrameSummary`` (its source line read) of those it
    keeps only."""

    filename: str
    lineno: int
    name: str
    line: str | None = None


def _described(frame: FrameType) -> _Frame:
    return _Frame(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)


@dataclass(frozen=True)
class _FramesBelow:
    """``CapturedTraceback`` for a block whose ``with`` statement is in ``anchor``: the frames
    outside the block do not change while it runs, they are read once."""

    anchor: FrameType
    outside: list[_Frame]

    @classmethod
    def of(cls, anchor: FrameType) -> _FramesBelow:
        outside, frame = [], anchor.f_back
        while frame is not None:
            outside.append(_described(frame))
            frame = frame.f_back
        return cls(anchor, outside)

    def extract(self) -> _PythonFrames:
        """The stack where this is called, innermost first."""
        frames = []
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:
            frames.append(_described(frame))
            if frame is self.anchor:
                return _PythonFrames(frames + self.outside)
            frame = frame.f_back
        return _PythonFrames(frames)  # another thread's stack, read whole


class _PythonFrames:
    """A stack as ``torch.utils._traceback``'s ``CapturedTraceback`` gives it for
    ``extract().summary()``."""

    __slots__ = ("frames",)

    def __init__(self, frames: list[_Frame]) -> None:
        self.frames = frames  # innermost first

    def summary(self) -> traceback.StackSummary:
        """The frames torch's tracers can keep, outermost first: each keeps either the frames
        from the outermost ``forward`` on or the ``forward`` frames, and with either those of
        ``torch/__init__.py`` and of the functions registered as anchors
        (``torch.fx.traceback.annotate_fn``); the frames outside the outermost ``forward`` but
        these (pytest's, torch.export's: most of them) are left out."""
        anchors: set[tuple[str, str]] = getattr(fx_proxy, "_STACK_TRACE_ANCHORS", set())
        outermost_first = self.frames[::-1]
        first = next((i for i, frame in enumerate(outermost_first) if frame.name == "forward"), len(outermost_first))
        kept = [frame for frame in outermost_first[:first]
                if frame.filename.endswith("torch/__init__.py") or (frame.filename, frame.name) in anchors]
        return traceback.StackSummary(kept + outermost_first[first:])  # type: ignore[arg-type]  # see _Frame


def _layer_norm_sizes(
    mode: Any, input: torch.Tensor, normalized_shape: Sequence[int], weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None, eps: float = 1e-5,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``aten.native_layer_norm`` on fake tensors with symbolic sizes (a fast implementation of
    torch's fake tensors, as their binary ops have): the outputs of torch's reference made
    directly when the normalized dims are static and the weight and bias have them, where each
    check the reference makes is decided without a guard.  The output is contiguous in the
    input's dtype, the mean and inverse deviation keep the normalized dims as ones (in the
    input's dtype on a CPU, as the reference casts them there, else in the dtype it computes
    in).  Anything else goes to the reference."""
    from torch._decomp import decomposition_table
    from torch._prims_common import get_computation_dtype

    normalized = list(normalized_shape)
    kept = input.dim() - len(normalized)
    weights = [t for t in (weight, bias) if t is not None]
    weight_sizes = [n for t in weights for n in t.shape]
    sizes = [*normalized, *input.shape[kept:], *weight_sizes] if normalized and kept >= 0 else []
    if not (sizes and all(type(n) is int for n in sizes) and not input.is_complex()
            and list(input.shape[kept:]) == normalized
            and all(list(t.shape) == normalized and t.device == input.device for t in weights)):
        with mode:
            return decomposition_table[_LAYER_NORM](input, normalized_shape, weight, bias, eps)
    statistics = [*input.shape[:kept], *[1] * len(normalized)]
    statistics_dtype = input.dtype if input.device.type in ("cpu", "mtia") else get_computation_dtype(input.dtype)
    mean, inverse_deviation = (_fake_empty(mode, statistics, statistics_dtype, input.device) for _ in range(2))
    return _fake_empty(mode, list(input.shape), input.dtype, input.device), mean, inverse_deviation


def _addmm_sizes(
    mode: Any, bias: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, *, beta: Any = 1, alpha: Any = 1,
) -> torch.Tensor:
    """``aten.addmm`` on fake tensors with symbolic sizes: the output of torch's decomposition
    (contiguous, ``mat1``'s rows by ``mat2``'s columns) made directly when the product's inner
    and outer sizes are static and the bias is a row of floating point values in the matrices'
    dtype, where each check the decomposition makes is decided without a guard.  Anything else
    goes to the decomposition."""
    from torch._decomp import decomposition_table

    sizes = [*mat1.shape[1:], *mat2.shape, *bias.shape] if mat1.dim() == mat2.dim() == 2 else []
    if not (sizes and all(type(n) is int for n in sizes) and mat1.shape[1] == mat2.shape[0]
            and list(bias.shape) in ([mat2.shape[1]], [1, mat2.shape[1]]) and bias.dtype.is_floating_point
            and bias.dtype == mat1.dtype == mat2.dtype and bias.device == mat1.device == mat2.device):
        with mode:
            return decomposition_table[_ADDMM](bias, mat1, mat2, beta=beta, alpha=alpha)
    return _fake_empty(mode, [mat1.shape[0], mat2.shape[1]], bias.dtype, bias.device)


def _fake_empty(mode: Any, shape: list[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A contiguous fake tensor of ``mode`` (sizes may be symbolic), as torch's fast
    implementations make their outputs."""
    from torch._subclasses.fake_tensor import FakeTensor

    return FakeTensor(mode, torch.empty(shape, dtype=dtype, device="meta"), device=device)


_SIZES: dict[Any, Callable[..., Any]] = {_LAYER_NORM: _layer_norm_sizes, _ADDMM: _addmm_sizes}


def dispatches_cached(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """``program`` with the fake tensors it was traced with caching their dispatches again, as
    torch's configuration says (:func:`lean_tracing` traced it without): the decompositions later
    traced on its recorded values repeat ops at sizes the trace fixed, where the cache pays
    (decomposition summed over timm's 42 graphs: 13.0 s without, 6.7 s with)."""
    import torch._dynamo.config as dynamo_config
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode([node.meta.get("val") for node in program.graph.nodes if node.op == "placeholder"])
    if mode is not None:
        mode.cache_enabled = dynamo_config.fake_tensor_cache_enabled and not mode.propagate_real_tensors
    return program
