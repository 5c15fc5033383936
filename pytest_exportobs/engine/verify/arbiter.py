"""Eager is the reference, not the truth: when an exported graph and eager disagree, the model run
in float64 on the same inputs decides which side rounds.

The graph passes a mismatch with eager when it is within tolerance of float64 and no further from
it than eager (an ``argmin`` over two codebook entries 4e-8 apart that eager's float32 sum flips;
half-precision eager rounding where a deployed kernel keeps float32 inside an op).  A half-precision
model rounds at every op on either side, and a graph of decomposed ops rounds at more places than
torch's fused kernels: there eager's own largest difference from float64, when it is rounding
(:data:`ROUNDING_UNITS` units in the last place of the output's largest magnitude at most),
measures the noise both sides carry, and the graph passes within tolerance of float64 widened by
:data:`NOISE_FACTOR` times that (two computations rounding apart: on a bfloat16 VAE their largest
errors range over 0.09-0.20 alike, either side up to twice the other's on one input).
Where the graph is further, the mismatch stands.  Nothing is decided when the model cannot run in
float64 (an op without a float64 kernel, a cast to its own dtype inside) or two float64 runs differ
(random draws).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ...core.trees import detached_clone, flat_outputs
from ..base.eager import ModelRaised, call_model

MAX_FLOAT64_WEIGHTS = 100_000_000  # values of a model copied to float64 to arbitrate (800 MB)


ROUNDING_UNITS = 16  # eager's difference from float64, in units of the last place, still taken as rounding
NOISE_FACTOR = 2  # how much further from float64 than eager a graph rounding as much may be on one input


@dataclass(frozen=True)
class Arbitration:
    """The largest differences of eager's and the graph's outputs from float64's, and whether the
    graph rounds no worse than eager (``for_graph``)."""

    eager: float
    graph: float
    for_graph: bool


class Distance(Protocol):
    """What a comparison tells the arbiter: the largest difference, and whether it is within tolerance."""

    ok: bool
    max_abs: float


# compares outputs with references (flat tensors) as the check does, each output judged with the
# tolerance of its dtype in the third argument: (actual, expected, dtypes) -> distance
Comparison = Callable[[Sequence[Any], Sequence[Any], Sequence[torch.dtype]], Distance]


class Float64Copy:
    """A float64 copy of a model, made on first use (:meth:`get`); ``why_not`` says why there is none."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self._copy: torch.nn.Module | None = None
        self.why_not = ""

    def get(self) -> torch.nn.Module | None:
        if self._copy is None and not self.why_not:
            weights = sum(p.numel() for p in (*self.module.parameters(), *self.module.buffers()))
            if weights > MAX_FLOAT64_WEIGHTS:
                self.why_not = f"{weights} weights, over {MAX_FLOAT64_WEIGHTS} copied to float64"
                return None
            try:
                self._copy = copy.deepcopy(self.module).to(torch.float64).eval()
            except Exception as e:  # a module that cannot be copied (open handles, hooks holding locks)
                self.why_not = f"the model cannot be copied to float64 ({type(e).__name__}: {e})"
        return self._copy


@dataclass(frozen=True)
class Float64Model:
    """The float64 copy's ``method`` called on flat leaves (``split`` makes them ``(args,
    kwargs)``), their floating-point tensors widened to float64."""

    copy: Float64Copy
    method: str
    split: Callable[[Sequence[Any]], tuple[tuple, dict]]

    def __call__(self, leaves: Sequence[Any]) -> list[torch.Tensor | None] | None:
        """The float64 model's flat outputs on ``leaves``; ``None`` when it cannot run them."""
        model = self.copy.get()
        if model is None:
            return None
        args, kwargs = self.split([_widened(leaf) for leaf in leaves])
        try:
            with torch.no_grad():
                return flat_outputs(call_model(getattr(model, self.method), *args, **kwargs))
        except ModelRaised:  # an op without a float64 kernel, a cast to the model's own dtype
            return None


