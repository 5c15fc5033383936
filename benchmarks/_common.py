"""Helpers shared by the benchmark scripts: timers, robust statistics, child processes, output.

The machine these run on is often shared, so every benchmark records two clocks:

* CPU time (user + system, of this process or of a child) -- what the work costs; it barely moves
  when other processes compete for the cores, so the ratios are computed from it;
* wall time -- what a user waits for, printed beside it (noisier on a busy machine).

A/B measurements are interleaved (A B B A A B ...) so that a slow drift of the machine's load hits
both sides alike, and summarised by medians (and minima, shown for reference).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

PYTHON = sys.executable
RESULT_PREFIX = "BENCH-RESULT "


@dataclass
class Timing:
    """One measurement: wall and CPU seconds (and those in the garbage collector, when measured)."""

    wall: float
    cpu: float
    gc: float = 0.0


@dataclass
class Samples:
    """Repeated measurements of one side of a comparison."""

    label: str
    values: list[Timing] = field(default_factory=list)

    def add(self, timing: Timing) -> None:
        self.values.append(timing)

    def median(self, clock: str = "cpu") -> float:
        return statistics.median(getattr(t, clock) for t in self.values)

    def minimum(self, clock: str = "cpu") -> float:
        return min(getattr(t, clock) for t in self.values)

    def spread(self, clock: str = "cpu") -> float:
        """Relative interquartile range (0.05 = the middle half of the runs lies within 5%)."""
        xs = sorted(getattr(t, clock) for t in self.values)
        if len(xs) < 4:
            return (xs[-1] - xs[0]) / statistics.median(xs) if xs else 0.0
        q = statistics.quantiles(xs, n=4)
        return (q[2] - q[0]) / statistics.median(xs)

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label, "n": len(self.values),
            "cpu_median": self.median("cpu"), "cpu_min": self.minimum("cpu"),
            "wall_median": self.median("wall"), "wall_min": self.minimum("wall"),
            "cpu_spread": self.spread("cpu"),
        }


def paired_ratio(a: Samples, b: Samples, clock: str = "cpu") -> float:
    """Median of the per-pair ratios a_i / b_i (pairs measured next to each other)."""
    return statistics.median(getattr(x, clock) / getattr(y, clock) for x, y in zip(a.values, b.values))


def paired_ratio_iqr(a: Samples, b: Samples, clock: str = "cpu") -> tuple[float, float]:
    """Interquartile range of the per-pair ratios (how far one pair can be trusted)."""
    ratios = sorted(getattr(x, clock) / getattr(y, clock) for x, y in zip(a.values, b.values))
    if len(ratios) < 4:
        return ratios[0], ratios[-1]
    q = statistics.quantiles(ratios, n=4)
    return q[0], q[2]


def interleaved(n: int) -> Iterator[tuple[int, bool]]:
    """(repetition, a_first) in an A B / B A / A B ... order."""
    for i in range(n):
        yield i, i % 2 == 0


class Clock:
    """``with Clock() as c: ...`` then ``c.timing`` (this process's wall and CPU time, all threads)."""

    def __enter__(self) -> Clock:
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.timing = Timing(time.perf_counter() - self._wall, time.process_time() - self._cpu)


def run_child(cmd: list[str], cwd: str | None = None, env: dict[str, str] | None = None,
              check: bool = True) -> tuple[Timing, subprocess.CompletedProcess]:
    """Run a child process to completion; its wall time and CPU time (user + system, from the
    kernel's accounting of reaped children, so grandchildren are included)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    begin = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - begin
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if check and proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd)} failed with exit code {proc.returncode}\n"
            f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"
        )
    return Timing(wall, cpu), proc


# Not inherited by the children: pytest options and plugins, and PYTHONDONTWRITEBYTECODE (some
# sandboxes set it): without bytecode caching pytest rewrites the modules of every plugin's
# distribution in every process (hypothesis' 73: 1.3 s a process, three processes under -n 2),
# which no machine with Python's default pays after the first run.
NOT_INHERITED = ("PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTHONDONTWRITEBYTECODE")


def child_env(**extra: str) -> dict[str, str]:
    """The environment for child processes: this one's, less :data:`NOT_INHERITED`."""
    env = {k: v for k, v in os.environ.items() if k not in NOT_INHERITED}
    env.update(extra)
    return env


def verdict(ratio: float, target: float, smaller_is_better: bool = True) -> str:
    ok = ratio <= target if smaller_is_better else ratio >= target
    return f"target<={target:g} {'OK' if ok else 'OFF TARGET'}"


def emit(result: dict[str, Any], as_json: bool) -> None:
    """Print the human lines, and the machine-readable result for run.py when asked."""
    for line in result["lines"]:
        print(line, flush=True)
    if as_json:
        print(RESULT_PREFIX + json.dumps(result), flush=True)


def log(message: str) -> None:
    """Progress on stderr (run.py shows it only with --verbose)."""
    print(message, file=sys.stderr, flush=True)
