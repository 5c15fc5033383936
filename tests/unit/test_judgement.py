"""A verdict that holds beyond one library's habits: arguments only Python uses bound as passed,
the other capture tried, eager judged against float64, half precision computed as its kernels
compute (no pytest session)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import onnxruntime
import pytest
import torch
import torch.nn.functional as F

from pytest_exportobs.engine.base.settings import CheckSettings
from pytest_exportobs.engine.check import check_model
from pytest_exportobs.engine.verify.arbiter import Float64Copy, Float64Model, arbitrate
from pytest_exportobs.engine.verify.compare import Tolerance, compare
from pytest_exportobs.observe.store import ModelGroup, ObserveOptions, SessionStore


def observed(module: torch.nn.Module, *calls: tuple[tuple, dict]) -> ModelGroup:
    store = SessionStore()
    with store.observe(module, "model", ObserveOptions(), "test_judgement.py::test") as group, torch.no_grad():
        for args, kwargs in calls:
            module(*args, **kwargs)
    return group


def settings(tmp_path: Path, examples: int = 4) -> CheckSettings:
    return CheckSettings(export_dir=tmp_path, examples=examples, hypothesis_seed=0, use_cache=False)


def onnx_run(path: str, *inputs: torch.Tensor) -> list[torch.Tensor]:
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    return [torch.from_numpy(o) for o in session.run(None, {n: t.numpy() for n, t in zip(names, inputs)})]


# -- an argument only Python uses ----------------------------------------------------------------


class TinyVAE(torch.nn.Module):
    """diffusers' AutoencoderKL in miniature: ``generator`` is used only to sample the posterior."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encode = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.decode = torch.nn.ConvTranspose2d(4, 3, 4, stride=2, padding=1)

    def forward(self, sample: torch.Tensor, sample_posterior: bool = False,
                generator: torch.Generator | None = None) -> torch.Tensor:
        mean, logvar = self.encode(sample).chunk(2, dim=1)
        if sample_posterior:
            mean = mean + torch.exp(0.5 * logvar) * torch.randn(mean.shape, generator=generator)
        return self.decode(mean)


def test_a_generator_the_forward_does_not_use_is_bound_as_passed_and_the_graph_serves_other_images(
        tmp_path: Path) -> None:
    model = TinyVAE().eval()
    group = observed(model, ((torch.randn(4, 3, 32, 32),), {"generator": torch.manual_seed(0)}),
                     ((torch.randn(2, 3, 32, 32),), {"generator": torch.Generator().manual_seed(1)}))
    result = check_model(group, settings(tmp_path))
    assert result.verdict == "passed", result.reason
    assert [(g.calls, g.dims) for g in result.graphs] == [
        ([0, 1], {"sample": {"0": "batch", "2": "height", "3": "width"}})]
    assert "generator (<torch._C.Generator>) bound as the tests passed it: an object only Python uses is no graph " \
           "input" in result.notes
    sample = torch.randn(3, 3, 48, 40)
    with torch.no_grad():
        torch.testing.assert_close(onnx_run(result.onnx_path, sample)[0], model(sample), rtol=1e-4, atol=1e-5)


def test_sampling_with_the_generator_passed_is_not_a_pass(tmp_path: Path) -> None:
    model = TinyVAE().eval()
    group = observed(model, ((torch.randn(4, 3, 32, 32),), {"sample_posterior": True,
                                                             "generator": torch.Generator().manual_seed(0)}))
    result = check_model(group, settings(tmp_path))
    assert result.verdict == "failed" and result.kind in ("error", "nondeterministic"), result.reason
    assert "randn" in result.reason or "generator" in result.reason, result.reason


# -- one capture is not the only way -------------------------------------------------------------


