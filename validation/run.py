"""Run transformers' own model tests with every model observed, and read the verdicts as a user would.

For each architecture: ``tests/models/<arch>/test_modeling_<arch>.py`` once without the plugin and
once with ``--export-check --export-observe transformers.PreTrainedModel``; every ordinary test's
outcome is compared between the two runs, and the plugin's JSON report becomes a compatibility
table per model class.  See validation/README.md for getting the sources and the environment.

    python validation/run.py --python /path/to/venv/bin/python --tests /path/to/tree --arch bert llama
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

OBSERVE = ("--export-check", "--export-observe", "transformers.PreTrainedModel")


@dataclass
class Run:
    """One pytest run of an architecture's tests: outcomes by node id, exit code, wall time."""

    outcomes: dict[str, str]
    exit_code: int
    seconds: float
    internal_errors: int


@dataclass
class Group:
    """One model group of the plugin's report, as the table shows it."""

    name: str
    model_class: str
    verdict: str
    stage: str
    kind: str
    reason: str
    graphs: int
    observations: int
    seconds: float


@dataclass
class Architecture:
    """Everything measured for one architecture."""

    arch: str
    tests: int
    changed: dict[str, list[str]]
    internal_errors: int
    seconds_without: float
    seconds_with: float
    groups: list[Group] = field(default_factory=list)


def assemble(mirror: Path, tag: str, tree: Path, python: str) -> None:
    """The test tree of ``tag``: ``tests/``, ``utils/`` (test modules import from it) and the
    top-level conftest, with ``src/transformers`` pointing at the installed package (a few tests
    read its sources)."""
    tree.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", f"--git-dir={mirror}", "archive", tag, "tests", "utils", "conftest.py"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "x", "-C", str(tree)], input=archive, check=True)
    package = subprocess.run([python, "-c", "import transformers, os; print(os.path.dirname(transformers.__file__))"],
                             check=True, capture_output=True, text=True).stdout.strip()
    link = tree / "src" / "transformers"
    link.parent.mkdir(exist_ok=True)
    if not link.exists():
        link.symlink_to(package)


def run_tests(python: str, tree: Path, arch: str, out: Path, plugin: bool, extra: list[str]) -> Run:
    """pytest on one architecture's modeling tests; junitxml and log into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    tag = "with" if plugin else "without"
    junit = out / f"junit-{tag}.xml"
    options = [*OBSERVE, f"--export-report={out / 'report.json'}", f"--export-dir={out / 'artifacts'}"] if plugin else [
        "-p", "no:exportobs"]
    command = [python, "-m", "pytest", f"tests/models/{arch}/test_modeling_{arch}.py", "-p", "no:cacheprovider", "-q",
               f"--junitxml={junit}", *options, *extra]
    begin = time.perf_counter()
    completed = subprocess.run(command, cwd=tree, capture_output=True, text=True, env=_environment())
    seconds = time.perf_counter() - begin
    (out / f"log-{tag}.txt").write_text(completed.stdout + completed.stderr)
    outcomes = read_junit(junit) if junit.exists() else {}
    return Run(outcomes, completed.returncode, seconds, completed.stdout.count("INTERNALERROR"))


def _environment() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def read_junit(path: Path) -> dict[str, str]:
    """``classname::name`` -> passed, failure, error or skipped, the plugin's own entries left out."""
    outcomes = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if name.startswith("exportobs::"):
            continue
        tags = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes[name] = tags[0] if tags else "passed"
    return outcomes


def read_groups(report: Path) -> list[Group]:
    """The model groups of the plugin's JSON report."""
    if not report.exists():
        return []
    models = json.loads(report.read_text())["models"]
    return [
        Group(m["name"], m["model_class"].rsplit(".", 1)[-1], m["verdict"], m.get("stage", ""), m.get("kind", ""),
              m.get("reason", ""), len(m.get("graphs", [])), m.get("n_observations", 0),
              sum(m.get("timings", {}).values()))
        for m in (models.values() if isinstance(models, dict) else models)
    ]


