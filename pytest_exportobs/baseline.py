"""The baseline of a suite's export checks, and the gate that judges a session against it.

A baseline is a small JSON file kept under version control: per model the verdict, failing
stage, named dynamic dims, relations, max |Δ| with its tolerance, ONNX opset and op counts.
Pure Python: importing this module costs nothing.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .results import FAILED, INCOMPLETE, PASSED, SKIPPED, STAGES, ModelResult

SCHEMA_VERSION = 1
VERDICTS = (FAILED, INCOMPLETE, PASSED, SKIPPED)
# Gate outcomes besides passed / failed / skipped.
XFAILED, XPASSED, MISSING = "xfailed", "xpassed", "missing"
UPDATE_HINT = "run with --export-baseline-update to record"
# A failure at one of these stages leaves the dynamic dims unknown.
_STAGES_BEFORE_DIMS = STAGES[: STAGES.index("infer") + 1]
# Outcomes counted in an ok summary line besides passed; {s} is the plural mark.
_COUNTED = {XFAILED: "known failure{s}", XPASSED: "fixed", SKIPPED: "skipped", MISSING: "missing"}


class BaselineError(ValueError):
    """A baseline file that cannot be used; the message names the file and the problem."""


def _is(*types: type) -> Callable[[Any], bool]:
    """A check accepting instances of ``types``, never a bool (JSON true is no number)."""
    return lambda value: isinstance(value, types) and not isinstance(value, bool)


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or check(value)


def _dict_of(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, dict) and all(map(check, value.values()))


def _list_of(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, list) and all(map(check, value))


# BaselineEntry field -> (validity check, what a valid value is).
_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "verdict": (lambda v: _is(str)(v) and v in VERDICTS, f"one of {', '.join(VERDICTS)}"),
    "stage": (_is(str), "a string"),
    "dims": (_dict_of(_dict_of(_is(str))), "an object of {axis: dim name} objects"),
    "relations": (_list_of(_is(str)), "a list of strings"),
    "max_abs": (_optional(_is(int, float)), "a number or null"),
    "atol": (_optional(_is(int, float)), "a number or null"),
    "rtol": (_optional(_is(int, float)), "a number or null"),
    "opset": (_optional(_is(int)), "an integer or null"),
    "op_counts": (_dict_of(_is(int)), "an object of integers"),
}


def _require(value: Any, check: Callable[[Any], bool], where: str, expected: str) -> None:
    if not check(value):
        raise BaselineError(f"{where} must be {expected}, got {json.dumps(value)[:60]}")


def _failing(verdict: str) -> bool:
    """An incomplete check counts as a failure for the gate."""
    return verdict in (FAILED, INCOMPLETE)


@dataclass
class BaselineEntry:
    """What the baseline remembers of one model."""

    verdict: str
    stage: str = ""
    dims: dict[str, dict[str, str]] = field(default_factory=dict)
    relations: list[str] = field(default_factory=list)
    max_abs: float | None = None
    atol: float | None = None
    rtol: float | None = None
    opset: int | None = None
    op_counts: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_result(cls, result: ModelResult) -> BaselineEntry:
        values = {f.name: copy.deepcopy(getattr(result, f.name)) for f in dataclasses.fields(cls)}
        if result.passed:
            values["stage"] = ""
        return cls(**values)

    @classmethod
    def from_json(cls, name: str, data: Any) -> BaselineEntry:
        """Validate one ``models`` item; raises BaselineError naming the model and field."""
        where = f"model {name!r}"
        _require(data, _is(dict), where, "an object")
        if "verdict" not in data:
            raise BaselineError(f"{where} has no verdict")
        for key, (check, expected) in _CHECKS.items():
            if key in data:
                _require(data[key], check, f"{where}: {key}", expected)
        return cls(**{key: data[key] for key in _CHECKS if key in data})


@dataclass
class Baseline:
    """Per-model entries plus the environment they were recorded in (display only)."""

    models: dict[str, BaselineEntry] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_results(cls, results: Iterable[ModelResult]) -> Baseline:
        results = list(results)
        return cls(
            models={r.name: BaselineEntry.from_result(r) for r in results},
            env={key: value for r in results for key, value in r.env.items()},
        )

    @classmethod
    def from_json(cls, data: Any) -> Baseline:
        """Validate a decoded baseline; raises BaselineError describing the first problem."""
        _require(data, _is(dict), "the top level", "an object")
        if "schema_version" not in data:
            raise BaselineError("no schema_version (not an exportobs baseline?)")
        version = data["schema_version"]
        if not _is(int)(version) or version != SCHEMA_VERSION:
            expected = f"expected {SCHEMA_VERSION}"
            raise BaselineError(f"schema_version {json.dumps(version)} is not supported ({expected})")
        _require(data.get("models"), _is(dict), "models", "an object")
        env = data.get("env", {})
        _require(env, _dict_of(_is(str)), "env", "an object of strings")
        models = {name: BaselineEntry.from_json(name, item) for name, item in data["models"].items()}
        return cls(models, dict(env))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Baseline:
        """Read a baseline; any problem (missing, unreadable, invalid) raises BaselineError."""
        path = Path(path)
        try:
            return cls.from_json(json.loads(path.read_text(encoding="utf-8")))
        except OSError as exc:
            raise BaselineError(f"{path}: cannot be read ({exc.strerror})") from None
        except UnicodeDecodeError:
            raise BaselineError(f"{path}: not UTF-8 text") from None
        except json.JSONDecodeError as exc:
            where = f"line {exc.lineno}, column {exc.colno}"
            raise BaselineError(f"{path}: not valid JSON ({exc.msg} at {where})") from None
        except BaselineError as exc:
            raise BaselineError(f"{path}: {exc}") from None

    @classmethod
    def load_optional(cls, path: str | os.PathLike[str]) -> Baseline | None:
        """Like :meth:`load`, but ``None`` when the file does not exist yet (first run)."""
        return cls.load(path) if Path(path).exists() else None

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "env": dict(self.env),
            "models": {name: dataclasses.asdict(entry) for name, entry in self.models.items()},
        }

    def write(self, path: str | os.PathLike[str]) -> Path:
        return write_atomic(path, json_text(self.to_json()))


def json_text(data: Any) -> str:
    """Stable JSON: sorted keys, indent 2, trailing newline (small diffs in code review)."""
    return json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def write_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` through a temporary file in the same directory and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "x", encoding="utf-8", newline="\n") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


@dataclass
class GateEntry:
    """The gate's outcome for one model: passed, failed, xfailed, xpassed, skipped or missing."""

    name: str
    outcome: str
    message: str = ""
    regression: bool = False
    notes: list[str] = field(default_factory=list)


