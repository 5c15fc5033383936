"""The gate: judge a session's results against the baseline, one outcome per model, and name the
package versions that changed since the baseline.  The judge decides; :mod:`.render` writes what
it decided (the terminal's gate line, JSON, Markdown)."""

from __future__ import annotations

import re
from collections.abc import Set
from dataclasses import dataclass, field

from ..core.text import format_dims
from ..core.vocabulary import STAGES_WITH_DIMS, GateOutcome, Verdict
from ..engine.base.result import ModelResult
from .baseline import Baseline, BaselineEntry, session_env

UPDATE_HINT = "run with --export-baseline-update to record"
NOT_IN_BASELINE = "not in the baseline"
ABSENT = "absent"  # the state of a model on the side that does not have it
# package -> (version in the baseline, version now), for the packages whose version changed
Versions = dict[str, tuple[str, str]]


def _failing(verdict: str) -> bool:
    """An incomplete or interrupted check counts as a failure for the gate (never a pass)."""
    return verdict in (Verdict.FAILED, Verdict.INCOMPLETE, Verdict.INTERRUPTED)


def _dims_known(verdict: str, stage: str) -> bool:
    """Whether a check got far enough for its dynamic dims to mean something."""
    return verdict == Verdict.PASSED or (verdict == Verdict.FAILED and stage in STAGES_WITH_DIMS)


def state(verdict: str, stage: str, dims: dict[str, dict[str, str]]) -> str:
    """What the gate compares of a model, in words: ``passed, x{0:batch}``, ``failed at infer``.
    Inputs by name, axes by number: equal dims read the same in whatever order they came (a
    baseline file sorts its keys, a session keeps the signature's order)."""
    text = _at(verdict, stage) if _failing(verdict) else verdict
    if not _dims_known(verdict, stage):
        return text
    ordered = {name: {axis: dims[name][axis] for axis in sorted(dims[name], key=_numeric)} for name in sorted(dims)}
    return f"{text}, {format_dims(ordered)}"


def _numeric(axis: str) -> tuple[int, str]:
    """Sorts axis ``2`` before ``10``."""
    return len(axis), axis


def changed_versions(before: dict[str, str], now: dict[str, str]) -> Versions:
    """The packages known on both sides whose version differs, by name."""
    return {p: (before[p], now[p]) for p in sorted(before.keys() & now.keys()) if before[p] != now[p]}


@dataclass
class Change:
    """A model's state in the baseline and now (see :func:`state`)."""

    name: str
    before: str
    now: str


@dataclass
class GateEntry:
    """The gate's outcome for one model: passed, failed, xfailed, xpassed, skipped or missing."""

    name: str
    outcome: GateOutcome
    message: str = ""
    regression: bool = False
    notes: list[str] = field(default_factory=list)


@dataclass
class Gate:
    """One entry per model (sorted by name); ``failed`` is True when the gate fails the run."""

    entries: list[GateEntry]
    has_baseline: bool = False
    versions: Versions = field(default_factory=dict)
    changes: list[Change] = field(default_factory=list)  # the models whose state differs
    uncollected: list[str] = field(default_factory=list)  # baseline models none of whose tests ran here

    @property
    def failed(self) -> bool:
        return any(e.outcome == GateOutcome.FAILED for e in self.entries)

    @property
    def regressions(self) -> list[GateEntry]:
        return [e for e in self.entries if e.regression]


def _at(what: str, stage: str) -> str:
    return f"{what} at {stage}" if stage else what


def gate(
    baseline: Baseline | None, results: list[ModelResult], strict: bool = False, collected: Set[str] | None = None,
) -> Gate:
    """Judge each model's result against its baseline entry (or on its own without a baseline).
    A baseline model not observed is missing when the session ``collected`` one of its tests (or
    its tests are not known); otherwise its tests ran elsewhere (``-k``, a CI shard) and it is
    left out."""
    old = baseline.models if baseline is not None else {}
    new = {r.name: r for r in results}
    has_baseline = baseline is not None
    versions = changed_versions(baseline.env, session_env(results)) if baseline is not None else {}
    uncollected = sorted(n for n in old.keys() - new.keys() if not old[n].collected_in(collected))
    entries = [
        _judge(new[name], old.get(name), strict, has_baseline, versions) if name in new else _missing(name, strict)
        for name in sorted(new.keys() | old.keys()) if name not in uncollected
    ]
    changes = [c for c in states(old, new) if c.before != c.now and c.name not in uncollected] if has_baseline else []
    return Gate(entries, has_baseline, versions, changes, uncollected)


