"""P6: what ``--export-observe`` costs a whole suite's test phase.

A generated transformers-style suite (200 tests: 180 forward calls of a tiny ``LlamaForCausalLM``
at 20 (batch, seq) shapes, 20 ``generate()`` calls) runs in child processes ``python -m pytest -q
-p no:cacheprovider`` with one torch thread, in two forms: the model from a session-scoped fixture
(P6: the thinnest tests, the worst case), and built by each test's fixture as transformers' model
tests do (P6c):

* plain: ``-p no:exportobs`` (the plugin not loaded);
* observed: ``--export-check --export-observe transformers.PreTrainedModel --export-target torch
  --export-examples 0``, no test edited;
* marked: the same observation through ``pytestmark = pytest.mark.observe_export("llama")`` and
  ``--export-check`` alone: observed / marked is what ``--export-observe`` adds to the recording
  every observed test pays (marked / plain).

The suite's conftest imports the model classes and times ``pytest_runtestloop`` (the test phase:
setup, call and teardown of every test; not the imports, not the check at session end), and ends
the process right after it, so the check never runs; it also counts the tests that observed the
model, which must be all 200 on the observed and marked sides and none on the plain one. The
sides run in turn (rotating the order) after one discarded warm-up of each; a ratio is the median
of the per-round ratios of wall time (the target's clock), CPU time beside it.

P6t (``--transformers TREE --arch llama ...``, not part of ``run.py``): the same timer on
transformers' own model tests (the tree ``validation/README.md`` makes, run by ``--python``, an
environment with transformers and its test dependencies), ``-p no:exportobs`` against
``--export-check --export-observe transformers.PreTrainedModel``, no test edited; both sides must
fail the same number of tests.

P6b: the wrapper's own cost per call, in this process: a trivial target module called 20000 times
inside ``AutoObserve.calls`` (already observed: the outermost path; and nested in another target:
the inner path), against the same calls outside.

    python benchmarks/p6_observe_suite.py [--quick] [--reps N]
    python benchmarks/p6_observe_suite.py --transformers TREE --arch llama bert --python ENV/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from _common import (  # noqa: E402
    PYTHON,
    Samples,
    Timing,
    child_env,
    emit,
    log,
    paired_ratio,
    paired_ratio_iqr,
    run_child,
    verdict,
)

TARGET = 1.05
N_TESTS = 200
CALLS = 20000

CONFTEST = '''\
import os
import pytest, torch
from transformers import LlamaConfig, LlamaForCausalLM  # imported here on both sides, not in the timed loop

@pytest.fixture(scope=os.environ["P6_SCOPE"])
def llama():
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    return model
'''

# A plugin (``-p p6_timer``) timing the test phase and counting the tests that observed a model.
TIMER = '''\
import gc, json, os, time
import pytest

observed = []
collecting = {"since": 0.0, "seconds": 0.0}

def _collection(phase, info):
    if phase == "start":
        collecting["since"] = time.perf_counter()
    else:
        collecting["seconds"] += time.perf_counter() - collecting["since"]

def pytest_runtest_logreport(report):
    if report.when == "call":
        observed.extend(value for key, value in report.user_properties if key == "exportobs")

@pytest.hookimpl(wrapper=True)
def pytest_runtestloop(session):
    gc.callbacks.append(_collection)
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        return (yield)
    finally:
        timing = {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu, "observed": len(observed),
                  "failed": session.testsfailed, "gc": collecting["seconds"]}
        with open(os.environ["P6_TIMING"], "w") as f:
            json.dump(timing, f)
        os._exit(0)  # the test phase is measured: the export check would come next
'''

TESTS = f'''\
import os
import pytest, torch

if os.environ.get("P6_MARKED"):
    pytestmark = pytest.mark.observe_export("llama")

SHAPES = [(b, s) for b in (1, 2, 3, 4) for s in (5, 8, 13, 16, 21)]

@pytest.mark.parametrize("i", range({N_TESTS - 20}))
def test_forward(llama, i):
    batch, seq = SHAPES[i % len(SHAPES)]
    ids = torch.randint(0, 100, (batch, seq), generator=torch.Generator().manual_seed(i))
    assert llama(input_ids=ids).logits.shape == (batch, seq, 100)

@pytest.mark.parametrize("i", range(20))
def test_generate(llama, i):
    ids = torch.randint(0, 100, (1 + i % 2, 6), generator=torch.Generator().manual_seed(i))
    assert llama.generate(ids, max_new_tokens=4, do_sample=False).shape == (1 + i % 2, 10)
'''

CHECK = ["--export-check", "--export-target", "torch", "--export-examples", "0"]
SIDES = {
    "plain": ["-p", "no:exportobs"],
    "observed": [*CHECK, "--export-observe", "transformers.PreTrainedModel"],
    "marked": CHECK,
}


def run_timed(python: str, cwd: Path, args: list[str], timer: Path, **env: str) -> dict[str, Any]:
    """One child session with the timer plugin (in directory ``timer``): its test phase's timing,
    the tests that failed and those that observed a model."""
    timing_file = timer / "timing.json"
    timing_file.unlink(missing_ok=True)
    path = os.pathsep.join(filter(None, [str(timer), os.environ.get("PYTHONPATH")]))
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "p6_timer", *args]
    run_child(cmd, cwd=str(cwd), env=child_env(P6_TIMING=str(timing_file), PYTHONPATH=path, OMP_NUM_THREADS="1", **env))
    return json.loads(timing_file.read_text())


def rounds(sides: dict[str, Callable[[], Timing]], reps: int, label: str) -> dict[str, Samples]:
    """Each side once as a warm-up, then ``reps`` rounds of all, rotating their order."""
    samples = {side: Samples(side) for side in sides}
    for run in sides.values():
        run()
    order = list(sides)
    for rep in range(reps):
        for side in order[rep % len(order):] + order[:rep % len(order)]:
            samples[side].add(sides[side]())
        log(f"{label}: round {rep + 1}/{reps}: " + ", ".join(
            f"{side} {samples[side].values[-1].wall:.2f}s" for side in sides))
    return samples


def measure_suite(reps: int, scope: str) -> dict[str, Samples]:
    """Test-phase timings of each side, for the suite with a ``scope`` model fixture."""
    with tempfile.TemporaryDirectory(prefix="exportobs-p6-") as tmp:
        root = Path(tmp)
        (root / "conftest.py").write_text(CONFTEST)
        (root / "test_suite.py").write_text(TESTS)
        (root / "p6_timer.py").write_text(TIMER)

        def side(name: str) -> Callable[[], Timing]:
            def run() -> Timing:
                env = {"P6_SCOPE": scope, **({"P6_MARKED": "1"} if name == "marked" else {})}
                data = run_timed(PYTHON, root, SIDES[name], root, **env)
                expected = 0 if name == "plain" else N_TESTS
                if data["failed"] or data["observed"] != expected:
                    raise RuntimeError(f"{name}: {data['failed']} tests failed, {data['observed']} observed "
                                       f"(expected {expected})")
                return Timing(data["wall"], data["cpu"])
            return run

        return rounds({name: side(name) for name in SIDES}, reps, f"P6 ({scope} fixture)")


def measure_transformers(python: str, tests: Path, arch: str, reps: int) -> dict[str, Samples]:
    """Test-phase timings of transformers' model tests of ``arch`` (a tree made as
    ``validation/README.md`` says), without the plugin and with every model observed."""
    module = f"tests/models/{arch}/test_modeling_{arch}.py"
    counts: dict[str, set[int]] = {"plain": set(), "observed": set()}
    with tempfile.TemporaryDirectory(prefix="exportobs-p6t-") as tmp:
        timer = Path(tmp)
        (timer / "p6_timer.py").write_text(TIMER)

        def side(name: str) -> Callable[[], Timing]:
            def run() -> Timing:
                data = run_timed(python, tests, [module, *SIDES[name]], timer, HF_HUB_OFFLINE="1")
                if (data["observed"] > 0) != (name == "observed"):
                    raise RuntimeError(f"{name}: {data['observed']} tests observed a model")
                counts[name].add(data["failed"])
                return Timing(data["wall"], data["cpu"], data["gc"])
            return run

        samples = rounds({name: side(name) for name in ("plain", "observed")}, reps, f"P6t ({arch})")
    if len(counts["plain"] | counts["observed"]) != 1:
        raise RuntimeError(f"P6t: the number of failed tests differs between runs: {counts}")
    return samples


def per_call_overhead() -> dict[str, float]:
    """Microseconds per call: plain, and through the wrapper (outermost seen, nested)."""
    import torch

    from pytest_exportobs.observe.autoobserve import AutoObserve

    class Target(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    class Outer(Target):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Target()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x)

    def cost(module: torch.nn.Module) -> float:
        x = torch.zeros(1)
        best = float("inf")
        for _ in range(5):
            begin = time.perf_counter()
            for _ in range(CALLS):
                module(x)
            best = min(best, time.perf_counter() - begin)
        return best / CALLS * 1e6

    target, outer = Target(), Outer()
    plain = {"outermost": cost(target), "nested": cost(outer)}
    with AutoObserve((Target,)).calls(lambda module: None):
        wrapped = {"outermost": cost(target), "nested": cost(outer)}
    return {"plain_us": plain["outermost"], "outermost_extra_us": wrapped["outermost"] - plain["outermost"],
            "nested_extra_us": wrapped["nested"] - plain["nested"] - (wrapped["outermost"] - plain["outermost"])}


def suite_line(tag: str, what: str, samples: dict[str, Samples]) -> str:
    observed, plain, marked = samples["observed"], samples["plain"], samples["marked"]
    ratio, (low, high) = paired_ratio(observed, plain, "wall"), paired_ratio_iqr(observed, plain, "wall")
    return (
        f"{tag} {what}: wall ratio={ratio:.3f}  {verdict(ratio, TARGET)}\n"
        f"    per-round wall ratios: middle half within [{low:.3f}, {high:.3f}]; "
        f"cpu ratio={paired_ratio(observed, plain, 'cpu'):.3f}\n"
        f"    wall median {observed.median('wall'):.3f}s vs {plain.median('wall'):.3f}s (min "
        f"{observed.minimum('wall'):.3f}s vs {plain.minimum('wall'):.3f}s); {len(plain.values)} rounds\n"
        f"    split: --export-observe vs the same tests marked (what the option adds) "
        f"{paired_ratio(observed, marked, 'wall'):.3f}; marked vs plain (the recording every observed test pays) "
        f"{paired_ratio(marked, plain, 'wall'):.3f}"
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--reps", type=int, default=None, help="rounds of the three sides")
    parser.add_argument("--json", action="store_true", help="also print a machine-readable result line")
    parser.add_argument("--transformers", type=Path, metavar="TREE",
                        help="P6t only: transformers' model tests in TREE (see validation/README.md)")
    parser.add_argument("--arch", nargs="+", default=["llama"], help="P6t: the architectures (tests/models/<arch>)")
    parser.add_argument("--python", default=PYTHON, help="P6t: the interpreter of the environment the tree runs in")
    args = parser.parse_args(argv)
    reps = args.reps or (3 if args.quick else 6)
    if args.transformers:
        return transformers_main(args, reps)
    log(f"P6: {reps} rounds of a {N_TESTS}-test tiny-Llama suite, two fixture scopes")
    session, built = measure_suite(reps, "session"), measure_suite(reps, "function")
    micro = per_call_overhead()
    lines = [
        suite_line("P6", f"--export-observe transformers.PreTrainedModel, test phase of {N_TESTS} tests "
                   "(session-scoped model)", session),
        suite_line("P6c", "same, the model built by each test's fixture", built),
        f"P6b wrapper per call: +{micro['outermost_extra_us']:.2f}us (outermost, already observed), "
        f"+{micro['nested_extra_us']:.2f}us (nested target) on a {micro['plain_us']:.1f}us module call",
    ]
    result = {"id": "P6", "ratio": paired_ratio(session["observed"], session["plain"], "wall"), "target": TARGET,
              "built_ratio": paired_ratio(built["observed"], built["plain"], "wall"),
              "session": {k: v.to_json() for k, v in session.items()},
              "built": {k: v.to_json() for k, v in built.items()}, **micro, "lines": lines}
    emit(result, args.json)
    return result


def transformers_main(args: argparse.Namespace, reps: int) -> dict:
    lines = []
    ratios = {}
    for arch in args.arch:
        samples = measure_transformers(args.python, args.transformers, arch, reps)
        observed, plain = samples["observed"], samples["plain"]
        ratios[arch] = ratio = paired_ratio(observed, plain, "wall")
        low, high = paired_ratio_iqr(observed, plain, "wall")
        lines.append(
            f"P6t {arch}: transformers' model tests, test phase, --export-observe transformers.PreTrainedModel vs "
            f"-p no:exportobs: wall ratio={ratio:.3f}  {verdict(ratio, TARGET)}\n"
            f"    per-round wall ratios within [{low:.3f}, {high:.3f}]; "
            f"cpu ratio={paired_ratio(observed, plain, 'cpu'):.3f}; "
            f"wall median {observed.median('wall'):.1f}s vs {plain.median('wall'):.1f}s; {len(plain.values)} rounds")
        gc_seconds = {side: statistics.median(t.gc for t in samples[side].values) for side in samples}
        lines.append(f"    in the garbage collector: {gc_seconds['observed']:.2f}s vs {gc_seconds['plain']:.2f}s "
                     f"(median of the rounds)")
    result = {"id": "P6t", "ratios": ratios, "target": TARGET, "lines": lines}
    emit(result, args.json)
    return result


if __name__ == "__main__":
    main()
