"""Run the seven benchmarks of pytest-exportobs and print one ratio per line.

    python benchmarks/run.py [--quick] [--only P1,P3] [--verbose]

P1  plugin installed, flag off  vs  -p no:exportobs          (target <= 1.02)
P2  observed call phase          vs  the same calls, plain     (target <= 1.10)
P3  engine finishing one model   vs  hand-written export + ORT (target <= 1.15)
P4  second, cached engine run    vs  the first                 (target <= 0.2)
P5  -n 2 / --export-jobs 2       vs  serial / --export-jobs 1  (target <= 0.65)
P6  --export-observe test phase  vs  -p no:exportobs          (target <= 1.05)
P7  --export-check suite (first run, rerun, reseeded)  vs  the plain suite  (targets 3, 1.3, 1.3)

Each benchmark runs in its own child process (P3 and P4 share one), so that none inherits another's
imports, caches or memory.  P1-P6 ratios come from CPU time, P7's from wall time (what a CI waits for;
see docs/benchmarks.md); absolute numbers follow each ratio line.  P1-P6 take about 8 minutes on 2 idle cores
(``--quick``: about 4), P7 about as long again; more on a busy machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from _common import PYTHON, RESULT_PREFIX, child_env  # noqa: E402

SCRIPTS = {
    "P1": ["p1_flag_off.py"],
    "P2": ["p2_observation.py"],
    "P3": ["p3_p4_export.py"],
    "P4": ["p3_p4_export.py"],
    "P5": ["p5_scale.py"],
    "P6": ["p6_observe_suite.py"],
    "P7": ["p7_check_cost.py"],
}


def run(script: str, extra: list[str], verbose: bool) -> dict:
    cmd = [PYTHON, str(HERE / script), "--json", *extra]
    proc = subprocess.run(cmd, env=child_env(), stdout=subprocess.PIPE,
                          stderr=None if verbose else subprocess.PIPE, text=True)
    results = [line[len(RESULT_PREFIX):] for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not results:
        tail = (proc.stderr or "")[-3000:]
        raise RuntimeError(f"{script} failed (exit code {proc.returncode}):\n{proc.stdout[-3000:]}\n{tail}")
    return json.loads(results[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Benchmarks of pytest-exportobs (ratios measured in this run)")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (less precise)")
    parser.add_argument("--only", default="P1,P2,P3,P4,P5,P6,P7", help="comma-separated subset, e.g. P1,P4")
    parser.add_argument("--verbose", action="store_true", help="show the benchmarks' progress")
    parser.add_argument("--mlp", action="store_true", help="P3/P4 on an MLP instead of the tiny Llama")
    args = parser.parse_args(argv)
    wanted = [w.strip().upper() for w in args.only.split(",") if w.strip()]
    unknown = sorted(set(wanted) - set(SCRIPTS))
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose among {sorted(SCRIPTS)}")
    extra = ["--quick"] if args.quick else []
    begin = time.perf_counter()
    failed = False
    done: set[str] = set()
    for name in SCRIPTS:
        if name not in wanted or name in done:
            continue
        script_args = list(extra)
        if name in ("P3", "P4"):
            both = {"P3", "P4"} <= set(wanted)
            if not both:
                script_args += ["--only", name.lower()]
            if args.mlp:
                script_args.append("--mlp")
            done |= {"P3", "P4"} if both else {name}
        print(f"... {name}{'+P4' if name == 'P3' and 'P4' in done else ''} running", file=sys.stderr, flush=True)
        try:
            result = run(SCRIPTS[name][0], script_args, args.verbose)
        except RuntimeError as e:
            print(f"{name} FAILED TO RUN: {e}", flush=True)
            failed = True
            continue
        for line in result["lines"]:
            print(line, flush=True)
    print(f"(total {time.perf_counter() - begin:.0f}s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
