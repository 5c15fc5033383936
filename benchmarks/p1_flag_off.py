"""P1: what the installed plugin costs a suite that does not ask for the export check.

A generated suite (200 trivial tests, plus 5 tests marked ``observe_export`` that call a tiny torch
model) runs in child processes ``python -m pytest -q -p no:cacheprovider``:

* A: the plugin installed, ``--export-check`` not given (what every user run pays);
* B: the same with ``-p no:exportobs`` (the plugin not loaded at all).

Runs alternate A B / B A ..., after one discarded warm-up run of each side. The ratio is the median
of the per-pair ratios of the children's CPU time (user + system); wall times are shown beside it.
A second, torch-free suite (the 200 trivial tests alone) magnifies the plugin's fixed cost, since
importing torch dominates the first suite's time.

On a busy machine the run-to-run spread (several %) exceeds the effect being measured, so one more
run of A under cProfile attributes time to the plugin's own code with flag off (the import of its
entry point and every hook it implements); that share is printed as ``attributable``.

    python benchmarks/p1_flag_off.py [--quick] [--reps N]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _common import (  # noqa: E402
    PYTHON,
    Samples,
    child_env,
    emit,
    interleaved,
    log,
    paired_ratio,
    paired_ratio_iqr,
    run_child,
    verdict,
)

TARGET = 1.02
N_TRIVIAL = 200

PYTEST_INI = """\
[pytest]
# registered here so that the run without the plugin prints no unknown-marker warnings either
markers =
    observe_export: observe the named fixtures' modules
"""

MODEL_TESTS = '''\
import pytest
import torch


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(8, 16)
        self.l2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))


@pytest.fixture
def tiny():
    torch.manual_seed(0)
    return Tiny().eval()


@pytest.mark.observe_export("tiny")
@pytest.mark.parametrize("batch", [1, 2, 3, 4, 5])
def test_tiny(tiny, batch):
    assert tiny(torch.randn(batch, 8)).shape == (batch, 4)
'''


def write_suite(root: Path, with_torch: bool) -> None:
    (root / "pytest.ini").write_text(PYTEST_INI)
    lines = [f"def test_trivial_{i}():\n    assert {i} + 1 == {i + 1}\n" for i in range(N_TRIVIAL)]
    (root / "test_trivial.py").write_text("\n\n".join(lines))
    if with_torch:
        (root / "test_models.py").write_text(MODEL_TESTS)


def measure(root: Path, reps: int, expected: int) -> tuple[Samples, Samples]:
    base = [PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    sides = {"on": base, "off": [*base, "-p", "no:exportobs"]}
    samples = {"on": Samples("plugin on, flag off"), "off": Samples("-p no:exportobs")}
    env = child_env()
    for name, cmd in sides.items():  # warm-up: file system caches, first imports
        _, proc = run_child(cmd, cwd=str(root), env=env)
        if f"{expected} passed" not in proc.stdout:
            raise RuntimeError(f"unexpected outcome of the generated suite ({name}):\n{proc.stdout[-2000:]}")
    for _, on_first in interleaved(reps):
        for name in (("on", "off") if on_first else ("off", "on")):
            timing, _ = run_child(sides[name], cwd=str(root), env=env)
            samples[name].add(timing)
    return samples["on"], samples["off"]


def attributable(root: Path) -> tuple[float, float, list[str]]:
    """Seconds spent in the plugin's code (entry-point import + its hooks) during one cProfile'd
    run of side A, the profiled run's total, and the top items."""
    import pstats

    import pytest_exportobs

    package = str(Path(pytest_exportobs.__file__).parent) + "/"
    out = root / "p1.prof"
    cmd = [PYTHON, "-m", "cProfile", "-o", str(out), "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    run_child(cmd, cwd=str(root), env=child_env())
    stats = pstats.Stats(str(out))
    items = []
    for (filename, _lineno, name), (_, calls, _, cumulative, _) in stats.stats.items():
        if not filename.startswith(package):
            continue
        short = filename[len(package):]
        entry = name == "<module>" and short in ("__init__.py", "plugin.py")
        hook = short == "plugin.py" and (name.startswith("pytest_") or name == "export_observer")
        if entry or hook:
            items.append((cumulative, f"{short}:{name} x{calls} {cumulative * 1e3:.2f}ms"))
    out.unlink()
    items.sort(reverse=True)
    return sum(c for c, _ in items), stats.total_tt, [text for _, text in items[:4]]


def line(tag: str, what: str, on: Samples, off: Samples, target: float | None) -> str:
    ratio = paired_ratio(on, off, "cpu")
    wall_ratio = paired_ratio(on, off, "wall")
    low, high = paired_ratio_iqr(on, off)
    status = f"  {verdict(ratio, target)}" if target else ""
    if target and low <= target < high:
        status += " (inconclusive: the run-to-run noise spans the target; see P1c)"
    return (
        f"{tag} {what} ratio={ratio:.3f}{status}\n"
        f"    per-pair ratios: middle half within [{low:.3f}, {high:.3f}]\n"
        f"    cpu median {on.median():.3f}s vs {off.median():.3f}s (min {on.minimum():.3f}s vs "
        f"{off.minimum():.3f}s, spread {on.spread():.1%}/{off.spread():.1%}); wall median "
        f"{on.median('wall'):.3f}s vs {off.median('wall'):.3f}s (wall ratio={wall_ratio:.3f}); "
        f"{len(on.values)} interleaved runs each"
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--reps", type=int, default=None, help="interleaved runs per side")
    parser.add_argument("--json", action="store_true", help="also print a machine-readable result line")
    args = parser.parse_args(argv)
    reps = args.reps or (3 if args.quick else 6)
    light_reps = reps
    with tempfile.TemporaryDirectory(prefix="exportobs-p1-") as tmp:
        suite, light = Path(tmp, "suite"), Path(tmp, "light")
        suite.mkdir()
        light.mkdir()
        write_suite(suite, with_torch=True)
        write_suite(light, with_torch=False)
        log(f"P1: {reps} interleaved runs per side of a {N_TRIVIAL + 5}-test suite")
        on, off = measure(suite, reps, N_TRIVIAL + 5)
        log(f"P1: {light_reps} interleaved runs per side of the torch-free {N_TRIVIAL}-test suite")
        light_on, light_off = measure(light, light_reps, N_TRIVIAL)
        log("P1: one cProfile'd run of the plugin-on side")
        own, total, top = attributable(suite)
    lines = [
        line("P1", f"flag off vs -p no:exportobs ({N_TRIVIAL}+5 tests, torch model)", on, off, TARGET),
        line("P1b", f"same, torch-free suite ({N_TRIVIAL} tests; magnifies the fixed cost)",
             light_on, light_off, None),
        f"P1c attributable (cProfile, flag off): plugin code {own * 1e3:.1f}ms of {total:.2f}s profiled "
        f"= {own / total:.3%}  [{'; '.join(top)}]",
    ]
    result = {
        "id": "P1", "ratio": paired_ratio(on, off), "wall_ratio": paired_ratio(on, off, "wall"), "target": TARGET,
        "on": on.to_json(), "off": off.to_json(),
        "light_ratio": paired_ratio(light_on, light_off), "light_on": light_on.to_json(),
        "light_off": light_off.to_json(),
        "attributable_s": own, "profiled_s": total, "lines": lines,
    }
    emit(result, args.json)
    return result


if __name__ == "__main__":
    main()
