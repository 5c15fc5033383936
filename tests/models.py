"""Small models shared by the tests, and the helpers several test modules need.

Plugin tests write this file into their pytester project (``pytester.makepyfile(models=SOURCE)``),
so it imports nothing but torch and stays self-contained.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

SOURCE = Path(__file__).read_text()
# a plugin session's quickest full check: to torch.export and back, no hypothesis variations
QUICK_CHECK = ("--export-check", "--export-target=torch", "--export-examples=0", "-p", "no:cacheprovider")
# a plugin project's conftest: the fixture ``mlp``, an MLP of seeded weights (the same in every test)
MLP_CONFTEST = '''
import pytest, torch
from models import MLP

@pytest.fixture
def mlp():
    torch.manual_seed(0)
    return MLP().eval()
'''
# what loading the plugin imports of it in a session without --export-check: small, torch-free modules
LOADED_WITHOUT_CHECK = [
    "pytest_exportobs", "pytest_exportobs.core", "pytest_exportobs.core.vocabulary",  # --export-target's words
    "pytest_exportobs.engine", "pytest_exportobs.engine.base", "pytest_exportobs.engine.base.settings",
    "pytest_exportobs.observe", "pytest_exportobs.observe.options",  # the marker's arguments
    "pytest_exportobs.plugin", "pytest_exportobs.plugin.observing", "pytest_exportobs.plugin.options",
]


class MLP(torch.nn.Module):
    """Exports to ONNX with a dynamic batch: ``(batch, 8) -> (batch, 4)``."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(8, 16)
        self.l2 = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x)))


class TiedHead(torch.nn.Module):
    """An embedding and an output layer sharing one weight, and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.full((16,), 0.5))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids) * self.scale)


class Branchy(torch.nn.Module):
    """A branch on the values of its input: fine in eager, torch.export cannot capture it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.linear(x)
        return -self.linear(x)


class FromConfig(torch.nn.Module):
    """Built as diffusers builds models (``from_config`` of a mapping kept as ``config``), with
    Branchy's data-dependent branch."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.config = {"width": width}
        self.linear = torch.nn.Linear(width, width)

    @classmethod
    def from_config(cls, config: dict) -> FromConfig:
        return cls(**config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) if x.sum() > 0 else -self.linear(x)


class ConvNet(torch.nn.Module):
    """Images of any size: ``(batch, 3, height, width) -> (batch, 5)``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.head = torch.nn.Linear(8, 5)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(images)).mean(dim=(2, 3)))


class Scorer(torch.nn.Module):
    """onnxruntime's results differ from eager by ~1e-7; ``encode`` is a second method to observe."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, hidden), torch.nn.GELU(), torch.nn.LayerNorm(hidden), torch.nn.Linear(hidden, 4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).softmax(-1)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class NeedsWidth(torch.nn.Module):
    """A constructor argument without default: ``NeedsWidth()`` cannot rebuild it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def tiny_llama_config(**overrides: Any) -> Any:
    """A 2-layer Llama configuration with hidden size 64 and 100 tokens (no download)."""
    import transformers

    values = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100,
    )
    return transformers.LlamaConfig(**{**values, **overrides})


def cache_argument() -> str:
    """The argument transformers' models take their cache by: ``cache`` from 5.24 on (the old
    ``past_key_values`` warns), ``past_key_values`` before; their outputs name it the same."""
    import inspect

    import transformers

    return "cache" if "cache" in inspect.signature(transformers.LlamaForCausalLM.forward).parameters else (
        "past_key_values")