def _judge(
    result: ModelResult, entry: BaselineEntry | None, strict: bool, has_baseline: bool, versions: Versions
) -> GateEntry:
    name, verdict = result.name, result.verdict
    if entry is not None:
        notes = _notes(entry, result)
    else:
        notes = [NOT_IN_BASELINE] if has_baseline else []
    if verdict == Verdict.SKIPPED:
        return GateEntry(name, GateOutcome.SKIPPED, result.reason, notes=notes)
    if result.expected_failure:  # the marker's xfail= decides, like pytest.mark.xfail
        if _failing(verdict):
            return GateEntry(name, GateOutcome.XFAILED, f"expected failure: {result.expected_failure}", notes=notes)
        return GateEntry(name, GateOutcome.FAILED if strict else GateOutcome.XPASSED,
                         f"passes although marked xfail ({result.expected_failure})", notes=notes)
    problems = _regressions(entry, result, versions) if entry is not None else []
    if problems:
        return GateEntry(name, GateOutcome.FAILED, "; ".join(problems), regression=True, notes=notes)
    was_failing = entry is not None and _failing(entry.verdict)
    if _failing(verdict) and was_failing:
        return GateEntry(name, GateOutcome.XFAILED, _at("known failure", result.stage), notes=notes)
    if _failing(verdict):
        return GateEntry(name, GateOutcome.FAILED, _at(verdict, result.stage), notes=notes)
    if not was_failing:
        return GateEntry(name, GateOutcome.PASSED, notes=notes)
    assert entry is not None  # was failing in the baseline
    fixed = f"fixed: {_at(entry.verdict, entry.stage)} in the baseline, passes now"
    if strict:
        return GateEntry(name, GateOutcome.FAILED, f"{fixed} (strict) — {UPDATE_HINT} it", notes=notes)
    return GateEntry(name, GateOutcome.XPASSED, fixed, notes=notes)


def _missing(name: str, strict: bool) -> GateEntry:
    message = "in the baseline but not observed"
    if strict:
        return GateEntry(name, GateOutcome.FAILED, f"{message} (strict)")
    return GateEntry(name, GateOutcome.MISSING, message)


def _regressions(entry: BaselineEntry, result: ModelResult, versions: Versions) -> list[str]:
    """A passing model now failing; dims dynamic in the baseline now static (when dims are known),
    compared under the names the inputs have now (see :func:`renamed_inputs`).  The first
    problem names the versions that changed since the baseline."""
    problems = []
    if entry.verdict == Verdict.PASSED and _failing(result.verdict):
        problems.append(f"passed→{_at(result.verdict, result.stage)}{_since(versions, 'passed', 'fails')}")
    if _dims_known(result.verdict, result.stage):
        renames = _renames(entry, result)
        now = {g.name: g.dims for g in result.graphs}
        lost = _lost_dims(_renamed(entry.dims, renames), result.dims, "") + [
            problem for name, dims in entry.graph_dims.items() if (graph := _renamed_graph(name, renames)) in now
            for problem in _lost_dims(_renamed(dims, renames), now[graph], f"[{graph}] ")]
        if lost and not problems:
            lost[0] += _since(versions, "dynamic", "static")
        problems += lost
    return problems


