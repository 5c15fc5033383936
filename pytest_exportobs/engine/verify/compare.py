"""Run an exported model on recorded inputs and compare every output with the eager reference."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ...core.text import error_line
from ...core.vocabulary import Kind
from ...shapes.synthesis import IGNORE_INDEX
from .arbiter import Float64Model, arbitrate, last_place

EPS = 1e-12
HISTOGRAM_EDGES = (1e-6, 1e-4, 1e-2)  # |Δ| buckets: <1e-6, <1e-4, <1e-2, >=1e-2
CHUNK = 1 << 22  # values of an output compared at once (32 MB in float64)
DEFAULT_TOLERANCES = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-4, 1e-4),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (1e-2, 1e-2),
}
# An output's values carry the rounding of the largest terms that made them: a value that sums
# terms of 1e11 (weights holding uninitialized memory) and cancels to 1e3 is off by ~1e5 in any
# other summation order.  Differences below this fraction of ``rtol`` times the output's largest
# magnitude are rounding; for outputs of ordinary scale (float32 below 10) ``atol`` is larger.  So
# is one unit in the last place of that magnitude, which in bfloat16 is larger still (0.0156 for
# values of 2 to 4: DeepSeek-V3's rotated keys, where eager and ONNX round a product apart).
SCALE_FRACTION = 0.1


@dataclass(frozen=True)
class Tolerance:
    """``|Δ| <= max(atol, SCALE_FRACTION * rtol * max|ref|, ulp(max|ref|)) + rtol * |ref|`` per
    element, ``max|ref|`` over the element's output, ``ulp`` one unit in its dtype's last place
    (with ``rtol`` 0, ``|Δ| <= atol``); ``None`` takes the dtype's default (fp64 1e-7, fp32 1e-4,
    fp16/bf16 1e-2, integers and bool exact)."""

    atol: float | None = None
    rtol: float | None = None

    def for_dtype(self, dtype: torch.dtype) -> tuple[float, float]:
        atol, rtol = DEFAULT_TOLERANCES.get(dtype, (0.0, 0.0))
        return (atol if self.atol is None else self.atol, rtol if self.rtol is None else self.rtol)


@dataclass
class Discrepancy:
    """Comparison of the outputs of one call.

    ``kind`` is empty when within tolerance, ``mismatch`` for values beyond tolerance,
    ``outputs`` when the output count, shape or dtype differs, ``error`` when the run raised.
    ``worst`` names the output holding the largest difference beyond tolerance.  Differences at
    positions the attention mask zeroes (cache entries attention never reads, rows of padded
    queries) are counted in ``n_padded`` and ``padded_max_abs``, not as a mismatch.  ``float64``:
    eager's and the graph's largest differences from the model run in float64, when that run
    found the graph within tolerance and no further from it than eager (eager rounds: see
    :mod:`.arbiter`); the values beyond tolerance stay counted.
    """

    index: int
    ok: bool
    kind: Kind | None = None
    max_abs: float = 0.0
    max_rel: float = 0.0
    n_beyond: int = 0
    n_values: int = 0
    histogram: list[int] = field(default_factory=lambda: [0] * (len(HISTOGRAM_EDGES) + 1))
    detail: str = ""
    worst: str = ""
    n_padded: int = 0
    padded_max_abs: float = 0.0
    float64: list[float] | None = None
    _worst_delta: float = field(default=0.0, repr=False)

    def as_row(self) -> dict[str, Any]:
        """The seed's row: ``index``, ``SUCCESS``, ``abs``, ``rel``, ``n``."""
        return {"index": self.index, "SUCCESS": self.ok, "abs": self.max_abs, "rel": self.max_rel,
                "n": self.n_values}

    def to_json(self) -> dict[str, Any]:
        """JSON-native: infinite differences (no comparable output) become ``None``."""
        values = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in values.items()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Discrepancy:
        """What :meth:`to_json` wrote (``None`` differences are infinite again)."""
        values: dict[str, Any] = {k: (math.inf if v is None and k in _DIFFERENCES else v) for k, v in data.items()}
        values["kind"] = Kind(values["kind"]) if values.get("kind") else None
        return cls(**values)