class MaskedCrossAttention(torch.nn.Module):
    """diffusers' cross-attention mask: padded to the keys, repeated per head when it has fewer
    rows than batch * heads, viewed (batch, heads, -1, keys).  The size-oblivious capture cannot
    prove the rows' ratio is 1; torch.export's default capture can."""

    heads = 2

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v = (torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                encoder_attention_mask: torch.Tensor) -> torch.Tensor:
        batch, keys = encoder_hidden_states.shape[:2]
        mask = ((1 - encoder_attention_mask.to(hidden_states.dtype)) * -10000.0).unsqueeze(1)
        if mask.shape[-1] != keys:
            mask = F.pad(mask, (0, keys), value=0.0)
        if mask.shape[0] < batch * self.heads:
            mask = mask.repeat_interleave(self.heads, dim=0, output_size=mask.shape[0] * self.heads)
        mask = mask.view(batch, self.heads, -1, mask.shape[-1])
        q = self.q(hidden_states).view(batch, -1, self.heads, 4).transpose(1, 2)
        k = self.k(encoder_hidden_states).view(batch, -1, self.heads, 4).transpose(1, 2)
        v = self.v(encoder_hidden_states).view(batch, -1, self.heads, 4).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(batch, -1, 8)


def test_what_the_size_oblivious_capture_cannot_prove_the_default_capture_exports(tmp_path: Path) -> None:
    model = MaskedCrossAttention().eval()
    mask = torch.ones(4, 5)
    mask[1, -2:] = 0
    group = observed(model, ((torch.randn(4, 6, 8), torch.randn(4, 5, 8), mask), {}),
                     ((torch.randn(2, 3, 8), torch.randn(2, 7, 8), torch.ones(2, 7)), {}))
    result = check_model(group, settings(tmp_path))
    assert result.verdict == "passed", result.reason
    assert any(n.startswith("captured by torch.export() without size-oblivious sizes: torch.export(), as torch.onnx."
                            "export captures first, failed (RuntimeError: The size of tensor a") for n in result.notes)
    assert result.dims == {"hidden_states": {"0": "batch", "1": "seq"},
                           "encoder_hidden_states": {"0": "batch", "1": "encoder_seq"},
                           "encoder_attention_mask": {"0": "batch", "1": "encoder_seq"}}
    inputs = torch.randn(1, 1, 8), torch.randn(1, 9, 8), torch.tensor([[1.0] * 6 + [0.0] * 3])
    with torch.no_grad():
        torch.testing.assert_close(onnx_run(result.onnx_path, *inputs)[0], model(*inputs), rtol=1e-4, atol=1e-5)


class CountsTokens(MaskedCrossAttention):
    """The same attention, then a branch on a value: no capture takes it."""

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                encoder_attention_mask: torch.Tensor) -> torch.Tensor:
        out = super().forward(hidden_states, encoder_hidden_states, encoder_attention_mask)
        return out * 2 if encoder_attention_mask.sum() > 3 else out


def test_a_repro_captures_as_the_check_did_and_reproduces_its_error(tmp_path: Path) -> None:
    group = observed(CountsTokens().eval(), ((torch.randn(4, 6, 8), torch.randn(4, 5, 8), torch.ones(4, 5)), {}))
    result = check_model(group, settings(tmp_path, examples=0))
    assert (result.verdict, result.stage) == ("failed", "torch.export"), result.reason
    assert result.reason.startswith("RuntimeError: The size of tensor a"), result.reason
    script = Path(result.repro_path)
    assert "SIZE_OBLIVIOUS, STRICT = True, False  # how the check captured the model" in script.read_text()
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env={"PYTHONPATH": str(Path(__file__).parents[1])} | _environment())
    assert run.returncode == 1 and "The size of tensor a" in run.stderr, run.stderr[-2000:]


def _environment() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


# -- eager is the reference, not the truth -------------------------------------------------------


