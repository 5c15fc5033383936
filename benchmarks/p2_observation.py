"""P2: what observing costs the tests' call phase (time and memory).

A forward-heavy workload: 3 models (an MLP, a small CNN, a 2-layer tiny Llama) each called 200 times
with 5 distinct input shapes, split like a test suite would be: 20 tests of 10 calls per model.
Both sides run in this process, on the same modules and the same pre-built inputs:

* plain: the calls alone;
* observed: every test wrapped exactly as the plugin wraps a test marked
  ``@pytest.mark.observe_export(<fixture>)`` during its call phase (``ObserveOptions`` from the
  marker's kwargs, ``SessionStore.observe`` of the fixture's module, the flattening context) with a
  fresh ``SessionStore`` per repetition (one repetition = one session).

Repetitions alternate plain/observed per model, after a discarded warm-up of each. The ratio is the
sum over models of the minimum observed CPU time over the same for plain (one torch thread, so CPU
time is not inflated by idle worker threads; minima, because each repetition is short and the
noise of a shared machine only ever adds time); the ratio of medians and wall times are shown
beside it, and per model the cost per call.

Memory: two child processes per side run the workload once and report their peak RSS
(``ru_maxrss``) and, for the observed side, the bytes of the tensors the store keeps.

    python benchmarks/p2_observation.py [--quick] [--reps N]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from _common import PYTHON, Clock, Samples, child_env, emit, log, run_child, verdict  # noqa: E402

TARGET = 1.10
TESTS, CALLS_PER_TEST = 20, 10  # 200 calls per model


def build_models() -> dict[str, tuple[Any, list[dict[str, Any]]]]:
    """name -> (module, list of call kwargs); 5 distinct shapes per model, fixed seeds."""
    import torch
    import transformers

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)).eval()

    class SmallCNN(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = torch.nn.Conv2d(3, 16, 3, padding=1)
            self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
            self.head = torch.nn.Linear(32, 10)

        def forward(self, images: torch.Tensor) -> torch.Tensor:
            x = torch.relu(self.conv1(images))
            x = torch.relu(self.conv2(x)).mean(dim=(2, 3))
            return self.head(x)

    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100,
    )
    llama = transformers.LlamaForCausalLM(config).eval()
    return {
        "mlp": (mlp, [{"input": torch.randn(b, 64)} for b in (1, 2, 4, 8, 16)]),
        "cnn": (SmallCNN().eval(), [{"images": torch.randn(b, 3, h, h)}
                                    for b, h in ((1, 32), (2, 32), (4, 32), (2, 24), (3, 16))]),
        "llama": (llama, [{"input_ids": torch.randint(0, 100, (b, s))}
                          for b, s in ((1, 8), (2, 8), (2, 16), (4, 12), (3, 5))]),
    }


def test_context(store: Any, module: Any, fixture: str, test: int) -> contextlib.AbstractContextManager:
    """What ``ExportSession.observe_marked`` enters around the call phase of one marked test."""
    from pytest_exportobs.core.trees import flattening_context
    from pytest_exportobs.observe.store import ObserveOptions

    stack = contextlib.ExitStack()
    options = ObserveOptions.from_kwargs({}, f"@pytest.mark.observe_export on test_{fixture}_{test}")
    stack.enter_context(store.observe(module, fixture, options, f"test_p2.py::test_{fixture}_{test}"))
    stack.enter_context(flattening_context())
    return stack


def workload(module: Any, calls: list[dict[str, Any]], store: Any, fixture: str) -> None:
    """200 calls in 20 tests; ``store`` None = not observed."""
    for test in range(TESTS):
        context = test_context(store, module, fixture, test) if store is not None else contextlib.nullcontext()
        with context:
            for k in range(CALLS_PER_TEST):
                module(**calls[(test * CALLS_PER_TEST + k) % len(calls)])


def new_store() -> Any:
    from pytest_exportobs.observe.store import SessionStore

    return SessionStore()


def stored_bytes(store: Any) -> int:
    import torch
    from torch.utils import _pytree

    from pytest_exportobs.core.trees import flattening_context

    total = 0
    with flattening_context():
        for group in store.groups.values():
            for obs in group.recorder.observations:
                for leaf in _pytree.tree_leaves((obs.args, obs.kwargs, obs.outputs)):
                    if isinstance(leaf, torch.Tensor):
                        total += leaf.numel() * leaf.element_size()
    return total


def measure_time(reps: int) -> dict[str, tuple[Samples, Samples]]:
    models = build_models()
    out = {}
    for name, (module, calls) in models.items():
        plain, observed = Samples(f"{name} plain"), Samples(f"{name} observed")
        sides: dict[str, tuple[Samples, Callable[[], None]]] = {
            "plain": (plain, lambda module=module, calls=calls, name=name: workload(module, calls, None, name)),
            "observed": (
                observed,
                lambda module=module, calls=calls, name=name: workload(module, calls, new_store(), name),
            ),
        }
        for _, run in sides.values():  # warm-up
            run()
        for rep in range(reps):
            order = ("plain", "observed") if rep % 2 == 0 else ("observed", "plain")
            for side in order:
                samples, run = sides[side]
                with Clock() as clock:
                    run()
                samples.add(clock.timing)
        out[name] = (plain, observed)
        log(f"P2: {name}: plain {plain.median() * 1e3:.1f}ms observed {observed.median() * 1e3:.1f}ms (cpu medians)")
    return out


def memory_child(side: str) -> None:
    """Run the workload once in this (child) process; print peak RSS and stored bytes as JSON."""
    import torch

    torch.set_num_threads(1)
    models = build_models()
    store = new_store() if side == "observed" else None
    for name, (module, calls) in models.items():
        workload(module, calls, store, name)
    print(json.dumps({
        "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "stored_bytes": stored_bytes(store) if store is not None else 0,
        "observations": sum(g.recorder.num_obs() for g in store.groups.values()) if store is not None else 0,
    }))


def measure_memory(reps: int) -> dict[str, list[dict[str, float]]]:
    results: dict[str, list[dict[str, float]]] = {"plain": [], "observed": []}
    for rep in range(reps):
        for side in (("plain", "observed") if rep % 2 == 0 else ("observed", "plain")):
            _, proc = run_child([PYTHON, __file__, "--memory-child", side], env=child_env())
            results[side].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--reps", type=int, default=None, help="interleaved repetitions per side")
    parser.add_argument("--json", action="store_true", help="also print a machine-readable result line")
    parser.add_argument("--memory-child", choices=("plain", "observed"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_child:
        memory_child(args.memory_child)
        return {}
    import torch

    torch.set_num_threads(1)
    reps = args.reps or (5 if args.quick else 15)
    log(f"P2: {reps} interleaved repetitions per side, {TESTS}x{CALLS_PER_TEST} calls per model")
    timings = measure_time(reps)
    log("P2: peak memory of child processes")
    memory = measure_memory(1 if args.quick else 2)

    plain_cpu = sum(p.minimum() for p, _ in timings.values())
    observed_cpu = sum(o.minimum() for _, o in timings.values())
    median_ratio = sum(o.median() for _, o in timings.values()) / sum(p.median() for p, _ in timings.values())
    plain_wall = sum(p.minimum("wall") for p, _ in timings.values())
    observed_wall = sum(o.minimum("wall") for _, o in timings.values())
    ratio = observed_cpu / plain_cpu
    n_calls = TESTS * CALLS_PER_TEST
    per_model = "; ".join(
        f"{name} {o.minimum() / p.minimum():.2f} ({p.minimum() / n_calls * 1e6:.0f}->"
        f"{o.minimum() / n_calls * 1e6:.0f}us/call, +{(o.minimum() - p.minimum()) / n_calls * 1e6:.0f}us)"
        for name, (p, o) in timings.items()
    )
    rss_plain = min(m["maxrss_mb"] for m in memory["plain"])
    rss_observed = min(m["maxrss_mb"] for m in memory["observed"])
    stored_mb = memory["observed"][0]["stored_bytes"] / 2**20
    lines = [
        f"P2 observed vs plain call phase (3 models x {n_calls} calls, {TESTS} tests each) ratio={ratio:.3f}  "
        f"{verdict(ratio, TARGET)}",
        f"    cpu {observed_cpu:.3f}s vs {plain_cpu:.3f}s (minima of {reps} interleaved reps; ratio of medians "
        f"{median_ratio:.3f}); wall {observed_wall:.3f}s vs {plain_wall:.3f}s "
        f"(wall ratio={observed_wall / plain_wall:.3f})",
        f"    per model (cpu minima): {per_model}",
        f"P2m peak RSS observed vs plain ratio={rss_observed / rss_plain:.3f}  ({rss_observed:.0f}MB vs "
        f"{rss_plain:.0f}MB, +{rss_observed - rss_plain:.1f}MB; the store keeps "
        f"{memory['observed'][0]['observations']} observations = {stored_mb:.2f}MB of tensors)",
    ]
    result = {
        "id": "P2", "ratio": ratio, "median_ratio": median_ratio, "wall_ratio": observed_wall / plain_wall,
        "target": TARGET,
        "models": {name: {"plain": p.to_json(), "observed": o.to_json()} for name, (p, o) in timings.items()},
        "memory": memory, "rss_ratio": rss_observed / rss_plain, "lines": lines,
    }
    emit(result, args.json)
    return result


if __name__ == "__main__":
    main()