_DIFFERENCES = ("max_abs", "max_rel", "padded_max_abs")  # the float fields of a Discrepancy


def compare(
    actual: Sequence[Any], expected: Sequence[torch.Tensor | None], tolerance: Tolerance, index: int = 0,
    names: Sequence[str] = (), padding: torch.Tensor | None = None, empty_rows: torch.Tensor | None = None,
    decoder_padding: torch.Tensor | None = None, unread: Collection[str] = (), dtypes: Sequence[torch.dtype] = (),
) -> Discrepancy:
    """Compare flattened outputs; both may hold ``None`` for non-tensor outputs (eager's ``loss``
    without labels), left out of the comparison.
    ``names`` names the outputs; ``padding`` is the call's attention mask (0: padded), the
    encoder's in an encoder-decoder, whose decoder-side outputs read ``decoder_padding``;
    ``empty_rows`` marks the batch elements a mask leaves attending to nothing; the outputs
    named in ``unread`` are read nowhere (a loss of padded positions); ``dtypes``: the dtype
    whose tolerance each output is judged with (by default its reference's: a float64 reference
    of a float16 output is judged as float16)."""
    references = [t for t in expected if isinstance(t, torch.Tensor)]
    actual = [torch.as_tensor(a) if not isinstance(a, torch.Tensor) else a for a in actual if a is not None]
    result = Discrepancy(index=index, ok=True)
    if len(actual) != len(references):
        return _outputs_differ(result, f"{len(actual)} outputs, expected {len(references)}")
    for position, (got, ref) in enumerate(zip(actual, references)):
        name = names[position] if position < len(names) else f"output {position}"
        if tuple(got.shape) != tuple(ref.shape):
            return _outputs_differ(result, f"{name} has shape {tuple(got.shape)}, expected {tuple(ref.shape)}")
        encoder_side = decoder_padding is None or "encoder" in name or "cross_attention" in name
        padded = (torch.ones(ref.shape, dtype=torch.bool) if name in unread
                  else _unread(ref, padding if encoder_side else decoder_padding, empty_rows))
        _accumulate(result, got, ref, tolerance, name, padded, dtypes[position] if dtypes else ref.dtype)
    result.ok = result.n_beyond == 0
    result.kind = None if result.ok else Kind.MISMATCH
    if result.n_beyond:
        result.detail = f"{result.n_beyond} of {result.n_values} values beyond tolerance, worst in {result.worst}"
    return result


def _unread(ref: torch.Tensor, padding: torch.Tensor | None, empty_rows: torch.Tensor | None) -> torch.Tensor | None:
    """:func:`_unread_positions`, and every value of the batch elements in ``empty_rows``."""
    unread = _unread_positions(ref, padding)
    if empty_rows is None or ref.dim() == 0 or ref.shape[0] != empty_rows.shape[0]:
        return unread
    rows = empty_rows.reshape(-1, *[1] * (ref.dim() - 1)).expand(ref.shape)
    return rows if unread is None else unread | rows


def _unread_positions(ref: torch.Tensor, padding: torch.Tensor | None) -> torch.Tensor | None:
    """Where an output holds values no consumer reads, given the call's mask ``padding``
    ``(batch, length)``: cache entries ``(batch, heads, length, head_dim)`` at padded positions
    (attention never reads them), and rows ``(batch, queries, ...)`` of padded queries, per-token
    scores ``(batch, length)`` included, and the rows of per-token values flattened over the batch
    ``(batch * length, features)`` (a mixture of experts' router logits); queries after a cache
    are the mask's last positions.  With left padding under causal attention such a query attends
    to nothing: its values are arbitrary in eager and ONNX alike.  ``None`` when the output has no
    such layout."""
    if padding is None or padding.dim() != 2 or ref.dim() < 2:
        return None
    padded = padding == 0
    if ref.dim() == 2 and ref.shape[0] == padded.numel() != padded.shape[0]:
        return padded.reshape(-1, 1).expand(ref.shape)
    if ref.shape[0] != padding.shape[0]:
        return None
    if ref.dim() == 4 and ref.shape[2] == padding.shape[1]:
        return padded[:, None, :, None].expand(ref.shape)
    queries = ref.shape[1]
    if queries <= padding.shape[1] and (ref.dim() > 2 or ref.shape == padding.shape):
        rows = padded[:, padding.shape[1] - queries:]
        return rows.reshape(*rows.shape, *[1] * (ref.dim() - 2)).expand(ref.shape)
    return None


