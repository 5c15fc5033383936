"""Merge the JSON reports of CI shards (``--export-report`` of each) into one report, gate it
against the baseline as one run would be gated, and update the baseline from it.

Each shard checks the models its tests observed.  A model observed in several shards was
checked on each shard's calls: the merged report keeps the check that says least for the model
(failed, then incomplete or interrupted, then skipped, then passed; the first given among equals)
and the tests of all of them.  Exit status: 0 when the
gate passes, 1 when it fails, 2 for a usage error.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable

from ..core.vocabulary import Verdict
from ..engine.base.result import ModelResult
from .baseline import Baseline, BaselineError, session_env, update_baseline
from .judge import gate
from .render import summary_line
from .reports import Report, write_reports

PROG = "python -m pytest_exportobs.merge"
_WORST_FIRST = (Verdict.FAILED, Verdict.INCOMPLETE, Verdict.INTERRUPTED, Verdict.SKIPPED, Verdict.PASSED)


def merged(reports: Iterable[Report]) -> list[ModelResult]:
    """One result per model, the one that says least, with the tests of all of them."""
    results: dict[str, ModelResult] = {}
    for result in (r for report in reports for r in report.results):
        kept = results.setdefault(result.name, result)
        if kept is not result:
            sources = list(dict.fromkeys([*kept.sources, *result.sources]))
            if _WORST_FIRST.index(Verdict(result.verdict)) < _WORST_FIRST.index(Verdict(kept.verdict)):
                results[result.name] = kept = result
            kept.sources = sources
    return sorted(results.values(), key=lambda r: r.name)


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit status."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+", help="the shards' JSON reports")
    parser.add_argument("--report", required=True, help="where to write the merged JSON report (and its .md)")
    parser.add_argument("--baseline", help="the baseline to gate the merged report against")
    parser.add_argument("--strict", action="store_true", help="as --export-strict: fixed models fail the gate too")
    parser.add_argument("--baseline-update", action="store_true", help="write the merged results into --baseline")
    args = parser.parse_args(argv)
    if args.baseline_update and not args.baseline:
        parser.error("--baseline-update needs --baseline")
    try:
        results = merged(Report.load(path) for path in args.reports)
        baseline = Baseline.load(args.baseline) if args.baseline and not args.baseline_update else None
    except BaselineError as e:
        print(f"exportobs merge: error: {e}", file=sys.stderr)
        return 2
    judged = gate(baseline, results, args.strict)
    write_reports(args.report, results, judged, session_env(results))
    if args.baseline_update:
        update_baseline(args.baseline, results, checked=[r.name for r in results])
    counts = f"{len(args.reports)} report{'s' * (len(args.reports) > 1)}, {len(results)} models"
    print(f"exportobs merge: {counts}; {summary_line(judged)}")
    return 1 if judged.failed else 0
