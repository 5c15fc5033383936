"""What identifies a module's weights at a recorded call: their shapes and dtypes (a resize changes
them) and a digest of their values, the same in every process."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

DIGEST_SAMPLES = 64  # values of each parameter or buffer a weights digest reads, evenly spaced


def parameter_shapes(module: torch.nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    """Name, shape and dtype of every parameter."""
    return [(n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters()]


def layout_digest(parameters: list[tuple[str, tuple[int, ...], str]]) -> int:
    """A digest of :func:`parameter_shapes`, the same in every process (a call recorded on one
    xdist worker is matched to the shapes another process reads)."""
    return _stable_hash(parameters)


def weights_digest(module: torch.nn.Module) -> int:
    """A digest of the values of the parameters and buffers, taken at every recorded call: it
    changes when the weights do, whether in place, through ``.data`` (which in-place version
    counters miss: ``p.data.normal_()``), by replacement or by a resize.  Each tensor
    contributes its shape, dtype and version counter, and the bytes of at most
    :data:`DIGEST_SAMPLES` of its values, evenly spaced (gathered by dtype and hashed at once),
    so that it stays cheap for large models."""
    described = []
    samples: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in (*module.parameters(), *module.buffers()):
        described.append((tuple(tensor.shape), str(tensor.dtype), 0 if tensor.is_inference() else tensor._version))
        if not tensor.is_meta and tensor.numel():
            flat = tensor.detach().reshape(-1)
            # each sample to the CPU before they are joined: a model may hold weights on several devices
            samples.setdefault(flat.dtype, []).append(flat[:: max(1, flat.numel() // DIGEST_SAMPLES)].cpu())
    digest = hashlib.blake2b(repr(described).encode(), digest_size=8)
    for parts in samples.values():
        digest.update(torch.cat(parts).view(torch.uint8).numpy().tobytes())
    return int.from_bytes(digest.digest(), "big")


def _stable_hash(value: Any) -> int:
    """A hash of ``value``'s text that does not depend on the process (``hash`` of strings does)."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "big")