def _outputs_differ(result: Discrepancy, detail: str) -> Discrepancy:
    result.ok, result.kind, result.detail = False, Kind.OUTPUTS, detail
    result.max_abs = result.max_rel = math.inf
    return result


def _accumulate(
    result: Discrepancy, got: torch.Tensor, ref: torch.Tensor, tolerance: Tolerance, name: str,
    padded: torch.Tensor | None, dtype: torch.dtype,
) -> None:
    """Add one output's differences to ``result``, :data:`CHUNK` values at a time (a large
    output, an attention map at a variation's sizes, is not copied whole in float64)."""
    if ref.numel() == 0:
        return
    atol, rtol = tolerance.for_dtype(dtype)
    scale = _largest_magnitude(ref.detach())
    rounding = max(SCALE_FRACTION * rtol * scale, last_place(scale, dtype)) if rtol else 0.0
    floor = max(atol, rounding)  # what every value may be off by, whatever its magnitude
    got, ref = got.detach().reshape(-1), ref.detach().reshape(-1)
    unread = padded.reshape(-1) if padded is not None else None
    for start in range(0, ref.numel(), CHUNK):
        part = slice(start, start + CHUNK)
        _accumulate_part(result, got[part], ref[part], rtol, floor, unread[part] if unread is not None else None,
                         f"{name} (atol={atol:g}, rtol={rtol:g})")


def _largest_magnitude(ref: torch.Tensor) -> float:
    """The largest finite magnitude among the reference's values (0 when none is)."""
    magnitude = (ref if ref.is_floating_point() else ref.to(torch.float64)).abs()  # a mask's booleans too
    largest = float(magnitude.max())
    return largest if math.isfinite(largest) else float(torch.nan_to_num(magnitude, nan=0.0, posinf=0.0).max())


def _accumulate_part(
    result: Discrepancy, got: torch.Tensor, ref: torch.Tensor, rtol: float, floor: float,
    padded: torch.Tensor | None, where: str,
) -> None:
    """Add the differences of one chunk of an output to ``result``; ``floor``: what any value may
    be off by, ``where``: the output and its tolerance, as a mismatch names them."""
    ref64 = ref.to(torch.float64)
    magnitude = ref64.abs()
    delta = (got.to(torch.float64) - ref64).abs_()
    if bool(torch.isnan(delta).any()):  # NaN in both: equal; NaN in one: infinitely off
        delta = torch.where(torch.isnan(delta) & ~torch.isnan(ref64), torch.full_like(delta, math.inf), delta)
        delta = torch.nan_to_num(delta, nan=0.0)
    largest = float(delta.max())
    # within the floor everywhere (most outputs): no value is beyond, nothing padded to set apart
    beyond = delta > magnitude.mul(rtol).add_(floor) if largest > floor else None
    if beyond is not None and padded is not None and bool((unread := beyond & padded).any()):
        result.n_padded += int(unread.sum())
        result.padded_max_abs = max(result.padded_max_abs, float(delta[unread].max()))
        beyond, delta = beyond & ~padded, torch.where(padded, torch.zeros_like(delta), delta)
        largest = float(delta.max())
    result.n_values += delta.numel()
    n_beyond = int(beyond.sum()) if beyond is not None else 0
    result.n_beyond += n_beyond
    result.max_abs = max(result.max_abs, largest)
    result.max_rel = max(result.max_rel, float((delta / magnitude.add_(EPS)).max()))
    if n_beyond and (worst := float(delta[beyond].max())) > result._worst_delta:
        result.worst, result._worst_delta = where, worst
    result.histogram = [total + count for total, count in zip(result.histogram, _histogram(delta, largest))]