def arbitrate(
    float64: Float64Model, leaves: Sequence[Any], actual: Sequence[Any], expected: Sequence[torch.Tensor],
    compare: Comparison, order: Callable[[Sequence[Any]], list[Any]],
) -> Arbitration | None:
    """Whether the graph's outputs (``actual``) round no worse than eager's (``expected``) against
    the float64 model's on ``leaves`` (``order`` puts those in the graph's order, as ``expected``
    is), each compared as the check compares (``compare``: the tolerance of each eager output's
    dtype, padded positions left out), and both distances; ``None`` when float64 cannot decide
    (the model fails in float64 or draws at random, its outputs are not eager's in number and
    shape, or eager's are infinitely off)."""
    truth = _truth(float64, leaves, order, expected)
    got = [torch.as_tensor(a) for a in actual if a is not None]
    if truth is None or len(got) != len(truth) or any(g.shape != t.shape for g, t in zip(got, truth)):
        return None
    dtypes = [e.dtype for e in expected]
    eager, graph = compare(expected, truth, dtypes), compare(got, truth, dtypes)
    if not math.isfinite(eager.max_abs):
        return None
    if graph.ok and graph.max_abs <= eager.max_abs:
        return Arbitration(eager.max_abs, graph.max_abs, True)
    noise = NOISE_FACTOR * eager.max_abs if _rounding(eager.max_abs, expected, truth) else 0.0
    envelope = [_envelope(g, e, t, noise) for g, e, t in zip(got, expected, truth)]
    return Arbitration(eager.max_abs, graph.max_abs, bool(noise) and compare(got, envelope, dtypes).ok)


def _truth(
    float64: Float64Model, leaves: Sequence[Any], order: Callable[[Sequence[Any]], list[Any]],
    expected: Sequence[torch.Tensor],
) -> list[torch.Tensor] | None:
    """The float64 model's outputs on ``leaves`` in the graph's order; ``None`` when it cannot run
    them, they are not eager's in number and shape, or a second run gives others."""
    runs = [float64(detached_clone(list(leaves))) for _ in range(2)]
    if runs[0] is None or runs[1] is None:
        return None
    first, second = order(runs[0]), order(runs[1])
    if len(first) != len(expected) or any(t.shape != e.shape for t, e in zip(first, expected)):
        return None
    same = all(torch.equal(a, b) or (a.is_floating_point() and torch.allclose(a, b, rtol=1e-9, atol=1e-12,
                                                                              equal_nan=True))
               for a, b in zip(first, second))
    return first if same else None


def _rounding(distance: float, expected: Sequence[torch.Tensor], truth: Sequence[torch.Tensor]) -> bool:
    """Whether eager's largest difference from float64 is rounding of a half-precision model: every
    floating-point output in float16 or bfloat16, the difference within :data:`ROUNDING_UNITS`
    units in the last place of the largest magnitude float64 gives."""
    floating = [(e, t) for e, t in zip(expected, truth) if e.is_floating_point()]
    if not floating or any(e.dtype not in (torch.float16, torch.bfloat16) for e, _ in floating):
        return False
    unit = max((last_place(float(t.abs().max()), e.dtype) for e, t in floating if t.numel()), default=0.0)
    return distance <= ROUNDING_UNITS * unit


def last_place(magnitude: float, dtype: torch.dtype) -> float:
    """One unit in the last place of ``magnitude`` in ``dtype`` (0 for integers and bool)."""
    if not dtype.is_floating_point or not 0 < magnitude < math.inf:
        return 0.0
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(magnitude))


def _envelope(graph: torch.Tensor, eager: torch.Tensor, truth: torch.Tensor, margin: float) -> torch.Tensor:
    """Per value, what the graph is judged against: the nearest value within ``margin`` (the
    rounding both sides carry) of ``truth``; for integers, eager's value where the graph gives
    it, else the truth."""
    floating = eager.is_floating_point()
    graph, eager, truth = (t.detach().to(torch.float64) for t in (graph, eager, truth))
    if not floating:
        return torch.where(graph == eager, eager, truth)
    return torch.minimum(torch.maximum(graph, truth - margin), truth + margin)


def _widened(leaf: Any) -> Any:
    return leaf.to(torch.float64) if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() else leaf
