"""The baseline of a suite's export checks: a small JSON file kept under version control.

Per model the verdict, failing stage, named dynamic dims (per graph too, for a model exported as
several graphs), relations, max |Δ| with its tolerance, ONNX opset and op counts.  Pure Python:
importing this module costs nothing.

An update merges a session's results into the file under a lock (:func:`update_baseline`):
entries of models the session did not check are kept unless pruned, and two sessions updating
one file at once both keep their entries.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
from collections.abc import Callable, Iterable, Iterator, Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ..core.files import json_text, write_atomic
from ..core.vocabulary import Verdict
from ..engine.base.result import ModelResult

SCHEMA_VERSION = 1
VERDICTS = (Verdict.FAILED, Verdict.INCOMPLETE, Verdict.PASSED, Verdict.SKIPPED)
T = TypeVar("T")
# field -> (validity check, what a valid value is)
Checks = dict[str, tuple[Callable[[Any], bool], str]]


class BaselineError(ValueError):
    """A baseline (or report) file that cannot be used; the message names the file and the problem."""


def is_a(*types: type) -> Callable[[Any], bool]:
    """A check accepting instances of ``types``, never a bool (JSON true is no number)."""
    return lambda value: isinstance(value, types) and not isinstance(value, bool)


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or check(value)


def dict_of(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, dict) and all(map(check, value.values()))


def list_of(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, list) and all(map(check, value))


# The checks of BaselineEntry's fields.
CHECKS: Checks = {
    "verdict": (lambda v: is_a(str)(v) and v in VERDICTS, f"one of {', '.join(VERDICTS)}"),
    "stage": (is_a(str), "a string"),
    "dims": (dict_of(dict_of(is_a(str))), "an object of {axis: dim name} objects"),
    "relations": (list_of(is_a(str)), "a list of strings"),
    "max_abs": (_optional(is_a(int, float)), "a number or null"),
    "atol": (_optional(is_a(int, float)), "a number or null"),
    "rtol": (_optional(is_a(int, float)), "a number or null"),
    "opset": (_optional(is_a(int)), "an integer or null"),
    "op_counts": (dict_of(is_a(int)), "an object of integers"),
    "tests": (list_of(is_a(str)), "a list of test node ids"),
    "graph_dims": (dict_of(dict_of(dict_of(is_a(str)))), "an object of {graph name: dims} objects"),
}


def require(value: Any, check: Callable[[Any], bool], where: str, expected: str) -> None:
    if not check(value):
        raise BaselineError(f"{where} must be {expected}, got {json.dumps(value)[:60]}")


def validated_model(name: str, data: Any, checks: Checks) -> dict[str, Any]:
    """The fields of ``checks`` found in one model's object, each checked; it must have a verdict."""
    where = f"model {name!r}"
    require(data, is_a(dict), where, "an object")
    if "verdict" not in data:
        raise BaselineError(f"{where} has no verdict")
    for key, (check, expected) in checks.items():
        if key in data:
            require(data[key], check, f"{where}: {key}", expected)
    return {key: data[key] for key in checks if key in data}


def require_version(data: Any, expected: int, what: str) -> None:
    """``data`` is an object whose ``schema_version`` is ``expected``; ``what`` names the file kind."""
    require(data, is_a(dict), "the top level", "an object")
    if "schema_version" not in data:
        raise BaselineError(f"no schema_version (not an exportobs {what}?)")
    version = data["schema_version"]
    if not is_a(int)(version) or version != expected:
        raise BaselineError(f"schema_version {json.dumps(version)} is not supported (expected {expected})")


def load_json(path: str | os.PathLike[str], parse: Callable[[Any], T]) -> T:
    """Read a JSON file and ``parse`` it; any problem raises BaselineError ``<path>: <problem>``."""
    path = Path(path)
    try:
        return parse(json.loads(path.read_text(encoding="utf-8")))
    except OSError as exc:
        raise BaselineError(f"{path}: cannot be read ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise BaselineError(f"{path}: not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno}, column {exc.colno}"
        raise BaselineError(f"{path}: not valid JSON ({exc.msg} at {where})") from None
    except BaselineError as exc:
        raise BaselineError(f"{path}: {exc}") from None