@dataclass
class Gate:
    """One entry per model (sorted by name); ``failed`` is True when the gate fails the run."""

    entries: list[GateEntry]
    has_baseline: bool = False

    @property
    def failed(self) -> bool:
        return any(e.outcome == FAILED for e in self.entries)

    def to_json(self) -> dict[str, Any]:
        entries = [dataclasses.asdict(e) for e in self.entries]
        return {"failed": self.failed, "summary": self.summary_line(), "entries": entries}

    def summary_line(self) -> str:
        """``exportobs gate: ok (3 passed, 1 known failure, 0 regressions)`` or what failed."""
        if self.failed:
            regressions = [e for e in self.entries if e.regression]
            failures = [e for e in self.entries if e.outcome == FAILED and not e.regression]
            parts = [_listed(regressions, "regression{s}"), _listed(failures, "failure{s}")]
            line = ", ".join(part for part in parts if part)
        else:
            line = f"ok ({self._counts()})"
        fixed = [e.name for e in self.entries if e.outcome == XPASSED]
        if fixed:
            line += f"; fixed: {', '.join(fixed)} — {UPDATE_HINT} {'it' if len(fixed) == 1 else 'them'}"
        return f"exportobs gate: {line}"

    def _counts(self) -> str:
        count = Counter(e.outcome for e in self.entries)
        parts = [f"{count[PASSED]} passed"]
        parts += [_count(count[outcome], label) for outcome, label in _COUNTED.items() if count[outcome]]
        parts.append("0 regressions" if self.has_baseline else "no baseline")
        return ", ".join(parts)


