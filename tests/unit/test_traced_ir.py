"""A traced program translated to ONNX as traced (without torch's second trace, its
decomposition) when nothing in it needs decomposing, and left to the decomposition otherwise:
the ONNX graph serves unseen batches as eager does, either way."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnxruntime
import pytest
import torch
import torch.nn.functional as F

from pytest_exportobs.compat.torch_private import (
    import_export_machinery,
    onnx_decompositions,
    onnx_registry,
    prepare_for_onnx,
    size_oblivious,
    taken_as_traced,
    to_onnx_program,
    translated_ops,
)
from pytest_exportobs.compat.traced_ir import as_translatable


class ResidualClassifier(torch.nn.Module):
    """What the rewrites take: a convolution, a batch norm (eval), in-place ReLU and residual
    sum, a global average pool, a scale computed under ``no_grad``, casts, a mask made with
    ``&``, and a negative log-likelihood loss over the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.norm = torch.nn.BatchNorm2d(8)
        self.act = torch.nn.ReLU(inplace=True)
        self.head = torch.nn.Linear(8, 5)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.act(self.norm(self.conv(images)))
        features += self.conv(images)
        pooled = F.adaptive_avg_pool2d(features, 1).flatten(1)
        with torch.no_grad():
            scale = pooled.abs().amax(dim=1, keepdim=True).to(torch.float64) + 1
        logits = self.head(pooled / scale.to(torch.float32))
        keep = (labels >= 0) & (labels < 5)
        return logits, F.nll_loss(F.log_softmax(logits, dim=-1), torch.where(keep, labels, -100))


def _trained_norm(model: ResidualClassifier) -> ResidualClassifier:
    """Running statistics that are not the identity's, then eval mode."""
    with torch.no_grad():
        model.norm.running_mean.uniform_(-0.5, 0.5)
        model.norm.running_var.uniform_(0.5, 2.0)
    return model.eval()


def _traced(model: torch.nn.Module, *example: torch.Tensor) -> torch.export.ExportedProgram:
    import_export_machinery()
    batch = torch.export.Dim("batch")
    return torch.export.export(model, example, dynamic_shapes=tuple({0: batch} for _ in example))


def _targets(program: torch.export.ExportedProgram) -> set[str]:
    return {str(node.target) for node in program.graph.nodes if node.op == "call_function"}


def _onnx_outputs(program: torch.export.ExportedProgram, *inputs: torch.Tensor) -> list[np.ndarray]:
    proto = to_onnx_program(prepare_for_onnx(program)).model_proto
    session = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {graph_input.name: value.numpy() for graph_input, value in zip(session.get_inputs(), inputs)}
    return session.run(None, feeds)