def session_env(results: Iterable[ModelResult]) -> dict[str, str]:
    """The package versions a session's results ran with (one environment per session)."""
    return {key: value for r in results for key, value in r.env.items()}


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
    tests: list[str] = field(default_factory=list)  # the tests that observed it
    graph_dims: dict[str, dict[str, dict[str, str]]] = field(default_factory=dict)  # per graph, if several

    @classmethod
    def from_result(cls, result: ModelResult) -> BaselineEntry:
        own = {f.name for f in dataclasses.fields(cls)} - {"tests", "graph_dims"}
        values = {name: copy.deepcopy(getattr(result, name)) for name in own}
        if result.passed:
            values["stage"] = ""
        graphs = {g.name: copy.deepcopy(g.dims) for g in result.graphs} if len(result.graphs) > 1 else {}
        return cls(**values, tests=sorted(result.sources), graph_dims=graphs)

    def to_json(self) -> dict[str, Any]:
        """The entry's object; ``graph_dims`` only for a model exported as several graphs."""
        data = dataclasses.asdict(self)
        if not self.graph_dims:
            del data["graph_dims"]
        return data

    def collected_in(self, collected: Set[str] | None) -> bool:
        """Whether a session that collected the tests ``collected`` (``None``: unknown) should
        have observed this model: one of its tests is among them, or its tests are not known."""
        return collected is None or not self.tests or not collected.isdisjoint(self.tests)

    @classmethod
    def from_json(cls, name: str, data: Any) -> BaselineEntry:
        """Validate one ``models`` item; raises BaselineError naming the model and field."""
        return cls(**validated_model(name, data, CHECKS))


@dataclass
class Baseline:
    """Per-model entries plus the package versions they were recorded with (a regression names
    those that changed since)."""

    models: dict[str, BaselineEntry] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_results(cls, results: Iterable[ModelResult]) -> Baseline:
        results = list(results)
        return cls(models={r.name: BaselineEntry.from_result(r) for r in results}, env=session_env(results))

    @classmethod
    def from_json(cls, data: Any) -> Baseline:
        """Validate a decoded baseline; raises BaselineError describing the first problem."""
        require_version(data, SCHEMA_VERSION, "baseline")
        require(data.get("models"), is_a(dict), "models", "an object")
        env = data.get("env", {})
        require(env, dict_of(is_a(str)), "env", "an object of strings")
        models = {name: BaselineEntry.from_json(name, item) for name, item in data["models"].items()}
        return cls(models, dict(env))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Baseline:
        """Read a baseline; any problem (missing, unreadable, invalid) raises BaselineError."""
        return load_json(path, cls.from_json)

    def without(self, names: Iterable[str]) -> Baseline:
        """This baseline less the entries of ``names``."""
        names = set(names)
        return Baseline({n: e for n, e in self.models.items() if n not in names}, dict(self.env))

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "env": dict(self.env),
            "models": {name: entry.to_json() for name, entry in self.models.items()},
        }

    def write(self, path: str | os.PathLike[str]) -> Path:
        return write_atomic(path, json_text(self.to_json()))


@dataclass
class BaselineUpdate:
    """What an update did: models whose entries were written, old entries kept or pruned (of
    models the session did not check), and why the old file was ignored (unreadable)."""

    written: list[str]
    kept: list[str]
    pruned: list[str]
    unreadable: str = ""


def update_baseline(
    path: str | os.PathLike[str], results: Iterable[ModelResult], checked: Iterable[str], prune: bool = False
) -> BaselineUpdate:
    """Write ``results`` into the baseline at ``path``, merged with the entries already there.

    The file is re-read under a lock and replaced atomically, so concurrent updates keep each
    other's entries.  Entries of models in ``checked`` without a result to record (their check
    said nothing about the model) stay as they were; entries of models not in ``checked`` are
    kept, or removed with ``prune``.  An unreadable old file is replaced (and said so).
    """
    path, results = Path(path), list(results)
    new = Baseline.from_results(results)
    checked = set(checked) | set(new.models)
    with _locked(path):
        try:
            old, unreadable = (Baseline.load(path), "") if path.exists() else (Baseline(), "")
        except BaselineError as e:
            old, unreadable = Baseline(), str(e)
        unchecked = sorted(set(old.models) - checked)
        kept = old.without(unchecked if prune else ()).models
        Baseline({**kept, **new.models}, {**old.env, **new.env}).write(path)
    return BaselineUpdate(sorted(new.models), [] if prune else unchecked, unchecked if prune else [], unreadable)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``.<name>.lock`` beside ``path`` (where ``fcntl`` exists:
    elsewhere, on Windows, updates are not serialised)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not on Linux/macOS
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f".{path.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
