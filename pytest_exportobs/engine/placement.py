"""Where and in which order the checks run.

Forked checks (``--export-jobs`` above 1, ``--export-isolate``) run side by side, the most
expensive first: the last to end is then a short one, not a straggler.  A check the export cache
is expected to serve (under :data:`IN_PROCESS_SECONDS`) of a model whose weights are small runs
in the session's process instead, beside the forked ones (on the cores they leave): a fork's
start and the pages its child touches cost more than such a check (timm's 42 models, every
graph served by the cache: 13.6 s of checks one after the other in process, 27 s of forked
checks two at a time).  A larger
model's check stays forked: its ONNX file and runtime session (about three copies of its
weights) stay out of the session's process, whose memory holds every kept model.

What each check is expected to take next time is kept in the export cache under a key known
before the check (:meth:`~.export.cache.ExportCache.check_key`): what it took, less the stages the
cache serves next time (the exports, passed or failed; the variations when it passed), so that
the first rerun after a first run is placed as a rerun.  A model whose code, configuration,
calls or settings changed has no record, and is forked as on a first run.  A record only places
a check; no verdict depends on it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from ..core.vocabulary import Stage, Verdict
from ..observe.binding import CONSTANT_TYPES
from ..observe.store import ModelGroup
from .base.result import ModelResult
from .base.settings import CheckSettings
from .export.cache import ExportCache
from .export.digests import module_state

IN_PROCESS_SECONDS = 2.0  # a check expected to take less runs in process
IN_PROCESS_BYTES = 64 << 20  # the weights of a model checked in process, at most

# the stages of a check that the export cache serves on the next run: the exports whether they
# passed or failed, the variations of a passed check
_EXPORT_STAGES = (Stage.TORCH_EXPORT, Stage.DECOMPOSE, Stage.ONNX_TRANSLATE, Stage.ONNX_CHECKER)
# settings that decide where the files go or how long a check may take, not what it does
_PLACEMENT_ONLY = ("export_dir", "cache_root", "use_cache", "timeout")


class CheckCosts:
    """What each group's next check is expected to take, in seconds, as the export cache
    recorded it."""

    def __init__(self, groups: Iterable[ModelGroup], settings: CheckSettings):
        self.cache = ExportCache(settings.cache_dir, settings.patches) if settings.use_cache else None
        checked = {k: v for k, v in asdict(settings).items() if k not in _PLACEMENT_ONLY}
        self.keys = {} if self.cache is None else {id(g): _check_key(self.cache, g, checked) for g in groups}
        self.expected = {group: self.cache.load_check_seconds(key) for group, key in self.keys.items()
                         if self.cache is not None and key is not None}

    def recorded(self, group: ModelGroup) -> float | None:
        """What ``group``'s check is expected to take; ``None`` when no check of it is recorded."""
        return self.expected.get(id(group))

    def record(self, group: ModelGroup, result: ModelResult, seconds: float) -> None:
        """Keep what ``group``'s next check is expected to take, after this one took ``seconds``
        (a cache that cannot be written plans nothing)."""
        key = self.keys.get(id(group))
        if self.cache is not None and key is not None:
            try:
                self.cache.store_check_seconds(key, expected_rerun_seconds(result, seconds))
            except OSError:
                pass


def expected_rerun_seconds(result: ModelResult, seconds: float) -> float:
    """What the next check of a model is expected to take after this one took ``seconds``: as
    much, less the stages the export cache serves next time (the first run of a model exports;
    its rerun, with nothing changed, does not, nor explores the shapes a passed check explored)."""
    served = (*_EXPORT_STAGES, Stage.VARIATIONS) if result.verdict == Verdict.PASSED else _EXPORT_STAGES
    return max(0.0, seconds - sum(result.timings.get(stage, 0.0) for stage in served))


def _check_key(cache: ExportCache, group: ModelGroup, settings: dict[str, Any]) -> str | None:
    """The group's check key; ``None`` when it cannot be made (a module whose state cannot be
    read as a trace reads it): the check is then placed as on a first run."""
    calls = [(o.args, o.kwargs, o.training) for o in group.recorder.observations]
    try:
        return cache.check_key(group.module, calls, settings | {"options": asdict(group.options)})
    except Exception:  # planning only: whatever the key trips on, the check itself reports
        return None


@dataclass(frozen=True)
class Placement:
    """The groups checked in forked children, in the order they start, then those checked in
    the session's process."""

    forked: list[ModelGroup]
    in_process: list[ModelGroup]


def place(groups: list[ModelGroup], costs: CheckCosts, isolate: bool, jobs: int) -> Placement:
    """Forked with ``isolate``, or with ``jobs`` above 1 unless recorded cheap and small; in
    process otherwise.  A batch of one check, to fork and none to run in process beside it,
    runs in process with every core."""
    if not isolate and jobs <= 1:
        return Placement([], groups)
    cheap = [] if isolate else [g for g in groups if _in_process(g, costs)]
    cheap_ids = {id(g) for g in cheap}
    forked = [g for g in groups if id(g) not in cheap_ids]
    if not isolate and len(forked) == 1 and not cheap:
        return Placement([], groups)
    forked.sort(key=lambda g: _expense(g, costs), reverse=True)
    return Placement(forked, cheap)


def _in_process(group: ModelGroup, costs: CheckCosts) -> bool:
    seconds = costs.recorded(group)
    return seconds is not None and seconds < IN_PROCESS_SECONDS and _weight_bytes(group) <= IN_PROCESS_BYTES


def _expense(group: ModelGroup, costs: CheckCosts) -> tuple[bool, float]:
    """Checks never recorded first (a first run's exports), by :func:`expected_cost`; then by
    the seconds expected."""
    seconds = costs.recorded(group)
    return (True, expected_cost(group)) if seconds is None else (False, seconds)


def expected_cost(group: ModelGroup) -> int:
    """What a check is expected to cost, in no unit: the graphs it exports (one per combination
    of keyword arguments and their plain values among the calls) times the size of each (the
    model's modules, whose calls become the graph's ops)."""
    combinations = {tuple(sorted((name, _plain(value)) for name, value in o.kwargs.items()))
                    for o in group.recorder.observations}
    return max(1, len(combinations)) * sum(1 for _ in group.module.modules())


def _plain(value: Any) -> Any:
    """A constant's value; a tensor's or a structure's type (its values do not choose the graph)."""
    return value if value is None or isinstance(value, CONSTANT_TYPES) else type(value).__name__


def _weight_bytes(group: ModelGroup) -> int:
    """Bytes of the group's parameters and buffers, each tensor once."""
    unique = {id(t): t for t in module_state(group.module).values()}
    return sum(t.numel() * t.element_size() for t in unique.values())