def compare(without: Run, with_plugin: Run) -> dict[str, list[str]]:
    """Node ids whose outcome differs: ``{node id: [without, with]}``."""
    names = without.outcomes.keys() | with_plugin.outcomes.keys()
    return {n: [without.outcomes.get(n, "absent"), with_plugin.outcomes.get(n, "absent")] for n in sorted(names)
            if without.outcomes.get(n) != with_plugin.outcomes.get(n)}


def table(result: Architecture) -> str:
    """Markdown: the ordinary tests, then one row per model class (its main group: most calls)."""
    lines = [f"## {result.arch}", "",
             f"{result.tests} ordinary tests, {len(result.changed)} outcomes changed by the plugin, "
             f"{result.internal_errors} INTERNALERROR; {result.seconds_without:.0f} s without the plugin, "
             f"{result.seconds_with:.0f} s with it (observation and checks).", ""]
    lines += [f"- changed: `{name}` {before} → {after}" for name, (before, after) in result.changed.items()]
    lines += ["", "| model class | groups | passed / failed / skipped | main group | graphs | verdict "
                  "| stage / kind | check time |",
              "|---|---|---|---|---|---|---|---|"]
    by_class: dict[str, list[Group]] = defaultdict(list)
    for group in result.groups:
        by_class[group.model_class].append(group)
    for cls, groups in sorted(by_class.items()):
        main = max(groups, key=lambda g: g.observations)
        counts = "/".join(str(sum(g.verdict == v for g in groups)) for v in ("passed", "failed", "skipped"))
        where = f"{main.stage} / {main.kind}" if main.verdict != "passed" else "-"
        lines.append(f"| {cls} | {len(groups)} | {counts} | {main.observations} calls | {main.graphs} | {main.verdict} "
                     f"| {where} | {sum(g.seconds for g in groups):.0f} s |")
    failing = [g for g in result.groups if g.verdict == "failed"]
    if failing:
        lines += ["", "Failures:", ""] + [f"- `{g.name}` ({g.stage}, {g.kind}): {g.reason[:300]}" for g in failing]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", nargs="+", required=True, help="directories of tests/models (bert, llama, ...)")
    parser.add_argument("--python", default=sys.executable, help="interpreter of the environment to test in")
    parser.add_argument("--tests", type=Path, required=True, help="the test tree (made by --mirror/--tag)")
    parser.add_argument("--mirror", type=Path, help="a git directory of the transformers repository")
    parser.add_argument("--tag", default="v5.15.0",
                        help="the release whose tests to take (match the installed version)")
    parser.add_argument("--workdir", type=Path, default=Path("validation-results"))
    parser.add_argument("--skip-baseline", action="store_true", help="reuse the runs without the plugin")
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to pytest (-k, --timeout ...)")
    args = parser.parse_args(argv)
    if args.mirror is not None:
        assemble(args.mirror, args.tag, args.tests, args.python)
    results = [_architecture(args, arch) for arch in args.arch]
    args.workdir.mkdir(parents=True, exist_ok=True)
    for result in results:
        (args.workdir / f"{result.arch}.md").write_text(table(result))
    (args.workdir / "summary.md").write_text("\n".join(table(r) for r in results))
    (args.workdir / "summary.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
    print((args.workdir / "summary.md").read_text())
    return 0


def _architecture(args: argparse.Namespace, arch: str) -> Architecture:
    out = args.workdir / arch
    saved = out / "without.json"
    if args.skip_baseline and saved.exists():
        without = Run(**json.loads(saved.read_text()))
    else:
        without = run_tests(args.python, args.tests, arch, out, plugin=False, extra=args.pytest_args)
        saved.write_text(json.dumps(asdict(without)))
    with_plugin = run_tests(args.python, args.tests, arch, out, plugin=True, extra=args.pytest_args)
    return Architecture(arch, len(without.outcomes), compare(without, with_plugin),
                        with_plugin.internal_errors, without.seconds, with_plugin.seconds,
                        read_groups(out / "report.json"))


if __name__ == "__main__":
    sys.exit(main())