def _histogram(delta: torch.Tensor, largest: float) -> list[int]:
    """How many of the differences ``delta`` (``largest`` the greatest) fall in each bucket of
    :data:`HISTOGRAM_EDGES`."""
    if largest <= HISTOGRAM_EDGES[0]:
        return [delta.numel()] + [0] * len(HISTOGRAM_EDGES)
    buckets = torch.bucketize(delta, torch.tensor(HISTOGRAM_EDGES, dtype=torch.float64))
    return torch.bincount(buckets.flatten(), minlength=len(HISTOGRAM_EDGES) + 1).tolist()


@dataclass(frozen=True)
class OutputLayout:
    """What the comparison knows of a graph: its outputs' names, the input leaf holding the
    attention mask (``None``: no mask), whose zeros mark positions never read, and the leaves of
    every mask (cross-attention ones included), an all-zero row of which leaves its batch element
    attending to nothing: an input no tokenizer makes, whose outputs are arbitrary."""

    names: tuple[str, ...] = ()
    mask_leaf: int | None = None
    mask_leaves: tuple[int, ...] = ()
    decoder_mask_leaf: int | None = None  # an encoder-decoder's decoder_attention_mask
    labels_leaf: int | None = None
    order: tuple[int, ...] = ()  # for each output of the graph, the model's output it is (empty: the same order)

    @classmethod
    def of(cls, outputs: Sequence[str], leaf_names: Sequence[str], order: Sequence[int] = ()) -> OutputLayout:
        """The layout of a graph taking these input leaves, whose outputs are the model's
        ``outputs`` (named in the model's order) in the graph's ``order``."""
        names = list(leaf_names)
        mask = next((names.index(n) for n in ("attention_mask", "decoder_attention_mask") if n in names), None)
        decoder = names.index("decoder_attention_mask") if "decoder_attention_mask" in names else None
        masks = tuple(i for i, n in enumerate(names) if n.endswith("attention_mask"))
        labels = names.index("labels") if "labels" in names else None
        graph_names = tuple(outputs[i] for i in order) if order else tuple(outputs)
        return cls(graph_names, mask, masks, decoder if decoder != mask else None, labels, tuple(order))

    def in_graph_order(self, expected: Sequence[Any]) -> list[Any]:
        """The model's tensor outputs ``expected`` (its flat outputs) in the graph's order."""
        tensors = [t for t in expected if isinstance(t, torch.Tensor)]
        return [tensors[i] for i in self.order] if len(self.order) == len(tensors) else tensors

    def padding(self, leaves: Sequence[Any]) -> torch.Tensor | None:
        return leaves[self.mask_leaf] if self.mask_leaf is not None else None

    def decoder_padding(self, leaves: Sequence[Any]) -> torch.Tensor | None:
        return leaves[self.decoder_mask_leaf] if self.decoder_mask_leaf is not None else None

    def unread_outputs(self, leaves: Sequence[Any]) -> tuple[str, ...]:
        """``("loss",)`` when the call's labels score positions its mask pads (a label other than
        the ignore index under a 0): the loss then reads outputs at positions no comparison reads
        (under causal attention a left-padded query attends to nothing, its values arbitrary)."""
        mask = self.padding(leaves)
        labels = leaves[self.labels_leaf] if self.labels_leaf is not None else None
        if not isinstance(labels, torch.Tensor) or not isinstance(mask, torch.Tensor) or labels.shape != mask.shape:
            return ()
        return ("loss",) if bool(((mask == 0) & (labels != IGNORE_INDEX)).any()) else ()

    def empty_rows(self, leaves: Sequence[Any]) -> torch.Tensor | None:
        """Per batch element, whether one of its masks masks every position."""
        masks = [leaves[i] for i in self.mask_leaves if isinstance(leaves[i], torch.Tensor) and leaves[i].dim() == 2]
        rows = [(mask == 0).all(dim=1) for mask in masks if mask.shape[0] == masks[0].shape[0]]
        empty = torch.stack(rows).any(dim=0) if rows else None
        return empty if empty is not None and bool(empty.any()) else None