def renamed_inputs(before: dict[str, dict[str, str]], now: dict[str, dict[str, str]]) -> dict[str, str]:
    """``{old name: new name}`` of the top-level inputs renamed between the baseline's dims and
    today's (transformers 5.24's ``past_key_values`` → ``cache``): an old name absent now, whose
    leaves (``key_0``, ``value_0``…) a new name absent from the baseline holds, the only one."""
    old_inputs, new_inputs = _by_input(before), _by_input(now)
    gone, came = old_inputs.keys() - new_inputs.keys(), new_inputs.keys() - old_inputs.keys()
    renames: dict[str, str] = {}
    for old in sorted(gone):
        candidates = [new for new in sorted(came) if new_inputs[new].keys() <= old_inputs[old].keys()
                      and new not in renames.values()]
        exact = [new for new in candidates if new_inputs[new] == old_inputs[old]]
        if len(candidates) == 1 or len(exact) == 1:
            renames[old] = (exact or candidates)[0]
    return renames


def _renames(entry: BaselineEntry, result: ModelResult) -> dict[str, str]:
    """:func:`renamed_inputs` over every dim of the model and of its graphs."""
    before = {name: axes for dims in (entry.dims, *entry.graph_dims.values()) for name, axes in dims.items()}
    now = {name: axes for dims in (result.dims, *(g.dims for g in result.graphs)) for name, axes in dims.items()}
    return renamed_inputs(before, now)


def _by_input(dims: dict[str, dict[str, str]]) -> dict[str, dict[str, dict[str, str]]]:
    """``{top-level input: {leaf path under it: axes}}`` (``past_key_values.key_0`` → ``key_0``)."""
    found: dict[str, dict[str, dict[str, str]]] = {}
    for name, axes in dims.items():
        top, _, rest = name.partition(".")
        found.setdefault(top, {})[rest] = axes
    return found


def _renamed(dims: dict[str, dict[str, str]], renames: dict[str, str]) -> dict[str, dict[str, str]]:
    return {_renamed_leaf(name, renames): axes for name, axes in dims.items()}


def _renamed_leaf(name: str, renames: dict[str, str]) -> str:
    top, dot, rest = name.partition(".")
    return f"{renames.get(top, top)}{dot}{rest}"


def _renamed_graph(name: str, renames: dict[str, str]) -> str:
    """A graph's name (``with past_key_values, use_cache=True``) with the renamed inputs' new names."""
    for old, new in renames.items():
        name = re.sub(rf"\b{re.escape(old)}\b", new, name)
    return name


def _lost_dims(before: dict[str, dict[str, str]], now: dict[str, dict[str, str]], where: str) -> list[str]:
    return [f"{where}dim {input_name}.{axis} ({dim}) became static"
            for input_name, axes in before.items() for axis, dim in axes.items() if axis not in now.get(input_name, {})]


def _since(versions: Versions, then: str, now: str) -> str:
    """`` (passed with torch 2.13.0, fails with torch 2.15.0)``, or "" when no version changed."""
    if not versions:
        return ""
    before = _and([f"{package} {old}" for package, (old, _) in versions.items()])
    after = _and([f"{package} {new}" for package, (_, new) in versions.items()])
    return f" ({then} with {before}, {now} with {after})"


def _and(items: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return f"{', '.join(items[:-1])} and {items[-1]}" if len(items) > 1 else items[0]


def states(old: dict[str, BaselineEntry], new: dict[str, ModelResult]) -> list[Change]:
    """Every model's state in the baseline and now (``absent`` on the side without it), by name."""
    return [
        Change(
            name,
            state(old[name].verdict, old[name].stage, old[name].dims) if name in old else ABSENT,
            state(new[name].verdict, new[name].stage, new[name].dims) if name in new else ABSENT,
        )
        for name in sorted(old.keys() | new.keys())
    ]


def _notes(entry: BaselineEntry, result: ModelResult) -> list[str]:
    """Changes worth a look that do not fail the gate."""
    notes = [f"input {old} is now named {new}: its dims are compared under the new name"
             for old, new in _renames(entry, result).items()]
    if _failing(entry.verdict) and _failing(result.verdict) and entry.stage != result.stage:
        notes.append(f"failing stage moved: {entry.stage or '?'} → {result.stage or '?'}")
    if result.passed and entry.max_abs is not None and result.max_abs is not None:
        old, new = f"{entry.max_abs:.2g}", f"{result.max_abs:.2g}"
        if result.max_abs > entry.max_abs and old != new:
            notes.append(f"max|Δ| grew {old} → {new}, within tolerance")
    return notes
