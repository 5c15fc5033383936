"""Compare two JSON reports (``--export-report``): per model the verdict and dims before and now,
the package versions that changed, and whether a model regressed — what a team runs when it
tries a torch or transformers upgrade in a branch.

The new report is judged by the gate with the old one as its baseline, so a regression here is
one the CI gate would report.  Exit status: 0 without regression, 1 with one, 2 for a usage error.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from .baseline import Baseline, BaselineError
from .judge import Change, Gate, gate, states
from .render import listed, markdown_table, versions_text
from .reports import Report

PROG = "python -m pytest_exportobs.compare"
_COLUMNS = ("model", "before", "now")
UNCHANGED = "unchanged"


@dataclass
class Comparison:
    """The gate of the new report against the old one, and every model's state on both sides."""

    gate: Gate
    rows: list[Change]

    @classmethod
    def of(cls, old: Report, new: Report) -> Comparison:
        baseline = Baseline.from_results(old.results)
        judged = gate(baseline, new.results)
        return cls(judged, states(baseline.models, {r.name: r for r in new.results}))

    def summary_line(self) -> str:
        """``exportobs compare: 2 models, 1 changed, 1 regression (mlp: passed→failed at verify)``."""
        n = len(self.rows)
        regressions = listed(self.gate.regressions, "regression{s}") or "no regression"
        counts = f"{n} model{'' if n == 1 else 's'}, {len(self.gate.changes)} changed"
        return f"exportobs compare: {counts}, {regressions}"

    def text(self) -> str:
        """One line per unchanged model, two (before, now) per changed one: states can be long."""
        width = max((len(c.name) for c in self.rows), default=0)

        def line(name: str, label: str, state: str) -> str:
            return f"{name:<{width}}  {label:<{len(UNCHANGED)}}  {state}"

        lines = [f"versions changed: {versions_text(self.gate.versions)}"]
        for c in self.rows:
            if c.before == c.now:
                lines.append(line(c.name, UNCHANGED, c.now))
            else:
                lines += [line(c.name, "before", c.before), line("", "now", c.now)]
        return "\n".join([*lines, self.summary_line()]) + "\n"

    def markdown(self) -> str:
        """A table of every model (for a CI step summary)."""
        rows = ([c.name, c.before, UNCHANGED if c.now == c.before else c.now] for c in self.rows)
        blocks = [
            "# exportobs compare", f"Versions changed: {versions_text(self.gate.versions)}",
            markdown_table(_COLUMNS, rows), self.summary_line(),
        ]
        return "\n\n".join(blocks) + "\n"


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit status."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("old", help="JSON report of the reference run")
    parser.add_argument("new", help="JSON report of the run to compare with it")
    parser.add_argument("--markdown", action="store_true", help="print Markdown instead of text")
    args = parser.parse_args(argv)
    try:
        old, new = Report.load(args.old), Report.load(args.new)
    except BaselineError as e:
        print(f"exportobs compare: error: {e}", file=sys.stderr)
        return 2
    comparison = Comparison.of(old, new)
    sys.stdout.write(comparison.markdown() if args.markdown else comparison.text())
    return 1 if comparison.gate.regressions else 0
