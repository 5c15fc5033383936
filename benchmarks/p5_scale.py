"""P5: a suite of 12 tiny Llama models × 2 tests, checked serially, across two xdist workers, and
in forked children two at a time.

The suite is written to a temp dir: each model is a ``LlamaForCausalLM`` (2 layers, untrained,
its own seed and hidden size, 48, 56, 64..., so that no export is shared through the cache)
behind a fixture, observed by two tests with ``@pytest.mark.observe_export`` that call it with
``input_ids`` and ``attention_mask`` of different batch and sequence sizes.  Every run is
``python -m pytest --export-check --export-examples=3 -p no:cacheprovider`` on a fresh export
directory (no cache), in a child process, wall time measured (the point is to use both cores);
``--models`` and ``--examples`` size it otherwise.

* xdist: ``-n 2`` against the serial run (target <= 0.65, and <= the machine's limit + 0.12).
* jobs: ``--export-jobs 2`` against ``--export-jobs 1``, one process (target <= 0.65, and <=
  the limit + 0.08).
* limit: what two checks side by side can reach on this machine, measured in the same run: two
  processes that each import torch and transformers and export a tiny Llama to ONNX twice, run
  side by side against one after the other.
* the plugin's part: the same suite without the plugin (``-p no:exportobs``), serially and with
  ``-n 2``: what the sessions cost without it (imports, xdist's start and end, the tests).  Each
  side's median minus its plugin-less session is the time the plugin adds (observing, pooling,
  checking); their ratio is what its parallel paths reach, to set beside the limit.

Sides alternate (A B, B A, ...); ratio = median of the per-pair wall-time ratios.  The verdicts of
every run must be the same (the report's verdict per model), or the benchmark fails.

    python benchmarks/p5_scale.py [--quick] [--reps N]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _common import PYTHON, child_env, emit, interleaved, log, run_child, verdict  # noqa: E402

TARGET = 0.65

CONFTEST = '''
import pytest, torch, transformers

def llama(seed, hidden):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    return transformers.LlamaForCausalLM(config).eval()
'''
FIXTURE = '''
@pytest.fixture(scope="session")
def llama_{i}():
    return llama({i}, {hidden})
'''
TESTS = '''
@pytest.mark.observe_export("llama_{i}")
def test_llama_{i}_short(llama_{i}):
    ids = torch.randint(0, 100, (2, 5))
    llama_{i}(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)

@pytest.mark.observe_export("llama_{i}")
def test_llama_{i}_long(llama_{i}):
    ids = torch.randint(0, 100, (3, 9))
    llama_{i}(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
'''


def write_suite(directory: Path, models: int) -> None:
    """The conftest (one fixture per model) and the tests (two per model)."""
    (directory / "conftest.py").write_text(CONFTEST + "".join(FIXTURE.format(i=i, hidden=48 + 8 * i)
                                                              for i in range(models)))
    (directory / "test_models.py").write_text("import pytest, torch\n" + "".join(TESTS.format(i=i)
                                                                                  for i in range(models)))

TWIN = """
import torch, transformers

config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
torch.manual_seed(0)
llama = transformers.LlamaForCausalLM(config).eval()

