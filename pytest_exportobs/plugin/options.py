"""Command-line options and ini keys of the plugin, read into one dataclass."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from ..engine.settings import DIM_MODES, TARGETS, CheckSettings


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
    check: CheckSettings
    observe: tuple[str, ...] = ()  # dotted paths of classes whose called instances are observed
    observe_exclude: tuple[str, ...] = ()  # fnmatch patterns of node ids and class names not observed

    @classmethod
    def from_config(cls, config: pytest.Config) -> Options:
        """Read options and ini keys; bad values and combinations raise ``pytest.UsageError``."""
        option = config.option
        enabled = bool(option.export_check) or config.getini("export_check")
        if option.export_baseline_update and not enabled:
            raise pytest.UsageError("--export-baseline-update needs --export-check (or ini export_check = true): "
                                    "without the check there is nothing to record")
        if option.export_baseline_prune and not option.export_baseline_update:
            raise pytest.UsageError("--export-baseline-prune only applies with --export-baseline-update")
        jobs = _jobs(option.export_jobs or config.getini("export_jobs"), config)
        return cls(
            enabled=enabled,
            report=_path(config, option.export_report, "export_report"),
            baseline=_path(config, option.export_baseline, "export_baseline"),
            baseline_update=bool(option.export_baseline_update),
            baseline_prune=bool(option.export_baseline_prune),
            strict=bool(option.export_strict) or config.getini("export_strict"),
            isolate=bool(option.export_isolate) or config.getini("export_isolate"),
            jobs=jobs,
            threads=max(1, _share_of_cores(config) // jobs),
            check=CheckSettings(
                export_dir=_path(config, option.export_dir, "export_dir") or config.rootpath / ".exportobs",
                target=_choice(option.export_target or config.getini("export_target") or "onnx", "export_target", TARGETS),
                atol=_float(config.getini("export_atol"), "export_atol"),
                rtol=_float(config.getini("export_rtol"), "export_rtol"),
                examples=_int(option.export_examples, config.getini("export_examples"), "export_examples"),
                patches=tuple(config.getini("export_patches")),
                hypothesis_seed=_hypothesis_seed(config),
                dims=_choice(config.getini("export_dims") or "roles", "export_dims", DIM_MODES),
                timeout=_timeout(option.export_timeout or config.getini("export_timeout")),
            ),
            observe=_lines(option.export_observe or config.getini("export_observe")),
            observe_exclude=_lines(config.getini("export_observe_exclude")),
        )


def add_options(parser: pytest.Parser) -> None:
    """Register the ``exportobs`` option group and its ini keys."""
    group = parser.getgroup("exportobs", "export-readiness checks of observed PyTorch models")
    group.addoption("--export-check", action="store_true", default=None,
                    help="observe the models named by observe_export / export_observer and check "
                         "their export to ONNX at the end of the session (ini: export_check)")
    group.addoption("--export-dir", metavar="DIR", default=None,
                    help="artifacts: ONNX files, repro scripts, export cache (default: .exportobs under rootdir)")
    group.addoption("--export-report", metavar="PATH", default=None,
                    help="write a JSON report there, and a Markdown one beside it (.md)")
    group.addoption("--export-baseline", metavar="PATH", default=None,
                    help="baseline to gate against: a model that passed there and fails now fails the run")
    group.addoption("--export-baseline-update", action="store_true", default=False,
                    help="write this session's results into the baseline (entries of models not "
                         "checked in this session are kept)")
    group.addoption("--export-baseline-prune", action="store_true", default=False,
                    help="with --export-baseline-update: remove the entries of models not checked in this session")
    group.addoption("--export-examples", metavar="N", type=int, default=None,
                    help="hypothesis shape variations per model (default 10, 0 = off)")
    group.addoption("--export-target", choices=TARGETS, default=None,
                    help="stop after torch.export (torch, fast) or go to ONNX + onnxruntime (onnx, default)")
    group.addoption("--export-strict", action="store_true", default=None,
                    help="a fixed known failure or a baseline entry with no model fails the gate")
    group.addoption("--export-isolate", action="store_true", default=None,
                    help="export and run each model in a subprocess (a native crash fails one model)")
    group.addoption("--export-jobs", metavar="N", default=None,
                    help="check N models at once, each in a forked process; auto = the usable cores "
                         "(shared among xdist workers) (ini: export_jobs; default: 1)")
    group.addoption("--export-timeout", metavar="SECONDS", default=None,
                    help="time limit of each model's check: beyond it the model fails with kind "
                         "timeout (ini: export_timeout; default: none)")
    group.addoption("--export-observe", metavar="CLASS", action="append", default=None,
                    help="observe every instance of this torch.nn.Module class (dotted path; subclasses "
                         "included) that a test calls, outermost calls only; repeatable (ini: export_observe)")
    parser.addini("export_check", "observe and check exports (like --export-check)", type="bool", default=False)
    parser.addini("export_dir", "artifacts directory (like --export-dir)", default="")
    parser.addini("export_report", "JSON report path (like --export-report)", default="")
    parser.addini("export_baseline", "baseline path (like --export-baseline)", default="")
    parser.addini("export_examples", "shape variations per model (like --export-examples)", default="10")
    parser.addini("export_target", "onnx or torch (like --export-target)", default="onnx")
    parser.addini("export_strict", "strict gate (like --export-strict)", type="bool", default=False)
    parser.addini("export_isolate", "one subprocess per model (like --export-isolate)", type="bool", default=False)
    parser.addini("export_jobs", "models checked at once (like --export-jobs)", default="1")
    parser.addini("export_timeout", "time limit of each model's check in seconds (like --export-timeout)", default="")
    parser.addini("export_atol", "absolute tolerance for every model (default: per dtype)", default="")
    parser.addini("export_rtol", "relative tolerance for every model (default: per dtype)", default="")
    parser.addini("export_dims", "roles (default): batch, sequence, cache and encoder lengths are dynamic even "
                  "when the tests never vary them; observed: only the dims the tests vary", default="roles")
    parser.addini("export_patches", "dotted paths to context-manager factories entered around export "
                  "and verification", type="linelist", default=[])
    parser.addini("export_observe", "dotted paths of torch.nn.Module classes whose called instances are "
                  "observed, one per line (like --export-observe)", type="linelist", default=[])
    parser.addini("export_observe_exclude", "fnmatch patterns, one per line: tests (node ids) and model "
                  "classes (module.qualname) export_observe leaves alone", type="linelist", default=[])


def _path(config: pytest.Config, cli: str | None, ini_key: str) -> Path | None:
    if cli:
        return Path(config.invocation_params.dir, cli)
    value = config.getini(ini_key)
    if not value:
        return None
    base = config.inipath.parent if config.inipath else config.rootpath
    return Path(base, value)


def _lines(values: list[str]) -> tuple[str, ...]:
    return tuple(v.strip() for v in values if v.strip())


def _int(cli: int | None, ini: str, name: str) -> int:
    value = cli if cli is not None else ini
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


def _hypothesis_seed(config: pytest.Config) -> int | None:
    seed = getattr(config.option, "hypothesis_seed", None)
    return int(seed) if seed is not None else None