class Tripled(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 3


class Noisy(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.rand_like(x)


def _judge(module: torch.nn.Module, x: torch.Tensor, eager: torch.Tensor, graph: torch.Tensor) -> object:
    float64 = Float64Model(Float64Copy(module), "forward", lambda leaves: ((leaves[0],), {}))

    def against(actual: list, expected: list, dtypes: list) -> object:
        return compare(actual, expected, Tolerance(), dtypes=dtypes)

    return arbitrate(float64, [x], [graph], [eager], against, lambda outputs: [t for t in outputs if t is not None])


def test_the_float64_model_decides_for_the_graph_only_where_eager_rounds_as_much_or_more() -> None:
    x = torch.full((4,), 1.0)
    truth = torch.full((4,), 3.0)
    eager = truth + 2e-3  # eager's float32 rounding far off (an argmin flipped by a near tie)
    found = _judge(Tripled(), x, eager, truth + 1e-6)
    assert (found.for_graph, round(found.eager, 6), round(found.graph, 6)) == (True, 2e-3, 1e-6)
    assert not _judge(Tripled(), x, eager, truth + 5e-3).for_graph  # the graph is the further side
    assert not _judge(Tripled(), x, truth + 1e-6, truth + 5e-3).for_graph  # eager is right


def test_a_half_precision_model_whose_sides_round_alike_passes_and_one_rounding_worse_does_not() -> None:
    x = torch.linspace(-1, 1, 64, dtype=torch.float16)
    truth = (x.double() * 3).to(torch.float16)
    unit = 2 * torch.finfo(torch.float16).eps  # one unit in the last place at magnitude 3
    signs = torch.where(torch.arange(64) % 2 == 0, 1.0, -1.0)
    eager = (truth.double() + 3 * unit * signs).to(torch.float16)
    graph = (truth.double() - 5 * unit * signs.roll(1)).to(torch.float16)  # off elsewhere, a little more
    assert _judge(Tripled().half(), x, eager, graph).for_graph
    assert not _judge(Tripled().half(), x, eager, (truth.double() + 40 * unit).to(torch.float16)).for_graph


def test_random_draws_decide_nothing() -> None:
    x = torch.zeros(8)
    assert _judge(Noisy(), x, torch.full((8,), 0.5), torch.full((8,), 0.51)) is None


class ConvBlock(torch.nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv, self.norm = torch.nn.Conv2d(channels, channels, 3, padding=1), torch.nn.GroupNorm(4, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.norm(self.conv(x)))


class DeepDecoder(torch.nn.Module):
    """Eight conv / group norm / SiLU blocks: in bfloat16 each side rounds at every op, the graph at
    more of them (its group norm and SiLU are several ops)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.Conv2d(16, 3, 3, padding=1)
        self.blocks = torch.nn.Sequential(*[ConvBlock(16) for _ in range(8)])

    def forward(self, sample: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.inp(sample)))


def test_a_bfloat16_decoder_computed_as_its_kernels_compute_passes_where_eager_rounds_as_much(tmp_path: Path) -> None:
    model = DeepDecoder().to(torch.bfloat16).eval()
    sample = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    result = check_model(observed(model, ((sample,), {})), settings(tmp_path, examples=0))
    assert (result.verdict, result.runtimes) == ("passed", ["onnxruntime-float32"]), result.reason
    (note,) = [n for n in result.notes if n.startswith("calls [0]: ")]
    assert "where eager rounds as much: the model in float64 is " in note and note.endswith(": passed"), note


class ScalarLoss(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.proj(x)
        return F.mse_loss(logits, labels), logits


def test_a_bfloat16_scalar_loss_keeps_its_shape(tmp_path: Path) -> None:
    model = ScalarLoss().to(torch.bfloat16).eval()
    x, labels = torch.randn(3, 8, dtype=torch.bfloat16), torch.randn(3, 4, dtype=torch.bfloat16)
    result = check_model(observed(model, ((x, labels), {})), settings(tmp_path, examples=0))
    assert (result.verdict, result.runtimes) == ("passed", ["onnxruntime-float32"]), result.reason


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_widened_graphs_give_their_outputs_shapes_and_declared_types(tmp_path: Path, dtype: torch.dtype) -> None:
    import onnx

    from pytest_exportobs.engine.verify.runtimes import WidenedRunner

    model = ScalarLoss().to(dtype).eval()
    x, labels = torch.randn(3, 8, dtype=dtype), torch.randn(3, 4, dtype=dtype)
    path = tmp_path / "model.onnx"
    torch.onnx.export(model, (x, labels), dynamo=True).save(str(path))
    declared = [o.type.tensor_type.elem_type for o in onnx.load(str(path)).graph.output]
    loss, logits = WidenedRunner(path)([x, labels])
    with torch.no_grad():
        expected_loss, expected_logits = model(x, labels)
    assert declared[1] == {torch.float16: onnx.TensorProto.FLOAT16, torch.bfloat16: onnx.TensorProto.BFLOAT16}[dtype]
    assert (loss.shape, logits.shape, logits.dtype) == ((), (3, 4), dtype)
    torch.testing.assert_close(logits, expected_logits, rtol=0.02, atol=0.02)
    torch.testing.assert_close(loss.to(dtype), expected_loss, rtol=0.02, atol=0.02)


# -- a bound judged from both sides --------------------------------------------------------------


class LongInputPath(torch.nn.Module):
    """Another computation up to 4 tokens: torch bounds seq >= 5 when the tests use 8 and 12."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.long, self.short = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] > 4:
            return self.long(x)
        return self.short(x)


class LayoutOnly(torch.nn.Module):
    """A branch on the length that computes the same: the graph serves lengths below the bound."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] > 4:  # layout only
            x = x.contiguous()
        return self.proj(x)


def _line(text: str) -> str:
    lines = Path(__file__).read_text().splitlines()
    number = next(i for i, line in enumerate(lines, 1) if text in line)
    return f"tests/unit/test_judgement.py:{number}: {lines[number - 1].strip()}"


def test_a_lower_bound_below_sizes_eager_runs_fails_naming_the_line(tmp_path: Path) -> None:
    group = observed(LongInputPath().eval(), ((torch.randn(2, 8, 8),), {}), ((torch.randn(3, 12, 8),), {}))
    result = check_model(group, settings(tmp_path))
    assert (result.verdict, result.stage, result.kind) == ("failed", "torch.export", "specialized"), result.reason
    assert result.reason == ("seq (x.1, the tests vary it) bounded to at least 5 (eager runs seq=4, the graph without "
                             "torch's assert computes another branch there) by torch.export at "
                             f"{_line('if x.shape[1] > 4:')}")


def test_a_lower_bound_the_graph_serves_below_is_a_note_and_the_onnx_serves_short_inputs(tmp_path: Path) -> None:
    model = LayoutOnly().eval()
    result = check_model(observed(model, ((torch.randn(2, 8, 8),), {}), ((torch.randn(3, 12, 8),), {})),
                         settings(tmp_path))
    assert result.verdict == "passed", result.reason
    assert (f"torch.export bounds seq to at least 5 where the model takes another branch (at {_line('# layout only')}"
            "); the graph, without torch's assert, serves seq=4 as eager does") in result.notes
    for length in (1, 3, 4):
        x = torch.randn(2, length, 8)
        with torch.no_grad():
            torch.testing.assert_close(onnx_run(result.onnx_path, x)[0], model(x), rtol=1e-4, atol=1e-5)


# -- a size that is a choice, not a length -------------------------------------------------------


class SectionRope(torch.nn.Module):
    """Multimodal rotary positions: ``position_ids`` (3, batch, seq) of temporal, height and width
    sections, or (4, batch, seq) with the text positions first."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.proj = torch.nn.Embedding(50, 12), torch.nn.Linear(12, 12)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        if position_ids.shape[0] == 4:
            text, position_ids = position_ids[0], position_ids[1:]
        else:
            text = position_ids[0]
        angles = torch.cat([position_ids[i, ..., None].float() * (i + 1) for i in range(3)], dim=-1).repeat(1, 1, 4)
        angles = angles + text[..., None].float() * 0.01
        hidden = self.embed(input_ids)
        return self.proj(hidden * angles.cos() + hidden.roll(1, -1) * angles.sin())


def _sections(count: int, batch: int, length: int) -> torch.Tensor:
    return torch.stack([torch.arange(length) * (j + 1) for j in range(count)])[:, None].expand(count, batch, length)


@pytest.mark.parametrize("first", [3, 4])  # traced with 3: torch asserts Ne(sections, 4); with 4: it pins 4
def test_a_few_section_counts_torch_restricts_are_a_graph_each(tmp_path: Path, first: int) -> None:
    model = SectionRope().eval()
    calls = [((torch.randint(0, 50, (2, 7)), _sections(3, 2, 7)), {}), ((torch.randint(0, 50, (3, 9)),
                                                                        _sections(4, 3, 9)), {}),
             ((torch.randint(0, 50, (2, 5)), _sections(3, 2, 5)), {})]
    if first == 4:
        calls = [calls[1], calls[0], calls[2]]
    result = check_model(observed(model, *calls), settings(tmp_path))
    assert result.verdict == "passed", result.reason
    dims = {"input_ids": {"0": "batch", "1": "seq"}, "position_ids": {"1": "batch", "2": "seq"}}
    assert [(g.name, sorted(g.calls), g.dims) for g in result.graphs] == [
        ("position_ids_dim0=3", [0, 2] if first == 3 else [1, 2], dims),
        ("position_ids_dim0=4", [1] if first == 3 else [0], dims)]
    why = "Ne(position_ids_dim0, 4)" if first == 3 else "torch.export pins it (position_ids_dim0"
    assert all(n.startswith("position_ids_dim0 is a choice of structure: the calls pass 3, 4 and ") and why in n
               for g in result.graphs for n in g.notes if "choice" in n)
    for graph, sections in zip(result.graphs, (3, 4)):
        ids, positions = torch.randint(0, 50, (5, 11)), _sections(sections, 5, 11)
        with torch.no_grad():
            torch.testing.assert_close(onnx_run(graph.onnx_path, ids, positions)[0], model(ids, positions),
                                       rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("noise, counted", [
    ([1e-9, 2e-9, 0.0, 0.0, 1e-9], (True, 0, [5, 0, 0, 0], 1e-9)),  # within the floor: the short way
    ([1e-9, 5e-7, 5e-3, 0.0, 1e-5], (True, 0, [3, 1, 1, 0], 5e-3)),  # 5e-3 within rtol of 100
    ([1e-9, 5e-7, 5e-3, 0.0, 0.5], (False, 1, [3, 0, 1, 1], 0.5)),
])
def test_a_comparison_counts_each_difference_in_its_bucket_and_those_beyond_tolerance(
    noise: list[float], counted: tuple[bool, int, list[int], float],
) -> None:
    reference = torch.tensor([0.0, 1.0, 100.0, -50.0, 3.0])
    found = compare([reference + torch.tensor(noise)], [reference], Tolerance())
    ok, beyond, histogram, largest = counted
    assert (found.ok, found.n_beyond, found.histogram, found.n_values) == (ok, beyond, histogram, 5)
    assert found.max_abs == pytest.approx(largest, rel=1e-3)


def test_an_output_compared_in_chunks_counts_as_compared_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks (a large attention map's) add up to the comparison of the whole output: values
    beyond tolerance read and padded, maxima, histogram, the worst output named."""
    from pytest_exportobs.engine.verify import compare as comparing

    torch.manual_seed(0)
    reference = torch.randn(2, 5, 3)
    got = reference + torch.randn(2, 5, 3) * 1e-5
    got[0, 0, 0] += 0.5  # beyond tolerance, read
    got[1, 4] += 1.0  # beyond tolerance, at the padded position
    padding = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    whole = compare([got], [reference], Tolerance(), names=["logits"], padding=padding).to_json()
    monkeypatch.setattr(comparing, "CHUNK", 4)
    assert compare([got], [reference], Tolerance(), names=["logits"], padding=padding).to_json() == whole
    assert (whole["n_beyond"], whole["n_padded"], whole["n_values"], sum(whole["histogram"])) == (1, 3, 30, 30)
    assert whole["detail"].startswith("1 of 30 values beyond tolerance, worst in logits")


def test_boolean_and_integer_outputs_are_compared_as_values() -> None:
    mask, counts = torch.tensor([[True, False], [False, True]]), torch.tensor([3, -1, 0])
    assert compare([mask, counts], [mask, counts], Tolerance()).ok
    found = compare([~mask, counts], [mask, counts], Tolerance(), names=["mask", "counts"])
    assert (found.ok, found.n_beyond, found.max_abs) == (False, 4, 1.0)
