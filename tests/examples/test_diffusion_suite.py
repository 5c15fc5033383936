"""A suite written as diffusers writes its model tests, observed whole: diffusion layouts.

A VAE whose tests pass a ``generator`` its forward does not use, a 1-D UNet over ``(batch,
channels, length)`` signals that halves its length twice, a latent transformer whose ``img_ids`` and
``txt_ids`` number the tokens of its two streams, a patched denoiser cropping its position table
to the latent's sides, cross-attention with a mask diffusers-style.  Expected outcomes, decided
without the plugin: every model exports and serves its calls, dynamic in every side and length a
pipeline varies (held-out sizes served as eager serves them); ordinary tests keep their outcomes.
"""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import onnxruntime
import pytest
import torch

from models import junit_cases

pytestmark = pytest.mark.slow  # the example suite's sessions

MODELS = '''
import torch
import torch.nn.functional as F
from torch import nn


class TinyVAE(nn.Module):
    """Encodes to a diagonal Gaussian, decodes its mean (or a sample drawn with ``generator``)."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.GroupNorm(2, 8), nn.SiLU(),
                                     nn.Conv2d(8, 8, 3, padding=1))
        self.decoder = nn.Sequential(nn.ConvTranspose2d(4, 8, 4, stride=2, padding=1), nn.SiLU(),
                                     nn.Conv2d(8, 3, 3, padding=1))

    def forward(self, sample, sample_posterior=False, generator=None):
        mean, logvar = self.encoder(sample).chunk(2, dim=1)
        if sample_posterior:
            mean = mean + torch.exp(0.5 * logvar) * torch.randn(mean.shape, generator=generator)
        return self.decoder(mean)


class UNet1D(nn.Module):
    """Denoises (batch, 6 channels, length) signals: two halvings and two doublings, skips between."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Conv1d(6, 8, 3, padding=1)
        self.down = nn.ModuleList([nn.Conv1d(8, 8, 3, stride=2, padding=1) for _ in range(2)])
        self.up = nn.ModuleList([nn.ConvTranspose1d(8, 8, 4, stride=2, padding=1) for _ in range(2)])
        self.time = nn.Linear(1, 8)
        self.out = nn.Conv1d(8, 6, 3, padding=1)

    def forward(self, sample, timestep):
        h = self.inp(sample) + self.time(timestep[:, None].float())[..., None]
        skips = []
        for down in self.down:
            skips.append(h)
            h = F.silu(down(h))
        for up in self.up:
            h = F.silu(up(h)) + skips.pop()
        return self.out(h)


def rope(ids, dim):
    """Rotary angles from 3-axis token ids (frame, row, column), Flux-style."""
    freqs = 1.0 / (100 ** (torch.arange(0, dim // 3, dtype=torch.float32) / (dim // 3)))
    return torch.cat([ids[:, i, None] * freqs for i in range(3)], dim=-1)


class LatentTransformer(nn.Module):
    """Joint attention over image tokens (numbered by img_ids) and text tokens (numbered by txt_ids)."""

    def __init__(self):
        super().__init__()
        self.img_in, self.txt_in = nn.Linear(4, 24), nn.Linear(16, 24)
        self.qkv, self.proj, self.out = nn.Linear(24, 72), nn.Linear(24, 24), nn.Linear(24, 4)

    def forward(self, hidden_states, encoder_hidden_states, img_ids, txt_ids):
        tokens = torch.cat([self.txt_in(encoder_hidden_states), self.img_in(hidden_states)], dim=1)
        angles = rope(torch.cat([txt_ids, img_ids], dim=0), 24)
        tokens = tokens * angles.cos() + tokens.roll(1, -1) * angles.sin()
        q, k, v = self.qkv(tokens).chunk(3, dim=-1)
        mixed = self.proj(F.scaled_dot_product_attention(q, k, v))
        return self.out(mixed[:, encoder_hidden_states.shape[1]:])


class PatchedDenoiser(nn.Module):
    """SD3-style: 2x2 patches, a learned position table cropped around its center to the latent's grid."""

    config = {"patch_size": 2, "in_channels": 4}

    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(4, 16, 2, stride=2)
        self.positions = nn.Parameter(torch.randn(1, 32, 32, 16) * 0.02)
        self.mix, self.out = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, hidden_states, timestep):
        b, _, h, w = hidden_states.shape
        grid_h, grid_w = h // 2, w // 2
        top, left = (32 - grid_h) // 2, (32 - grid_w) // 2
        tokens = self.patch(hidden_states).flatten(2).transpose(1, 2)
        tokens = tokens + self.positions[:, top:top + grid_h, left:left + grid_w].reshape(1, -1, 16)
        tokens = tokens + self.mix(tokens).mean(1, keepdim=True) * timestep[:, None, None].float() / 1000
        patches = self.out(tokens).reshape(b, grid_h, grid_w, 4, 2, 2)
        return patches.permute(0, 3, 1, 4, 2, 5).reshape(b, 4, h, w)


class MaskedCrossAttention(nn.Module):
    """Cross-attention whose mask is padded to the keys, repeated per head, viewed (batch, heads, -1, keys)."""

    heads = 2

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, hidden_states, encoder_hidden_states, encoder_attention_mask):
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


def build(name):
    torch.manual_seed(0)
    return {"vae": TinyVAE, "unet1d": UNet1D, "transformer": LatentTransformer, "denoiser": PatchedDenoiser,
            "cross_attention": MaskedCrossAttention}[name]().eval()
'''