class Logits(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.llama = llama

    def forward(self, ids, mask):
        return self.llama(input_ids=ids, attention_mask=mask, use_cache=False).logits

ids = torch.randint(0, 100, (2, 5))
dims = {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")}
for _ in range(2):
    torch.onnx.export(Logits(), (ids, torch.ones_like(ids)), dynamic_shapes=(dims, dims), dynamo=True, verbose=False)
"""



def sides(examples: int) -> dict[str, list[str]]:
    """Each side's pytest options."""
    check = ["--export-check", f"--export-examples={examples}", "--export-report=report.json"]
    return {"serial": check, "-n 2": [*check, "-n", "2"],
            "jobs 1": [*check, "--export-jobs=1"], "jobs 2": [*check, "--export-jobs=2"],
            "no plugin serial": ["-p", "no:exportobs"], "no plugin -n 2": ["-p", "no:exportobs", "-n", "2"]}

INI = "[pytest]\nmarkers =\n    observe_export: declared for the sessions without the plugin\n"


def run_suite(directory: Path, args: list[str]) -> tuple[float, dict[str, str]]:
    """One session on a fresh export directory: its wall time and, when it checked, the verdict
    per model."""
    shutil.rmtree(directory / ".exportobs", ignore_errors=True)
    (directory / "report.json").unlink(missing_ok=True)
    timing, _ = run_child([PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          cwd=str(directory), env=child_env())
    if "--export-check" not in args:
        return timing.wall, {}
    report = json.loads((directory / "report.json").read_text())
    return timing.wall, {m["name"]: m["verdict"] for m in report["models"]}


def twins(side_by_side: bool) -> float:
    """Wall time of two twin exports, one after the other or side by side."""
    command = [PYTHON, "-c", TWIN]
    begin = time.perf_counter()
    if side_by_side:
        children = [subprocess.Popen(command, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    for _ in range(2)]
        if any(child.wait() != 0 for child in children):
            raise RuntimeError("P5: a twin export failed")
    else:
        for _ in range(2):
            run_child(command, env=child_env())
    return time.perf_counter() - begin


def twin_limit(reps: int) -> tuple[float, str]:
    """The median ratio side by side / one after the other, and the walls."""
    pairs = []
    for rep, serial_first in interleaved(reps):
        walls = {}
        for side_by_side in (False, True) if serial_first else (True, False):
            walls[side_by_side] = twins(side_by_side)
        log(f"P5 twins #{rep}: {walls[False]:.1f}s one after the other, {walls[True]:.1f}s side by side")
        pairs.append((walls[True], walls[False]))
    return (
        statistics.median(new / old for new, old in pairs),
        ", ".join(f"{old:.1f}s → {new:.1f}s" for new, old in pairs),
    )


def measure(
    directory: Path,
    options: dict[str, list[str]],
    a: str,
    b: str,
    reps: int,
    verdicts: dict[str, dict[str, str]],
) -> list[tuple[float, float]]:
    pairs = []
    for rep, a_first in interleaved(reps):
        walls = {}
        for side in (a, b) if a_first else (b, a):
            walls[side], checked = run_suite(directory, options[side])
            if checked:
                verdicts[f"{side} #{rep}"] = checked
            log(f"P5 {side} #{rep}: {walls[side]:.1f}s")
        pairs.append((walls[b], walls[a]))
    return pairs


def plugin_part(checked: dict[str, list[tuple[float, float]]], plain: list[tuple[float, float]]) -> list[str]:
    """What the sessions cost without the plugin, and the ratio of what it adds on each side."""
    plain_parallel, plain_serial = (statistics.median(walls) for walls in zip(*plain))
    lines = [f"P5 without the plugin: serial {plain_serial:.1f}s, -n 2 {plain_parallel:.1f}s "
             f"(xdist's own start and end on this suite: {plain_parallel - plain_serial:+.1f}s)"]
    for name, pairs in checked.items():
        new, old = (statistics.median(walls) for walls in zip(*pairs))
        base = plain_parallel if name == "xdist" else plain_serial
        lines.append(f"P5 {name:5s} the plugin's part (median minus the session without it): "
                     f"{old - plain_serial:.1f}s → {new - base:.1f}s = {(new - base) / (old - plain_serial):.2f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--models", type=int, default=12, help="tiny Llama models, two tests each")
    parser.add_argument("--examples", type=int, default=3, help="--export-examples: variations per graph")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    reps = args.reps or (1 if args.quick else 3)
    options = sides(args.examples)
    directory = Path(tempfile.mkdtemp(prefix="exportobs-p5-"))
    write_suite(directory, args.models)
    (directory / "pytest.ini").write_text(INI)
    try:
        verdicts: dict[str, dict[str, str]] = {}
        log("P5 warm-up (imports, .pyc)")
        run_suite(directory, [])
        limit, twin_walls = twin_limit(reps)
        lines = [f"P5 {args.models} models x 2 tests, {args.examples} variations a graph; limit twins side by side / "
                 f"one after the other = {limit:.2f}  ({twin_walls})"]
        margins = {"xdist": 0.12, "jobs": 0.08}
        checked = {}
        for name, (a, b) in {"xdist": ("serial", "-n 2"), "jobs": ("jobs 1", "jobs 2")}.items():
            pairs = checked[name] = measure(directory, options, a, b, reps, verdicts)
            ratio = statistics.median(new / old for new, old in pairs)
            walls = ", ".join(f"{old:.1f}s → {new:.1f}s" for new, old in pairs)
            lines.append(f"P5 {name:5s} {b} / {a} = {ratio:.2f}  ({walls})  {verdict(ratio, TARGET)}; "
                         f"limit + {margins[name]:.2f}: {verdict(ratio, round(limit + margins[name], 2))}")
        lines += plugin_part(checked, measure(directory, options, "no plugin serial", "no plugin -n 2", reps, verdicts))
        distinct = {json.dumps(v, sort_keys=True) for v in verdicts.values()}
        if len(distinct) != 1:
            raise SystemExit(f"P5: the verdicts differ between runs: {verdicts}")
        lines.append(f"P5 verdicts, the same in all {len(verdicts)} runs: {next(iter(verdicts.values()))}")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    emit({"id": "P5", "lines": lines}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
