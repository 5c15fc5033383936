"""Vision models: classifiers checked on one image, a UNet on latents of two sizes."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.observe_export("vit")
def test_vit_classifies_one_image(vit):
    assert vit(pixel_values=torch.randn(1, 3, 32, 32)).logits.shape == (1, 10)


@pytest.mark.observe_export("resnet")
def test_resnet_classifies_one_image(resnet):
    assert resnet(pixel_values=torch.randn(1, 3, 32, 32)).logits.shape == (1, 10)


@pytest.mark.observe_export("small_cnn")
@pytest.mark.parametrize("size", [32, 48])
def test_small_cnn_any_resolution(small_cnn, size):
    assert small_cnn(torch.randn(2, 3, size, size)).shape == (2, 4)


@pytest.mark.observe_export("unet")
@pytest.mark.parametrize("side", [16, 24])
def test_unet_keeps_the_latent_shape(unet, side):
    latents = torch.randn(2, 4, side, side)
    assert unet(latents).shape == latents.shape