TESTS = '''
import pytest, torch
from diffusion_models import build


def randn(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))


@pytest.fixture
def vae():
    return build("vae")


@pytest.fixture
def unet1d():
    return build("unet1d")


@pytest.fixture
def transformer():
    return build("transformer")


@pytest.fixture
def denoiser():
    return build("denoiser")


@pytest.fixture
def cross_attention():
    return build("cross_attention")


@pytest.mark.observe_export("vae")
def test_vae_keeps_the_image_size(vae):
    assert vae(randn(4, 3, 32, 32), generator=torch.manual_seed(0)).shape == (4, 3, 32, 32)


@pytest.mark.observe_export("vae")
def test_vae_is_deterministic_without_sampling(vae):
    image = randn(2, 3, 32, 32)
    assert torch.equal(vae(image, generator=torch.Generator().manual_seed(1)), vae(image))


@pytest.mark.observe_export("unet1d")
def test_unet1d_denoises_a_signal(unet1d):
    assert unet1d(randn(4, 6, 16), torch.tensor([10] * 4)).shape == (4, 6, 16)


@pytest.mark.observe_export("transformer")
def test_transformer_predicts_each_latent_token(transformer):
    out = transformer(randn(1, 16, 4), randn(1, 12, 16), randn(16, 3), randn(12, 3))
    assert out.shape == (1, 16, 4)


@pytest.mark.observe_export("denoiser")
def test_denoiser_keeps_the_latent_shape(denoiser):
    assert denoiser(randn(2, 4, 16, 16), torch.tensor([500, 20])).shape == (2, 4, 16, 16)


@pytest.mark.observe_export("cross_attention")
def test_cross_attention_with_a_padding_mask(cross_attention):
    mask = torch.ones(4, 5)
    mask[1, -2:] = 0
    assert cross_attention(randn(4, 6, 8), randn(4, 5, 8), mask).shape == (4, 6, 8)


@pytest.mark.observe_export("cross_attention")
def test_cross_attention_without_padding(cross_attention):
    cross_attention(randn(2, 3, 8), randn(2, 7, 8), torch.ones(2, 7))
'''

DIMS = {
    "vae": {"sample": {"0": "batch", "2": "height", "3": "width"}},
    "unet1d": {"sample": {"0": "batch", "2": "length"}, "timestep": {"0": "batch"}},
    "transformer": {"hidden_states": {"0": "batch", "1": "seq"}, "encoder_hidden_states": {"0": "batch",
                    "1": "encoder_seq"}, "img_ids": {"0": "seq"}, "txt_ids": {"0": "encoder_seq"}},
    "denoiser": {"hidden_states": {"0": "batch", "2": "height", "3": "width"}, "timestep": {"0": "batch"}},
    "cross_attention": {"hidden_states": {"0": "batch", "1": "seq"},
                        "encoder_hidden_states": {"0": "batch", "1": "encoder_seq"},
                        "encoder_attention_mask": {"0": "batch", "1": "encoder_seq"}},
}


def held_out(name: str) -> tuple[torch.Tensor, ...]:
    """Inputs at sizes no test used, as a pipeline makes them (sides and lengths in its steps)."""
    torch.manual_seed(1)
    return {
        "vae": lambda: (torch.randn(3, 3, 48, 40),),
        "unet1d": lambda: (torch.randn(2, 6, 24), torch.tensor([3, 700])),
        "transformer": lambda: (torch.randn(2, 36, 4), torch.randn(2, 5, 16), torch.randn(36, 3), torch.randn(5, 3)),
        "denoiser": lambda: (torch.randn(3, 4, 24, 20), torch.tensor([1, 2, 3])),
        "cross_attention": lambda: (torch.randn(1, 9, 8), torch.randn(1, 3, 8), torch.tensor([[1.0, 1.0, 0.0]])),
    }[name]()


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_a_diffusers_style_suite_passes_dynamic_in_every_side_and_length(
        pytester: pytest.Pytester, workers: list[str]) -> None:
    pytester.makepyfile(diffusion_models=MODELS, test_diffusion=TESTS)
    result = pytester.runpytest_subprocess(
        "--export-check", "--export-examples=4", "--export-report=report.json", "--junitxml=junit.xml",
        "-p", "no:cacheprovider", *workers)
    cases = junit_cases(pytester.path / "junit.xml")
    assert cases == {f"test_diffusion::{name}": "passed" for name in (
        "test_vae_keeps_the_image_size", "test_vae_is_deterministic_without_sampling",
        "test_unet1d_denoises_a_signal", "test_transformer_predicts_each_latent_token",
        "test_denoiser_keeps_the_latent_shape", "test_cross_attention_with_a_padding_mask",
        "test_cross_attention_without_padding")} | {f"exportobs::{name}": "passed" for name in DIMS}, \
        result.stdout.str()[-3000:]
    models = {m["name"]: m for m in json.loads((pytester.path / "report.json").read_text())["models"]}
    assert {name: models[name]["dims"] for name in DIMS} == DIMS
    assert "generator (<torch._C.Generator>) bound as the tests passed it: an object only Python uses is no graph " \
           "input" in models["vae"]["notes"]
    build = runpy.run_path(str(pytester.path / "diffusion_models.py"))["build"]
    for name in DIMS:
        _serves(Path(models[name]["onnx_path"]), build(name), held_out(name))


def _serves(path: Path, model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    (got,) = session.run(None, {n: t.numpy() for n, t in zip(names, inputs)})
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(got), model(*inputs), rtol=1e-4, atol=1e-4)