def test_a_program_of_translated_ops_is_rewritten_not_decomposed_and_serves_unseen_batches() -> None:
    torch.manual_seed(0)
    model = _trained_norm(ResidualClassifier())
    program = _traced(model, torch.randn(3, 3, 6, 6), torch.tensor([0, 4, 7]))
    as_traced_before = str(program.graph)

    taken = as_translatable(program, translated_ops())

    assert taken is not None
    assert str(program.graph) == as_traced_before  # the traced program is the check's too: left as it is
    targets = _targets(taken)
    assert not targets & {"aten.to.dtype", "aten.relu_.default", "aten.add_.Tensor", "aten.batch_norm.default",
                          "aten.adaptive_avg_pool2d.default", "aten.nll_loss_nd.default", "aten.__and__.Tensor",
                          "wrap_with_set_grad_enabled"}
    assert {"aten._to_copy.default", "aten.relu.default", "aten.add.Tensor", "aten.mean.dim",
            "aten._native_batch_norm_legit_no_training.default", "aten.nll_loss_forward.default",
            "aten.bitwise_and.Tensor"} <= targets
    images, labels = torch.randn(5, 3, 6, 6), torch.tensor([1, -1, 4, 9, 0])  # two labels ignored
    logits, loss = _onnx_outputs(program, images, labels)
    expected_logits, expected_loss = model(images, labels)
    np.testing.assert_allclose(logits, expected_logits.detach().numpy(), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(loss, expected_loss.detach().numpy(), atol=1e-5, rtol=1e-5)


class StandardizedConv(torch.nn.Module):
    """NFNet's weight standardization: a batch norm in training mode without running
    statistics, over the convolution's own weight."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 4, 3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = self.weight.reshape(1, 8, -1)
        weight = F.batch_norm(flat, None, None, training=True, momentum=0.0, eps=1e-5).reshape_as(self.weight)
        return F.conv2d(x, weight)


def test_a_batch_norm_without_running_statistics_is_taken_as_traced_and_serves_unseen_batches() -> None:
    torch.manual_seed(0)
    model = StandardizedConv().eval()
    program = _traced(model, torch.randn(2, 4, 9, 9))

    taken = as_translatable(program, translated_ops(), onnx_decompositions())

    assert taken is not None
    assert "aten.batch_norm.default" not in _targets(taken)
    assert "aten._native_batch_norm_legit.no_stats" in _targets(taken)  # what torch's decomposition makes of it
    images = torch.randn(5, 4, 9, 9)
    got, = _onnx_outputs(program, images)
    assert got.shape == (5, 8, 7, 7)
    np.testing.assert_allclose(got, model(images).detach().numpy(), atol=1e-5, rtol=1e-5)


class PairScorer(torch.nn.Module):
    """Ops the registry lacks, each decomposing to a few it has: ``broadcast_tensors`` (a
    list of outputs, one of them returned), ``diff`` along the dynamic length, and
    ``binary_cross_entropy_with_logits`` (the loss returned as computed)."""

    def forward(self, queries: torch.Tensor, keys: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
        rows, columns = torch.broadcast_tensors(queries, keys)
        steps = torch.diff(rows * columns, dim=1)
        return columns, steps, F.binary_cross_entropy_with_logits(rows + columns, targets)


def test_ops_the_registry_lacks_are_decomposed_alone_and_the_graph_serves_unseen_sizes() -> None:
    program = _traced_pairs(torch.randn(3, 1, 4), torch.randn(1, 5, 4), torch.rand(3, 5, 4))
    lacking = {"aten.broadcast_tensors.default", "aten.diff.default", "aten.binary_cross_entropy_with_logits.default"}
    assert lacking <= _targets(program)

    taken = as_translatable(program, translated_ops(), onnx_decompositions())

    assert taken is not None
    assert not _targets(taken) & lacking
    assert {"aten.expand.default", "aten.slice.Tensor", "aten.log1p.default"} <= _targets(taken)
    assert [spec.arg.name for spec in taken.graph_signature.output_specs] == \
        [spec.arg.name for spec in program.graph_signature.output_specs]
    for batch, length in ((2, 7), (6, 3)):
        inputs = torch.randn(batch, 1, 4), torch.randn(1, length, 4), torch.rand(batch, length, 4)
        got = _onnx_outputs(program, *inputs)
        expected = PairScorer()(*inputs)
        assert [g.shape for g in got] == [(batch, length, 4), (batch, length - 1, 4), ()]
        for value, reference in zip(got, expected):
            np.testing.assert_allclose(value, reference.numpy(), atol=1e-6, rtol=1e-6)


class PyramidPooled(torch.nn.Module):
    """BEiT's segmentation head: the features pooled to 1, 2, 3 and 6 a side, each upsampled
    back and concatenated (only the pool to 1 is a global mean)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, stride=2)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features = self.conv(images)
        pooled = [F.interpolate(F.adaptive_avg_pool2d(features, scale), size=features.shape[2:], mode="bilinear")
                  for scale in (1, 2, 3, 6)]
        return torch.cat([features, *pooled], dim=1)


def test_average_pools_to_other_sizes_than_1_are_decomposed_alone_and_the_graph_serves_unseen_batches() -> None:
    torch.manual_seed(0)
    model = PyramidPooled().eval()
    program = _traced(model, torch.randn(3, 3, 31, 31))  # 15x15 features: no pool divides them but the first
    assert "aten.adaptive_avg_pool2d.default" in _targets(program)

    taken = as_translatable(program, translated_ops(), onnx_decompositions())

    assert taken is not None and "aten.adaptive_avg_pool2d.default" not in _targets(taken)
    assert taken_as_traced(prepare_for_onnx(program))
    images = torch.randn(5, 3, 31, 31)
    (got,) = _onnx_outputs(program, images)
    assert got.shape == (5, 20, 15, 15)
    with torch.no_grad():
        np.testing.assert_allclose(got, model(images).numpy(), atol=1e-5, rtol=1e-5)


