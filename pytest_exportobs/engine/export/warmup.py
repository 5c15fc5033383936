"""A tiny model checked through the export pipeline once in the parent, before forked checks: what
torch.export, torch.onnx's translation, onnxscript's optimizer and onnxruntime build on their first
call (lazy tables, imports inside functions, first-run caches) is then inherited by every forked
child instead of built again in each (about 0.5 s a child on timm's models)."""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import torch

from ...core.vocabulary import Target
from ...observe.recorder import CallRecorder
from ...shapes.inference import DimPolicy
from ...shapes.model import ShapeModel
from .pipeline import export_model


class _Tiny(torch.nn.Module):
    """A convolution, a normalization, attention and a linear layer over image patches: the ops
    most models begin with."""

    def __init__(self) -> None:
        super().__init__()
        self.patches = torch.nn.Conv2d(3, 8, 2, stride=2)
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        tokens = self.norm(self.patches(images).flatten(2).transpose(1, 2))
        attended = torch.nn.functional.scaled_dot_product_attention(tokens, tokens, tokens)
        return self.head(torch.nn.functional.gelu(attended)).mean(dim=1)


def warm_up() -> bool:
    """Export the tiny model to ONNX with dynamic sizes and run the file once (nothing is written
    outside a temporary directory, nothing is reported); whether it went through.  A failure is
    ignored: each check then pays the first calls itself."""
    import onnxruntime

    model = _Tiny().eval()
    recorder = CallRecorder()
    with torch.no_grad(), recorder(model):
        for batch in (2, 3):
            model(torch.randn(batch, 3, 8, 8))
    try:
        with tempfile.TemporaryDirectory(prefix="exportobs-warm-") as directory, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            path = Path(directory) / "model.onnx"
            shapes = ShapeModel.from_aligned(recorder.aligned(), policy=DimPolicy(roles=True))
            if not export_model(model, shapes, Target.ONNX, path).ok:
                return False
            session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            session.run(None, {session.get_inputs()[0].name: torch.randn(2, 3, 8, 8).numpy()})
    except Exception:  # a warm-up only: whatever fails here fails in the check, with its own message
        return False
    return True