def _count(n: int, label: str) -> str:
    """``_count(2, "regression{s}") == "2 regressions"``."""
    return f"{n} {label.format(s='' if n == 1 else 's')}"


def _listed(entries: list[GateEntry], label: str) -> str:
    if not entries:
        return ""
    return f"{_count(len(entries), label)} ({'; '.join(f'{e.name}: {e.message}' for e in entries)})"


def _at(what: str, stage: str) -> str:
    return f"{what} at {stage}" if stage else what


def gate(baseline: Baseline | None, results: list[ModelResult], strict: bool = False) -> Gate:
    """Judge each model's result against its baseline entry (or on its own without a baseline)."""
    old = baseline.models if baseline is not None else {}
    new = {r.name: r for r in results}
    has_baseline = baseline is not None
    entries = [
        _judge(new[name], old.get(name), strict, has_baseline) if name in new else _missing(name, strict)
        for name in sorted(new.keys() | old.keys())
    ]
    return Gate(entries, has_baseline)


def _judge(result: ModelResult, entry: BaselineEntry | None, strict: bool, has_baseline: bool) -> GateEntry:
    name, verdict = result.name, result.verdict
    if entry is not None:
        notes = _notes(entry, result)
    else:
        notes = ["not in the baseline"] if has_baseline else []
    if verdict == SKIPPED:
        return GateEntry(name, SKIPPED, result.reason, notes=notes)
    if result.expected_failure:  # the marker's xfail= decides, like pytest.mark.xfail
        if _failing(verdict):
            return GateEntry(name, XFAILED, f"expected failure: {result.expected_failure}", notes=notes)
        return GateEntry(name, FAILED if strict else XPASSED,
                         f"passes although marked xfail ({result.expected_failure})", notes=notes)
    problems = _regressions(entry, result) if entry is not None else []
    if problems:
        return GateEntry(name, FAILED, "; ".join(problems), regression=True, notes=notes)
    was_failing = entry is not None and _failing(entry.verdict)
    if _failing(verdict) and was_failing:
        return GateEntry(name, XFAILED, _at("known failure", result.stage), notes=notes)
    if _failing(verdict):
        return GateEntry(name, FAILED, _at(verdict, result.stage), notes=notes)
    if not was_failing:
        return GateEntry(name, PASSED, notes=notes)
    fixed = f"fixed: {_at(entry.verdict, entry.stage)} in the baseline, passes now"
    if strict:
        return GateEntry(name, FAILED, f"{fixed} (strict) — {UPDATE_HINT} it", notes=notes)
    return GateEntry(name, XPASSED, fixed, notes=notes)


def _missing(name: str, strict: bool) -> GateEntry:
    message = "in the baseline but not observed"
    return GateEntry(name, FAILED, f"{message} (strict)") if strict else GateEntry(name, MISSING, message)


def _regressions(entry: BaselineEntry, result: ModelResult) -> list[str]:
    """A passing model now failing; dims dynamic in the baseline now static (when dims are known)."""
    problems = []
    if entry.verdict == PASSED and _failing(result.verdict):
        problems.append(f"passed→{_at(result.verdict, result.stage)}")
    if result.passed or (result.verdict == FAILED and result.stage not in _STAGES_BEFORE_DIMS):
        problems += [
            f"dim {input_name}.{axis} ({dim}) became static"
            for input_name, axes in entry.dims.items()
            for axis, dim in axes.items()
            if axis not in result.dims.get(input_name, {})
        ]
    return problems


def _notes(entry: BaselineEntry, result: ModelResult) -> list[str]:
    """Changes worth a look that do not fail the gate."""
    notes = []
    if _failing(entry.verdict) and _failing(result.verdict) and entry.stage != result.stage:
        notes.append(f"failing stage moved: {entry.stage or '?'} → {result.stage or '?'}")
    if result.passed and entry.max_abs is not None and result.max_abs is not None:
        old, new = f"{entry.max_abs:.2g}", f"{result.max_abs:.2g}"
        if result.max_abs > entry.max_abs and old != new:
            notes.append(f"max|Δ| grew {old} → {new}, within tolerance")
    return notes