def padded_note(found: Sequence[Discrepancy], call_ids: Sequence[int]) -> str:
    """What the comparisons ``found`` (of the calls numbered ``call_ids``) tolerated at padded
    positions; ``""`` when nothing."""
    padded = [d for d in found if d.n_padded]
    if not padded:
        return ""
    return (f"calls {[call_ids[d.index] for d in padded]}: {sum(d.n_padded for d in padded)} values beyond tolerance "
            f"only at padded positions (max |Δ| {max(d.padded_max_abs for d in padded):.3g}): cache entries attention "
            "never reads, rows of padded queries no consumer reads, batch elements a mask leaves attending to nothing "
            "(no tokenizer makes them): tolerated")


def verify_calls(
    run: Callable[[Sequence[Any]], Sequence[Any]],
    calls: Sequence[Sequence[Any]],
    references: Sequence[Sequence[torch.Tensor | None]],
    tolerance: Tolerance,
    outputs: OutputLayout | None = None,
    float64: Float64Model | None = None,
) -> list[Discrepancy]:
    """Run every call (its flat leaves) and compare with its reference."""
    return [
        run_and_compare(run, leaves, reference, tolerance, index, outputs, float64)
        for index, (leaves, reference) in enumerate(zip(calls, references, strict=True))
    ]


def run_and_compare(
    run: Callable[[Sequence[Any]], Sequence[Any]],
    leaves: Sequence[Any],
    reference: Sequence[torch.Tensor | None],
    tolerance: Tolerance,
    index: int = 0,
    outputs: OutputLayout | None = None,
    float64: Float64Model | None = None,
) -> Discrepancy:
    """Run the exported model on ``leaves`` and compare; a run that raises is an ``error``
    verdict on this call, not a crash.  A mismatch is judged against the ``float64`` model, when
    given (see :mod:`.arbiter`)."""
    try:
        actual = run(leaves)
    except Exception as e:
        return Discrepancy(index, False, Kind.ERROR, math.inf, math.inf, detail=error_line(e))
    layout = outputs or OutputLayout()
    expected = layout.in_graph_order(reference)

    def against(got: Sequence[Any], wanted: Sequence[Any], dtypes: Sequence[torch.dtype] = ()) -> Discrepancy:
        return compare(got, wanted, tolerance, index, layout.names, layout.padding(leaves), layout.empty_rows(leaves),
                       layout.decoder_padding(leaves), layout.unread_outputs(leaves), dtypes)

    result = against(actual, expected)
    if result.kind == Kind.MISMATCH and float64 is not None:
        found = arbitrate(float64, leaves, actual, expected, against, layout.in_graph_order)
        if found is not None and found.for_graph:
            result.ok, result.kind, result.float64 = True, None, [found.eager, found.graph]
            result.detail = ""
    return result


def float64_note(found: Sequence[Discrepancy], call_ids: Sequence[int]) -> str:
    """What the float64 model decided among the comparisons ``found`` (of the calls numbered
    ``call_ids``); ``""`` when it decided nothing."""
    decided = [d for d in found if d.float64]
    if not decided:
        return ""
    eager, graph = (max(d.float64[i] for d in decided if d.float64) for i in (0, 1))
    return (f"calls {[call_ids[d.index] for d in decided]}: {sum(d.n_beyond for d in decided)} values differ from "
            f"eager beyond tolerance (max |Δ| {max(d.max_abs for d in decided):.3g}) where eager rounds as much: the "
            f"model in float64 is {eager:.3g} from eager and {graph:.3g} from the graph, which rounds no worse (within "
            "tolerance of float64 widened by eager's distance from it): passed")
