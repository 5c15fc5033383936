"""A small convolutional classifier that accepts images of any size."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.observe_export("convnet")
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize(("height", "width"), [(32, 32), (48, 64), (40, 24)])
def test_convnet_any_image_size(convnet, batch, height, width):
    torch.manual_seed(height * width)
    logits = convnet(torch.randn(batch, 3, height, width))
    assert logits.shape == (batch, 10)
    assert torch.isfinite(logits).all()


def test_convnet_predictions_do_not_depend_on_the_batch(convnet, export_observer):
    """Explicit observation through the export_observer fixture (same effect as the marker)."""
    model = export_observer.watch(convnet, name="convnet")
    torch.manual_seed(0)
    images = torch.randn(3, 3, 56, 56)
    together = model(images)
    one_by_one = torch.cat([model(image[None]) for image in images])
    torch.testing.assert_close(together, one_by_one, atol=1e-5, rtol=1e-5)
