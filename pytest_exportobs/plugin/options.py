"""Command-line options and ini keys of the plugin, read into one dataclass."""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest

from ..core.vocabulary import Target
from ..engine.base.settings import DIM_MODES, CheckSettings

TARGETS = tuple(target.value for target in Target)
OVERLAP_MODES = ("auto", "off")
EXECUTORCH_EXTRA = "pytest-exportobs[executorch]"


@dataclass(frozen=True)
class Setting:
    """One setting, declared once: the ini key ``key`` and the option ``--export-…`` of the same
    name (``where``: both, or only the command line or only the ini file).  A flag is a bool ini
    key, a list is a repeatable option and one ini line per value; the command line comes first."""

    key: str
    help: str
    where: str = "both"  # "both", "cli" or "ini"
    kind: str = "string"  # "string", "flag" or "list"
    default: str | bool | list[str] = ""
    metavar: str | None = None
    choices: tuple[str, ...] | None = None  # the command line's (ini values are checked on reading)

    @property
    def option(self) -> str:
        return "--" + self.key.replace("_", "-")


SETTINGS = (
    Setting("export_check", "observe the models named by observe_export / export_observer and check their "
            "export to ONNX at the end of the session", kind="flag", default=False),
    Setting("export_dir", "artifacts: ONNX files, repro scripts, export cache (default: .exportobs under rootdir)",
            metavar="DIR"),
    Setting("export_report", "write a JSON report there, and a Markdown one beside it (.md)", metavar="PATH"),
    Setting("export_baseline", "baseline to gate against: a model that passed there and fails now fails the run",
            metavar="PATH"),
    Setting("export_baseline_update", "write this session's results into the baseline (entries of models not "
            "checked in this session are kept)", where="cli", kind="flag"),
    Setting("export_baseline_prune", "with --export-baseline-update: remove the entries of models not checked "
            "in this session", where="cli", kind="flag"),
    Setting("export_examples", "hypothesis shape variations per model (default 10, 0 = off)", default="10",
            metavar="N"),
    Setting("export_target", "where each model goes, comma-separated: onnx (default; ONNX + onnxruntime), "
            "executorch (an ExecuTorch program run by its runtime, with the XNNPACK delegate; needs "
            f"{EXECUTORCH_EXTRA}), torch (stop after torch.export, fast; instead of onnx); e.g. onnx,executorch: "
            "one outcome per model and target", default=Target.ONNX.value, metavar="TARGETS"),
    Setting("export_strict", "a fixed known failure or a baseline entry with no model fails the gate",
            kind="flag", default=False),
    Setting("export_isolate", "export and run each model in a subprocess (a native crash fails one model)",
            kind="flag", default=False),
    Setting("export_jobs", "check N models at once, each in a forked process; auto = the usable cores (shared "
            "among xdist workers) (default: auto)", default="auto", metavar="N"),
    Setting("export_overlap", "auto: while the tests run, check the models whose calls have settled on a core "
            "the tests leave idle (one process at the lowest priority, filling the export cache that the check "
            "at the end reads; without xdist workers and with 2 cores or more); off: check only at the end "
            "(default: auto)", default="auto", choices=OVERLAP_MODES),
    Setting("export_every_graph", "check every graph of a model (one per input structure and constants) past "
            "its first failing one (default: a model's check ends at its first failing graph, whose failure is the "
            "model's verdict)", kind="flag", default=False),
    Setting("export_timeout", "time limit of each model's check in seconds: beyond it the model fails with "
            "kind timeout (default: none)", metavar="SECONDS"),
    Setting("export_observe", "observe every instance of this torch.nn.Module class (dotted path; subclasses "
            "included) that a test calls, outermost calls only; repeatable, one per line in ini", kind="list",
            default=[], metavar="CLASS"),
    Setting("export_observe_exclude", "fnmatch patterns, one per line: tests (node ids) and model classes "
            "(module.qualname) export_observe leaves alone", where="ini", kind="list", default=[]),
    Setting("export_atol", "absolute tolerance for every model (default: per dtype)", where="ini"),
    Setting("export_rtol", "relative tolerance for every model (default: per dtype)", where="ini"),
    Setting("export_dims", "roles (default): batch, sequence, cache and encoder lengths are dynamic even when "
            "the tests never vary them; observed: only the dims the tests vary", where="ini", default="roles"),
    Setting("export_static", "input:axis kept static in every model that takes that input, one per line (an "
            "image's sides the tests never vary: pixel_values:2, pixel_values:3)", where="ini", kind="list",
            default=[]),
    Setting("export_patches", "dotted paths to context-manager factories entered around export and "
            "verification, one per line", where="ini", kind="list", default=[]),
)
_INI_TYPES: dict[str, Literal["string", "bool", "linelist"]] = {"string": "string", "flag": "bool", "list": "linelist"}


