"""Run a real project's own model tests with every model observed, and read the verdicts as a user would.

Three suites, each run once without the plugin, once with ``--export-check --export-observe CLASS``
on a fresh export directory (no conftest, no test edited) and once more on that directory's cache
(``--no-rerun`` leaves it out); every ordinary test's outcome is compared between the runs, the
rerun's verdicts with the first run's, and the plugin's JSON report becomes a compatibility table:

- ``transformers``: ``tests/models/<arch>/test_modeling_<arch>.py`` per architecture, observing
  ``transformers.PreTrainedModel``; one row per model class.
- ``timm``: ``tests/test_models.py`` of timm's sdist for a selection of models (their forward,
  backward and default-config tests), observing ``torch.nn.Module`` (timm models share no base
  class); one row per timm model.
- ``diffusers``: ``tests/models/...`` of diffusers' repository at a release tag, observing
  ``diffusers.ModelMixin``, the tests that load from the Hub deselected; one row per model class.

See validation/README.md for getting the sources and the environments.

    python validation/run.py transformers --python /path/to/venv/bin/python --tests /path/to/tree --arch bert llama
    python validation/run.py timm --python /path/to/venv/bin/python --tests /path/to/timm-1.0.31
    python validation/run.py diffusers --python /path/to/venv/bin/python --tests /path/to/diffusers-tree
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

# timm's tests of one model that call it: forward (eval, batch 1), backward (training, batch 2,
# 42 classes), and the default-config tests (on the meta device on torch >= 2.3)
TIMM_TESTS = ("test_model_forward", "test_model_backward", "test_model_default_cfgs",
              "test_model_default_cfgs_non_std")
# Small models of the families a user of timm meets, one or two each (see validation/README.md)
TIMM_MODELS = (
    "resnet10t", "test_resnet", "efficientnet_b0", "mobilenetv3_small_050", "convnext_atto", "test_vit",
    "deit_tiny_distilled_patch16_224", "swin_tiny_patch4_window7_224", "mobilevit_xxs", "test_coatnet",
    "test_maxvit", "levit_128s", "regnetx_002", "test_nfnet", "mambaout_femto", "efficientvit_b0",
    "efficientvit_m0", "tiny_vit_5m_224", "xcit_nano_12_p16_224", "test_vit_relpos", "pvt_v2_b0",
)
# diffusers' model tests of the library's main model families (see validation/README.md)
DIFFUSERS_FILES = (
    "unets/test_models_unet_2d_condition.py", "unets/test_models_unet_2d.py", "unets/test_models_unet_1d.py",
    "autoencoders/test_models_autoencoder_kl.py", "autoencoders/test_models_vq.py",
    "autoencoders/test_models_autoencoder_tiny.py", "transformers/test_models_transformer_sd3.py",
    "transformers/test_models_transformer_flux.py", "unets/test_models_unet_controlnetxs.py",
)
OFFLINE = "not hub and not output_pretrained and not loss_pretrained"  # the tests that load weights from the Hub


@dataclass
class Run:
    """One pytest run: outcomes by node id, exit code, wall time, peak memory (KiB: the largest
    resident size of its processes)."""

    outcomes: dict[str, str]
    exit_code: int
    seconds: float
    internal_errors: int
    max_rss_kib: int = 0


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
    sources: list[str] = field(default_factory=list)
    target: str = "onnx"

    def labelled(self, row: str) -> str:
        """The table row a group of ``row`` counts in: ``row`` for ONNX, ``row[executorch]``."""
        return row if self.target in ("onnx", "torch") else f"{row}[{self.target}]"


@dataclass
class Unit:
    """What one pair of runs covers: an architecture's test file, or timm's selected tests."""

    name: str
    cwd: Path
    tests: list[str]  # paths or node ids
    observe: str  # the class given to --export-observe
    row: Callable[[Group], str]  # the table row a group counts in
    main_tests: tuple[str, ...] = ()  # tests whose groups are a row's main ones (default: most calls)


@dataclass
class Measured:
    """Everything measured for one unit."""

    name: str
    tests: int
    changed: dict[str, list[str]]
    internal_errors: int
    seconds_without: float
    seconds_with: float
    max_rss_without_kib: int = 0
    max_rss_with_kib: int = 0
    seconds_rerun: float = 0.0  # 0: not rerun
    max_rss_rerun_kib: int = 0
    rerun_changed: dict[str, list[str]] = field(default_factory=dict)  # test or group -> [first, rerun]
    groups: list[Group] = field(default_factory=list)
    rows: dict[str, list[str]] = field(default_factory=dict)  # row -> group names
    mains: dict[str, dict[str, str]] = field(default_factory=dict)  # row -> {label: main group name}


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


def run_tests(python: str, unit: Unit, out: Path, tag: str, extra: list[str]) -> Run:
    """pytest on one unit's tests: ``without`` the plugin, ``with`` it or a ``rerun`` on the first
    run's export directory; junitxml, log and the plugin's report into ``out``, named by ``tag``."""
    out.mkdir(parents=True, exist_ok=True)
    junit = out / f"junit-{tag}.xml"
    options = ["--export-check", "--export-observe", unit.observe, f"--export-report={out / _REPORTS[tag]}",
               f"--export-dir={out / 'artifacts'}"] if tag in _REPORTS else ["-p", "no:exportobs"]
    listed = out / "tests.txt"  # node ids can be too many for a command line
    listed.write_text("\n".join(unit.tests) + "\n")
    command = [python, "-m", "pytest", f"@{listed}", "-p", "no:cacheprovider", "-q", f"--junitxml={junit}",
               *options, *extra]
    log = out / f"log-{tag}.txt"
    begin = time.perf_counter()
    with log.open("w") as output:
        process = subprocess.Popen(command, cwd=unit.cwd, stdout=output, stderr=subprocess.STDOUT,
                                   env=_environment())
        _, status, usage = os.wait4(process.pid, 0)  # the usage of its whole tree of processes
        process.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - begin
    outcomes = read_junit(junit) if junit.exists() else {}
    return Run(outcomes, process.returncode, seconds, log.read_text().count("INTERNALERROR"),
               usage.ru_maxrss)


_REPORTS = {"with": "report.json", "rerun": "report-rerun.json"}  # the plugin's report of each run with it


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
        Group(m["name"], m["model_class"].rsplit(".", 1)[-1], m["verdict"], m.get("stage", ""), m.get("kind") or "",
              m.get("reason", ""), len(m.get("graphs", [])), m.get("n_observations", 0),
              sum(m.get("timings", {}).values()), m.get("sources", []), m.get("target", "onnx"))
        for m in (models.values() if isinstance(models, dict) else models)
    ]


def compare(before: dict[str, str], after: dict[str, str]) -> dict[str, list[str]]:
    """Names whose outcome or verdict differs: ``{name: [before, after]}``."""
    return {n: [before.get(n, "absent"), after.get(n, "absent")] for n in sorted(before.keys() | after.keys())
            if before.get(n) != after.get(n)}


def table(result: Measured) -> str:
    """Markdown: the ordinary tests, then one row per model class or timm model with its main
    groups (the group with most calls, or those of the unit's main tests)."""
    slower = result.seconds_with / result.seconds_without if result.seconds_without else float("nan")
    memory = (f"; peak RSS {result.max_rss_without_kib / 2**20:.2f} GB without, "
              f"{result.max_rss_with_kib / 2**20:.2f} GB with" if result.max_rss_with_kib else "")
    rerun = (f" A rerun on its export cache: {result.seconds_rerun:.0f} s "
             f"({result.seconds_rerun / result.seconds_without:.1f}x), "
             f"peak RSS {result.max_rss_rerun_kib / 2**20:.2f} GB, "
             f"{len(result.rerun_changed)} outcomes or verdicts unlike the first run's."
             if result.seconds_rerun and result.seconds_without else "")
    lines = [f"## {result.name}", "",
             f"{result.tests} ordinary tests, {len(result.changed)} outcomes changed by the plugin, "
             f"{result.internal_errors} INTERNALERROR; {result.seconds_without:.0f} s without the plugin, "
             f"{result.seconds_with:.0f} s with it ({slower:.1f}x){memory}.{rerun}", ""]
    lines += [f"- changed: `{name}` {before} → {after}" for name, (before, after) in result.changed.items()]
    lines += [f"- on the rerun: `{name}` {first} → {again}" for name, (first, again) in result.rerun_changed.items()]
    lines += ["", "| model | groups | passed / failed / skipped | main groups | not passed: stage / kind "
                  "| check time |", "|---|---|---|---|---|---|"]
    by_name = {g.name: g for g in result.groups}
    for row, names in sorted(result.rows.items()):
        groups = [by_name[n] for n in names]
        mains = {label: by_name[name] for label, name in result.mains.get(row, {}).items()}
        counts = "/".join(str(sum(g.verdict == v for g in groups)) for v in ("passed", "failed", "skipped"))
        shown = ", ".join(f"{label} {g.verdict} ({g.observations} calls, {g.graphs} graphs)"
                          for label, g in mains.items()) or "-"
        where = "; ".join(f"{g.stage} / {g.kind}" for g in mains.values() if g.verdict != "passed") or "-"
        seconds = sum(g.seconds for g in groups)
        lines.append(f"| {row} | {len(groups)} | {counts} | {shown} | {where} | {seconds:.0f} s |")
    failing = [g for g in result.groups if g.verdict != "passed"]
    if failing:
        lines += ["", "Not passed:", ""] + [f"- `{g.name}` {g.verdict} ({g.stage}, {g.kind}): {g.reason[:300]}"
                                            for g in failing]
    return "\n".join(lines) + "\n"


def load_summary(path: Path) -> list[Measured]:
    """The measurements a run wrote to ``summary.json`` (``validation/results/`` keeps the published ones)."""
    results = []
    for data in json.loads(path.read_text()):
        groups = [Group(**group) for group in data.pop("groups")]
        results.append(Measured(**data, groups=groups))
    return results


def compatibility_page(paths: list[Path]) -> str:
    """The documentation's compatibility page: one table per published measurement."""
    intro = ("# Compatibility: real suites\n\nGenerated from `validation/results/*.json` (what "
             "`python validation/run.py` wrote to `summary.json`; see [the validation guide](validation.md)). "
             "Each section is one project's own model tests, run once without the plugin and once with every "
             "model observed, no test edited; \"with it\" is the run the table's verdicts come from, a first "
             "run on a fresh export directory, then a rerun on its cache where measured.\n")
    return "\n".join([intro, *(table(result) for path in sorted(paths) for result in load_summary(path))])


def main_groups(unit: Unit, groups: list[Group]) -> dict[str, str]:
    """``{label: group name}``: per main test of the unit, the group its calls made (timm:
    ``forward``, ``backward``); else the group with most calls (``main``)."""
    if not unit.main_tests:
        return {"main": max(groups, key=lambda g: g.observations).name} if groups else {}
    found = {}
    for test in unit.main_tests:
        made = [g for g in groups if any(s.split("::")[-1].startswith(f"{test}[") for s in g.sources)]
        if made:
            found[test.removeprefix("test_model_")] = max(made, key=lambda g: g.observations).name
    return found


_PLUGIN_FLAGS = {"--export-check", "--export-strict", "--export-isolate", "--export-baseline-update",
                 "--export-baseline-prune"}  # the plugin's options that take no value


def _plain(pytest_args: list[str]) -> list[str]:
    """The arguments of the run without the plugin: the plugin's own options left out
    (``--export-target executorch``, ``--export-target=executorch``)."""
    kept, skip = [], False
    for arg in pytest_args:
        if skip:
            skip = False
        elif arg.startswith("--export-"):
            skip = "=" not in arg and arg not in _PLUGIN_FLAGS
        else:
            kept.append(arg)
    return kept


def measure(args: argparse.Namespace, unit: Unit) -> Measured:
    out = args.workdir / unit.name
    saved = out / "without.json"
    if args.skip_baseline and saved.exists():
        without = Run(**json.loads(saved.read_text()))
    else:
        without = run_tests(args.python, unit, out, "without", _plain(args.pytest_args))
        saved.write_text(json.dumps(asdict(without)))
    shutil.rmtree(out / "artifacts", ignore_errors=True)  # a first run: an empty export directory
    with_plugin = run_tests(args.python, unit, out, "with", args.pytest_args)
    groups = read_groups(out / "report.json")
    rows: dict[str, list[Group]] = defaultdict(list)
    for group in groups:
        rows[unit.row(group)].append(group)
    measured = Measured(unit.name, len(without.outcomes), compare(without.outcomes, with_plugin.outcomes),
                        with_plugin.internal_errors, without.seconds, with_plugin.seconds, without.max_rss_kib,
                        with_plugin.max_rss_kib, groups=groups,
                        rows={row: [g.name for g in members] for row, members in rows.items()},
                        mains={row: main_groups(unit, members) for row, members in rows.items()})
    if args.rerun:
        rerun = run_tests(args.python, unit, out, "rerun", args.pytest_args)
        measured.seconds_rerun, measured.max_rss_rerun_kib = rerun.seconds, rerun.max_rss_kib
        measured.rerun_changed = {**compare(with_plugin.outcomes, rerun.outcomes), **compare(
            _verdicts(groups), _verdicts(read_groups(out / _REPORTS["rerun"])))}
    return measured


def _verdicts(groups: list[Group]) -> dict[str, str]:
    return {f"{g.name} [{g.target}]": g.verdict for g in groups}


def transformers_units(args: argparse.Namespace) -> list[Unit]:
    if args.mirror is not None:
        assemble(args.mirror, args.tag, args.tests, args.python)
    return [Unit(arch, args.tests, [f"tests/models/{arch}/test_modeling_{arch}.py"], "transformers.PreTrainedModel",
                 lambda group: group.labelled(group.model_class)) for arch in args.arch]


def timm_units(args: argparse.Namespace) -> list[Unit]:
    """One unit: the selected models' tests, collected once; a group counts in the row of the
    timm model whose tests called it (the first of its sources)."""
    listed = subprocess.run(
        [args.python, "-m", "pytest", "tests/test_models.py", "--collect-only", "-q", "-p", "no:exportobs",
         "-p", "no:cacheprovider"], cwd=args.tests, capture_output=True, text=True, env=_environment()).stdout
    wanted = set(args.models)
    selected = [node for node in listed.splitlines() if "::" in node and _timm_test(node)[0] in TIMM_TESTS
                and _timm_test(node)[1] & wanted]
    if not selected:
        raise SystemExit(f"no test of {sorted(wanted)} collected in {args.tests}/tests/test_models.py")

    def row(group: Group) -> str:
        found = sorted({name for source in group.sources for name in _timm_test(source)[1] & wanted})
        return group.labelled(found[0] if found else "(other)")

    return [Unit("timm", args.tests, selected, "torch.nn.Module", row, ("test_model_forward", "test_model_backward"))]


def diffusers_units(args: argparse.Namespace) -> list[Unit]:
    """One unit: the selected files of ``tests/models``, the tests that load from the Hub
    deselected unless ``-k`` is given; a group counts in its model class's row."""
    if "-k" not in args.pytest_args:
        args.pytest_args += ["-k", OFFLINE]
    return [Unit("diffusers", args.tests, [f"tests/models/{name}" for name in args.files], "diffusers.ModelMixin",
                 lambda group: group.labelled(group.model_class))]


def _timm_test(node: str) -> tuple[str, set[str]]:
    """``tests/test_models.py::test_model_default_cfgs[1-resnet18.a1_in1k]`` -> the test, its
    parameters (a model's pretrained tag dropped: ``resnet18``)."""
    test = node.split("::")[-1]
    name, _, params = test.partition("[")
    return name, {param.split(".")[0] for param in params.rstrip("]").split("-")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=sys.executable, help="interpreter of the environment to test in")
    parser.add_argument("--workdir", type=Path, default=Path("validation-results"))
    parser.add_argument("--skip-baseline", action="store_true", help="reuse the runs without the plugin")
    parser.add_argument("--no-rerun", dest="rerun", action="store_false",
                        help="leave out the rerun on the first run's export cache")
    suites = parser.add_subparsers(dest="suite", required=True)
    tf = suites.add_parser("transformers", help="transformers' tests/models/<arch>")
    tf.add_argument("--arch", nargs="+", required=True, help="directories of tests/models (bert, llama, ...)")
    tf.add_argument("--tests", type=Path, required=True, help="the test tree (made by --mirror/--tag)")
    tf.add_argument("--mirror", type=Path, help="a git directory of the transformers repository")
    tf.add_argument("--tag", default="v5.15.0", help="the release whose tests to take (match the installed version)")
    timm = suites.add_parser("timm", help="timm's tests/test_models.py for a selection of models")
    timm.add_argument("--tests", type=Path, required=True, help="timm's unpacked sdist (holds tests/)")
    timm.add_argument("--models", nargs="+", default=list(TIMM_MODELS), help="timm model names")
    diffusers = suites.add_parser("diffusers", help="diffusers' tests/models for a selection of files")
    diffusers.add_argument("--tests", type=Path, required=True, help="a tree holding diffusers' tests/ at a tag")
    diffusers.add_argument("--files", nargs="+", default=list(DIFFUSERS_FILES), help="files under tests/models")
    for sub in (tf, timm, diffusers):
        sub.add_argument("pytest_args", nargs="*", help="after --: passed to pytest (-k, --timeout ...)")
    args = parser.parse_args(argv)
    units = {"transformers": transformers_units, "timm": timm_units, "diffusers": diffusers_units}[args.suite](args)
    results = [measure(args, unit) for unit in units]
    args.workdir.mkdir(parents=True, exist_ok=True)
    for result in results:
        (args.workdir / f"{result.name}.md").write_text(table(result))
    (args.workdir / "summary.md").write_text("\n".join(table(r) for r in results))
    (args.workdir / "summary.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
    print((args.workdir / "summary.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
