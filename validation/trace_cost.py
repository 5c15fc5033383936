"""What torch.export costs a windowed vision model per trace, by which of its image's dims are dynamic.

    python validation/trace_cost.py [--models swin swinv2 vit] [--reps 2]

Each model is a tiny untrained one with its transformers test suite's configuration (32x32 images
of 3 channels, patches of 2; Swin's windows of 2), traced as a check traces it (torch.onnx's
size-oblivious capture, ``compat.lean_tracing``) with the image's dims static, the batch alone
dynamic, or the batch and both sides dynamic (``Dim.DYNAMIC``, as a guess of the sides is tried).
Every (model, dims) pair runs in a fresh process, ``--reps`` traces one after the other (the first
pays the process's cold symbolic arithmetic); one thread, wall seconds of each trace.  The sides'
price is what a check pays on a suite whose tests never vary them (see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

MODES = ("static", "batch", "sides")


def traced(model: str, mode: str, reps: int) -> list[float]:
    """Wall seconds of ``reps`` traces of ``model`` with ``mode``'s dims, in this process."""
    import torch

    from pytest_exportobs.compat.lean_tracing import lean_tracing
    from pytest_exportobs.engine.export.tracing import capturing

    torch.set_num_threads(1)
    build, kwargs = _tiny(model)
    dim = torch.export.Dim
    dims = {"static": None, "batch": {"pixel_values": {0: dim("batch")}},
            "sides": {"pixel_values": {0: dim("batch"), 2: dim.DYNAMIC, 3: dim.DYNAMIC}}}[mode]
    if dims is not None and kwargs:
        dims = {**dims, **{name: None for name in kwargs}}
    pixels = torch.randn(13, 3, 32, 32)
    seconds = []
    for _ in range(reps):
        module = build().eval()
        begin = time.perf_counter()
        with capturing(True), lean_tracing():
            torch.export.export(module, (), {"pixel_values": pixels, **kwargs}, dynamic_shapes=dims)
        seconds.append(time.perf_counter() - begin)
    return seconds


def _tiny(model: str) -> tuple[Any, dict[str, Any]]:
    """A builder of the tiny model and the keyword arguments its calls pass besides the pixels."""
    import transformers

    common = {"image_size": 32, "patch_size": 2, "num_channels": 3}
    if model == "vit":
        config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=37, **common)
        return (lambda: transformers.ViTModel(config)), {"interpolate_pos_encoding": True}  # other sides
    windowed = {"embed_dim": 16, "depths": [1, 2, 1], "num_heads": [2, 2, 4], "window_size": 2, "mlp_ratio": 2.0}
    if model == "swin":
        swin = transformers.SwinConfig(**windowed, **common)
        return (lambda: transformers.SwinModel(swin)), {}
    swinv2 = transformers.Swinv2Config(**windowed, **common)
    return (lambda: transformers.Swinv2Model(swinv2)), {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["swin", "swinv2", "vit"], choices=["swin", "swinv2", "vit"])
    parser.add_argument("--reps", type=int, default=2, help="traces per process (the first is cold)")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(traced(*args.child, args.reps)))
        return 0
    print("| model | " + " | ".join(f"{mode}: cold, warm (s)" for mode in MODES) + " | sides / batch: cold, warm |")
    print("|---|" + "---|" * (len(MODES) + 1))
    for model in args.models:
        cells, cold, warm = [], {}, {}
        for mode in MODES:
            child = subprocess.run([sys.executable, __file__, "--reps", str(args.reps), "--child", model, mode],
                                   capture_output=True, text=True, check=True)
            seconds = json.loads(child.stdout.splitlines()[-1])
            cold[mode], warm[mode] = seconds[0], min(seconds[1:] or seconds)
            cells.append(", ".join(f"{s:.2f}" for s in seconds))
        ratios = ", ".join(f"{clock['sides'] / clock['batch']:.1f}x" for clock in (cold, warm))
        print(f"| {model} | " + " | ".join(cells) + f" | {ratios} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