def add_options(parser: pytest.Parser) -> None:
    """Register the ``exportobs`` option group and the ini keys of :data:`SETTINGS`."""
    group = parser.getgroup("exportobs", "export-readiness checks of observed PyTorch models")
    for setting in SETTINGS:
        if setting.where != "ini":
            shown = f"{setting.help} (ini: {setting.key})" if setting.where == "both" else setting.help
            if setting.kind == "flag":
                group.addoption(setting.option, action="store_true", default=None, help=shown)
            else:
                group.addoption(setting.option, action="append" if setting.kind == "list" else "store", default=None,
                                metavar=setting.metavar, choices=setting.choices, help=shown)
        if setting.where != "cli":
            parser.addini(setting.key, setting.help, type=_INI_TYPES[setting.kind], default=setting.default)


def read(config: pytest.Config, key: str) -> Any:
    """The value of a setting: the command line's when given, else the ini file's (its default)."""
    setting = next(s for s in SETTINGS if s.key == key)
    given = getattr(config.option, key) if setting.where != "ini" else None
    if given is not None or setting.where == "cli":
        return bool(given) if setting.kind == "flag" else given
    return config.getini(key)


@dataclass(frozen=True)
class Options:
    """What the user asked of the plugin for one session (command line first, then ini): the
    plugin's own switches, and the engine's :class:`CheckSettings`."""

    enabled: bool
    report: Path | None
    baseline: Path | None
    baseline_update: bool
    baseline_prune: bool
    strict: bool
    isolate: bool
    jobs: int
    threads: int  # torch threads of each check: the process's share of the cores, per job
    overlap: bool  # models checked during the tests on an idle core (by a session without xdist workers)
    check: CheckSettings
    observe: tuple[str, ...] = ()  # dotted paths of classes whose called instances are observed
    observe_exclude: tuple[str, ...] = ()  # fnmatch patterns of node ids and class names not observed

    @classmethod
    def from_config(cls, config: pytest.Config) -> Options:
        """Read options and ini keys; bad values and combinations raise ``pytest.UsageError``."""
        enabled = read(config, "export_check")
        if read(config, "export_baseline_update") and not enabled:
            raise pytest.UsageError("--export-baseline-update needs --export-check (or ini export_check = true): "
                                    "without the check there is nothing to record")
        if read(config, "export_baseline_prune") and not read(config, "export_baseline_update"):
            raise pytest.UsageError("--export-baseline-prune only applies with --export-baseline-update")
        jobs = _jobs(read(config, "export_jobs"), config)
        return cls(
            enabled=enabled,
            report=_path(config, "export_report"),
            baseline=_path(config, "export_baseline"),
            baseline_update=read(config, "export_baseline_update"),
            baseline_prune=read(config, "export_baseline_prune"),
            strict=read(config, "export_strict"),
            isolate=read(config, "export_isolate"),
            jobs=jobs,
            threads=max(1, _share_of_cores(config) // jobs),
            overlap=_choice(read(config, "export_overlap"), "export_overlap", OVERLAP_MODES) == "auto"
            and _share_of_cores(config) > 1,
            check=CheckSettings(
                export_dir=_path(config, "export_dir") or config.rootpath / ".exportobs",
                targets=_targets(read(config, "export_target") or Target.ONNX.value),
                atol=_float(read(config, "export_atol"), "export_atol"),
                rtol=_float(read(config, "export_rtol"), "export_rtol"),
                examples=_int(read(config, "export_examples"), "export_examples"),
                patches=_lines(read(config, "export_patches")),
                hypothesis_seed=_hypothesis_seed(config),
                dims=_choice(read(config, "export_dims") or "roles", "export_dims", DIM_MODES),
                static=_axes(read(config, "export_static"), "export_static"),
                timeout=_timeout(read(config, "export_timeout")),
                every_graph=read(config, "export_every_graph"),
            ),
            observe=_lines(read(config, "export_observe")),
            observe_exclude=_lines(read(config, "export_observe_exclude")),
        )


def _path(config: pytest.Config, key: str) -> Path | None:
    """A path given on the command line is relative to the invocation directory, one in the ini
    file to the ini file's directory."""
    given = getattr(config.option, key)
    if given:
        return Path(config.invocation_params.dir, given)
    value = config.getini(key)
    if not value:
        return None
    base = config.inipath.parent if config.inipath else config.rootpath
    return Path(base, value)


def _lines(values: list[str]) -> tuple[str, ...]:
    return tuple(v.strip() for v in values if v.strip())


def _axes(values: list[str], name: str) -> tuple[str, ...]:
    """Axes named ``input:axis`` (``pixel_values:2``), one per line."""
    axes = _lines(values)
    for axis in axes:
        given, _, dim = axis.rpartition(":")
        if not given or not dim.isdigit():
            raise pytest.UsageError(f"{name}: expected input:axis (pixel_values:2), got {axis!r}")
    return axes


def _int(value: str, name: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise pytest.UsageError(f"{name} must be a non-negative integer, got {value!r}") from None
    if number < 0:
        raise pytest.UsageError(f"{name} must be a non-negative integer, got {number}")
    return number


def _float(value: str, name: str) -> float | None:
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        raise pytest.UsageError(f"{name} must be a number, got {value!r}") from None


def _timeout(value: str | None) -> float | None:
    seconds = _float(value or "", "export_timeout")
    if seconds is not None and not 0 < seconds < math.inf:
        raise pytest.UsageError(f"export_timeout must be a positive number of seconds, got {value!r}")
    return seconds


def _share_of_cores(config: pytest.Config) -> int:
    """The usable cores, shared among the xdist workers."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // getattr(config, "workerinput", {}).get("workercount", 1))


def _jobs(value: str, config: pytest.Config) -> int:
    """``auto``: this process's share of the usable cores."""
    if value.strip() == "auto":
        return _share_of_cores(config)
    if not value.strip().isdigit() or int(value) < 1:
        raise pytest.UsageError(f"export_jobs must be a positive integer or auto, got {value!r}")
    return int(value)


def _choice(value: str, name: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise pytest.UsageError(f"{name} must be one of {choices}, got {value!r}")
    return value


def _installed(module: str) -> bool:
    """Whether ``module`` (dotted) can be imported, without importing it (its parents are)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _targets(value: str) -> tuple[Target, ...]:
    """``onnx,executorch``: each target once, in the order of :class:`Target` (ONNX's program
    traced first, lowered for ExecuTorch after); torch replaces onnx, and executorch needs its
    extra installed."""
    names = [name.strip() for name in value.split(",") if name.strip()]
    for name in names:
        _choice(name, "export_target", TARGETS)
    targets = tuple(target for target in Target if target.value in names)
    if not targets:
        raise pytest.UsageError(f"export_target names no target; targets are {', '.join(TARGETS)}")
    if Target.ONNX in targets and Target.TORCH in targets:
        raise pytest.UsageError("export_target: torch stops after torch.export instead of going to ONNX; "
                                "name onnx or torch, not both")
    if Target.EXECUTORCH in targets and not _installed("executorch.exir"):
        raise pytest.UsageError(f"--export-target executorch needs ExecuTorch: pip install '{EXECUTORCH_EXTRA}'")
    return targets


def _hypothesis_seed(config: pytest.Config) -> int | None:
    seed = getattr(config.option, "hypothesis_seed", None)
    return int(seed) if seed is not None else None