class SpanLoss(torch.nn.Module):
    """BERT's question-answering loss: ``ignore_index`` is the sequence length, a size of the
    trace that torchlib's translations of ``cross_entropy_loss`` and ``nll_loss_forward`` (torch
    2.13) cannot take."""

    def forward(self, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ignored = logits.size(1)
        return F.cross_entropy(logits, positions.clamp(0, ignored), ignore_index=ignored)


def test_ops_whose_translation_fails_are_decomposed_alone_on_request_and_the_graph_serves_unseen_sizes() -> None:
    import_export_machinery()
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq", min=2)
    program = torch.export.export(SpanLoss(), (torch.randn(3, 7), torch.tensor([1, 7, 3])),
                                  dynamic_shapes=({0: batch, 1: seq}, {0: batch}))
    table = torch.export.default_decompositions()
    failing = (torch.ops.aten.cross_entropy_loss.default, torch.ops.aten.nll_loss_forward.default)

    prepared = prepare_for_onnx(program, decomposed_alone={op: table[op] for op in failing})

    assert taken_as_traced(prepared)  # the rest as traced: no second trace of the model
    assert "aten.cross_entropy_loss.default" not in _targets(prepared)
    assert "aten._log_softmax.default" in _targets(prepared)
    proto = to_onnx_program(prepared).model_proto
    session = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    unseen = ((torch.randn(2, 9), torch.tensor([9, 4])), (torch.randn(5, 3), torch.tensor([0, 3, 2, 1, 3])))
    for logits, positions in unseen:  # each with a position ignored
        got, = session.run(None, {"logits": logits.numpy(), "positions": positions.numpy()})
        np.testing.assert_allclose(got, SpanLoss()(logits, positions).numpy(), atol=1e-6, rtol=1e-6)


class Float32Island(torch.nn.Module):
    """Attention scores computed with autocast disabled (EfficientViT's linear attention does
    so): a region that casts nothing outside an autocast."""

    def __init__(self) -> None:
        super().__init__()
        self.project = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keys = self.project(x)
        with torch.autocast("cpu", enabled=False):
            scores = torch.softmax(keys @ keys.transpose(-1, -2), dim=-1)
        return scores @ x


def test_a_disabled_autocast_region_is_inlined_and_the_graph_serves_unseen_batches() -> None:
    torch.manual_seed(0)
    model = Float32Island().eval()
    program = _traced(model, torch.randn(2, 3, 4))
    assert "wrap_with_autocast" in _targets(program)

    taken = as_translatable(program, translated_ops())

    assert taken is not None
    assert "wrap_with_autocast" not in _targets(taken)
    unseen = torch.randn(5, 3, 4)
    (got,) = _onnx_outputs(program, unseen)
    np.testing.assert_allclose(got, model(unseen).detach().numpy(), atol=1e-6, rtol=1e-6)


def test_a_program_whose_rewriting_fails_is_decomposed_as_torch_onnx_decomposes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pytest_exportobs.compat import torch_private

    def failing(*args: object) -> None:
        raise RuntimeError("a rewrite the program cannot hold")

    monkeypatch.setattr(torch_private, "as_translatable", failing)
    program = _traced_pairs(torch.randn(3, 1, 4), torch.randn(1, 5, 4), torch.rand(3, 5, 4))
    prepared = prepare_for_onnx(program)
    assert not taken_as_traced(prepared)
    assert not _targets(prepared) & {"aten.broadcast_tensors.default", "aten.diff.default"}
    inputs = torch.randn(4, 1, 4), torch.randn(1, 6, 4), torch.rand(4, 6, 4)
    for value, reference in zip(_onnx_outputs(program, *inputs), PairScorer()(*inputs)):
        np.testing.assert_allclose(value, reference.numpy(), atol=1e-6, rtol=1e-6)


def _traced_pairs(*example: torch.Tensor) -> torch.export.ExportedProgram:
    import_export_machinery()
    batch, length = torch.export.Dim("batch"), torch.export.Dim("length", min=3)
    return torch.export.export(PairScorer(), example, strict=False,
                               dynamic_shapes=({0: batch}, {1: length}, {0: batch, 1: length}))


class MaskedScores(torch.nn.Module):
    """Scores zeroed in place where a boolean mask says (transformers' mixture of experts), then
    halved in place."""

    def forward(self, scores: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        gathered = scores * 2
        gathered.masked_fill_(~keep.unsqueeze(-1), 0.0)
        gathered.div_(2)
        return gathered


def test_in_place_writes_with_a_boolean_mask_are_made_functional_and_the_graph_serves_unseen_batches() -> None:
    model = MaskedScores()
    program = _traced(model, torch.randn(3, 4), torch.tensor([True, False, True]))

    taken = as_translatable(program, translated_ops())

    assert taken is not None
    targets = _targets(taken)
    assert {"aten.masked_fill.Scalar", "aten.div.Tensor"} <= targets
    assert not targets & {"aten.masked_fill_.Scalar", "aten.div_.Tensor"}
    scores, keep = torch.randn(5, 4), torch.tensor([True, False, False, True, True])
    (got,) = _onnx_outputs(program, scores, keep)
    np.testing.assert_allclose(got, model(scores, keep).numpy(), atol=1e-6)


class PooledTokens(torch.nn.Module):
    """Swin's pooler: an adaptive average pool over the tokens, whose decomposition alone restrides
    the mean in place (``as_strided_`` with the batch's symbolic size among its sizes)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.pool = torch.nn.Linear(8, 8), torch.nn.AdaptiveAvgPool1d(1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.pool(self.proj(tokens).transpose(1, 2)).flatten(1)


def test_a_restriding_with_a_symbolic_size_is_made_functional_and_the_graph_serves_unseen_sizes() -> None:
    torch.manual_seed(0)
    model = PooledTokens().eval()
    import_export_machinery()
    dims = torch.export.Dim("batch"), torch.export.Dim("tokens")
    with size_oblivious():
        program = torch.export.export(model, (torch.randn(3, 5, 8),), dynamic_shapes=({0: dims[0], 1: dims[1]},))

    taken = as_translatable(program, translated_ops(), onnx_decompositions())

    assert taken is not None and "aten.as_strided_.default" not in _targets(taken)
    tokens = torch.randn(4, 9, 8)
    (got,) = _onnx_outputs(program, tokens)
    with torch.no_grad():
        np.testing.assert_allclose(got, model(tokens).numpy(), atol=1e-6)


class SliceWritten(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        y[:, 0] = 0  # an in-place write into a view of y
        return y + 1


class InputWritten(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.add_(1)  # the caller's tensor changes
        return x * 2


class ReadAfterWrite(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        view = y.view(-1)
        y.relu_()  # the view sees it
        return view + 1


class CastBack(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (x * 2).half()
        y.add_(x)  # computed in float32, written back in float16
        return y.float()


class TrainingNorm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


class Autocast(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = x @ x.transpose(0, 1)
        return y.float()


class GradFreeOutput(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        with torch.no_grad():
            z = y + 1  # the region's output is the program's, named by its signature
        return z


class PooledToTwo(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.adaptive_avg_pool2d(x, 2)


Case = tuple[Callable[[], torch.nn.Module], Callable[[int], torch.Tensor]]
ROWS, IMAGES = (lambda batch: torch.randn(batch, 4)), (lambda batch: torch.randn(batch, 3, 6, 6))
DECOMPOSED: dict[str, Case] = {
    "in-place write into a view": (SliceWritten, ROWS),
    "in-place write into an input": (InputWritten, ROWS),
    "in-place write a view reads after": (ReadAfterWrite, ROWS),
    "average pool to 2x2": (PooledToTwo, IMAGES),
    "grad-mode region returned": (GradFreeOutput, ROWS),
    "in-place write cast back": (CastBack, ROWS),
}
UNTAKEN: dict[str, Case] = {  # what onnxruntime does with them is not the point: bf16 kernels, batch statistics
    **DECOMPOSED, "batch norm in training": (lambda: TrainingNorm().train(), ROWS), "autocast region": (Autocast, ROWS),
}


@pytest.mark.parametrize("case", UNTAKEN)
def test_a_program_a_rewrite_cannot_take_is_not_taken_as_traced(case: str) -> None:
    make, example = UNTAKEN[case]
    assert as_translatable(_traced(make(), example(3)), translated_ops()) is None


@pytest.mark.parametrize("case", DECOMPOSED)
def test_a_program_left_to_the_decomposition_serves_unseen_batches(case: str) -> None:
    torch.manual_seed(0)
    make, example = DECOMPOSED[case]
    unseen = example(5)
    expected = make()(unseen.clone())
    (got,) = _onnx_outputs(_traced(make(), example(3)), unseen)
    np.testing.assert_allclose(got, expected.numpy(), atol=1e-5, rtol=1e-5)


def test_t5s_attention_has_its_types_promoted_from_the_values_torch_export_recorded() -> None:
    """T5's attention output is reshaped through a view torch.export recorded on its trace's
    strides; torch.onnx's promotion pass, which runs every node again on fake tensors, fails
    there.  The promotions made from the recorded values do not, and the ONNX graph serves
    unseen batches and lengths."""
    import transformers
    from torch.onnx._internal.exporter import _core

    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=99, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4)
    model = transformers.T5EncoderModel(config).eval()
    batch, length = torch.export.Dim("batch"), torch.export.Dim("length", max=64)
    import_export_machinery()
    with size_oblivious():
        program = torch.export.export(model, (torch.randint(0, 99, (2, 7)),), strict=False,
                                      dynamic_shapes=({0: batch, 1: length},))
    with pytest.raises(ValueError, match="Cannot view a tensor"):  # torch.onnx's own preparation
        _core._prepare_exported_program_for_export(program, registry=onnx_registry())
    ids = torch.randint(0, 99, (3, 11))
    (got,) = _onnx_outputs(program, ids)
    np.testing.assert_allclose(got, model(ids).last_hidden_state.detach().numpy(), atol=1e-5, rtol=1e-5)