def example_arguments(shapes: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` of the engine's export example for a ShapeModel."""
    from pytest_exportobs.core.trees import flattening_context
    from pytest_exportobs.shapes.synthesis import example_leaves

    with flattening_context():
        return shapes.aligned.split_arguments(example_leaves(shapes))


class Good(torch.nn.Module):
    """Exportable; the same parameters as :class:`Bad`."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class Bad(torch.nn.Module):
    """Not exportable (a branch on values); the same parameters as :class:`Good`."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) if x.sum() > 0 else x


class CheckedOnRequest(torch.nn.Module):
    """Not exportable when asked to check (a branch on values), exportable otherwise."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, checked: bool = False) -> torch.Tensor:
        if checked and x.sum() > 0:  # data-dependent: torch.export cannot trace it
            return self.proj(x).abs()
        return self.proj(x)


class HalvingUNet(torch.nn.Module):
    """Halves the sides, doubles them back and concatenates the skip: sides must be even."""

    def __init__(self) -> None:
        super().__init__()
        self.down = torch.nn.Conv2d(4, 8, 3, stride=2, padding=1)
        self.up = torch.nn.ConvTranspose2d(8, 4, 2, stride=2)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.up(torch.relu(self.down(latents))), latents], dim=1)


class PatchMixer(torch.nn.Module):
    """MobileViT's unfold: sides that are no multiple of the patch are interpolated to one first,
    a branch on the size that torch.export traces once (``(batch, 3, h, w) -> (batch, 4, h, w)``)."""

    patch = 2

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.mix = torch.nn.Linear(4 * self.patch * self.patch, 4 * self.patch * self.patch)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.conv(pixel_values)
        batch, channels, height, width = x.shape
        new_h, new_w = math.ceil(height / self.patch) * self.patch, math.ceil(width / self.patch) * self.patch
        if new_h != height or new_w != width:
            x = torch.nn.functional.interpolate(x, size=(new_h, new_w), mode="bilinear")
        p = self.patch
        patches = x.reshape(batch, channels, new_h // p, p, new_w // p, p).permute(0, 2, 4, 1, 3, 5)
        mixed = self.mix(patches.reshape(batch, new_h // p, new_w // p, channels * p * p))
        x = mixed.reshape(batch, new_h // p, new_w // p, channels, p, p).permute(0, 3, 1, 4, 2, 5)
        x = x.reshape(batch, channels, new_h, new_w)
        return torch.nn.functional.interpolate(x, size=(height, width), mode="bilinear")


class PaddedPatches(torch.nn.Module):
    """A patch embedding padding odd sides (Swin's): eager takes any size; torch.export asserts
    the sides even where its guards may wait as runtime asserts (as torch.onnx.export has them),
    and otherwise rejects named sides for ``width % 2``."""

    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.projection = torch.nn.Conv2d(3, channels, 2, stride=2)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if images.shape[-1] % 2:
            images = torch.nn.functional.pad(images, (0, 1))
        if images.shape[-2] % 2:
            images = torch.nn.functional.pad(images, (0, 0, 0, 1))
        return self.projection(images).flatten(2)


class FixedGrid(torch.nn.Module):
    """A stride-2 stem before position embeddings of a fixed 8x8 grid, features of another size
    resized to it (EfficientViT-M, TinyViT): eager takes any size, torch.export pins height and
    width solving its guards; only the batch can vary."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 4, 3, stride=2, padding=1)
        self.positions = torch.nn.Parameter(torch.randn(1, 4, 8, 8))
        self.head = torch.nn.Linear(4, 5)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features = self.stem(images)
        if features.shape[-2:] != self.positions.shape[-2:]:
            features = torch.nn.functional.interpolate(features, size=self.positions.shape[-2:])
        return self.head((features + self.positions).mean(dim=(2, 3)))


class AttentionMaps(torch.nn.Module):
    """Self-attention of 8 heads over tokens, returning its maps beside the tokens (as a model
    called with ``output_attentions=True``): the maps grow with the square of the tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.query_key = torch.nn.Linear(16, 32)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        query, key = self.query_key(tokens).unflatten(-1, (2, 8, 2)).unbind(2)
        maps = torch.einsum("bshd,bthd->bhst", query, key).softmax(-1)
        return tokens.relu(), maps


def junit_cases(path: Path) -> dict[str, str]:
    """``classname::name`` -> outcome of every testcase in a junit xml file, each reported once."""
    import xml.etree.ElementTree as ET

    cases: dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        children = {child.tag for child in case}
        outcome = next((tag for tag in ("failure", "error", "skipped") if tag in children), "passed")
        name = f"{case.get('classname')}::{case.get('name')}"
        assert name not in cases, f"{name} reported twice"
        cases[name] = outcome
    return cases
