"""Checks in forked children, as the parent sees them: each child checks its groups in turn and
sends each check's steps and result through a pipe; the parent follows them (:class:`Progress`),
reads them (:func:`ended`), and gives the results a check could not give itself (time up, child
dead or not started, Ctrl-C)."""

from __future__ import annotations

import multiprocessing
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from ..core.vocabulary import Kind, Stage, Verdict
from ..observe.store import ModelGroup
from .base.result import ModelResult
from .base.settings import CheckSettings

_STEP_WORDS = {Stage.TORCH_EXPORT: "export"}  # the export step runs torch.export and the translation


@dataclass
class Progress:
    """Follows the stage a check has reached, and writes one line per step when asked to."""

    prefix: str
    write: Callable[[str], None] | None
    stage: Stage = Stage.INFER
    begin: float = field(default_factory=time.perf_counter)
    seconds: float = 0.0  # the check's, once done

    def __call__(self, stage: Stage, graph: str = "") -> None:
        self.stage = stage
        step = _STEP_WORDS.get(stage, stage.value) + (f" [{graph}]" if graph else "")
        self.line(f"{step} ({time.perf_counter() - self.begin:.1f}s)")

    def done(self, result: ModelResult) -> ModelResult:
        """Write the verdict and the time the check took; return ``result``."""
        self.seconds = time.perf_counter() - self.begin
        self.line(f"{result.verdict} in {self.seconds:.1f}s")
        return result

    def line(self, text: str) -> None:
        if self.write:
            self.write(f"{self.prefix}: {text}")


def interrupted(group: ModelGroup, stage: Stage | str = "") -> ModelResult:
    """The result of a model whose check Ctrl-C stopped at ``stage``, or never let begin."""
    when = f"during {stage}" if stage else "before its check began"
    return unfinished(group, verdict=Verdict.INTERRUPTED, stage=stage, kind=Kind.INTERRUPTED,
                      reason=f"interrupted (Ctrl-C) {when}")


def unfinished(group: ModelGroup, verdict: Verdict = Verdict.FAILED, **fields: Any) -> ModelResult:
    """A result the check itself could not give (time up, child dead or not started, Ctrl-C)."""
    return ModelResult(name=group.name, verdict=verdict, sources=list(group.sources),
                       model_class=group.model_class, n_observations=group.recorder.num_obs(), **fields)


def timed_out(group: ModelGroup, settings: CheckSettings, stage: Stage) -> ModelResult:
    return unfinished(group, stage=stage, kind=Kind.TIMEOUT,
                      reason=f"timed out after {settings.timeout:g} s during {stage}")


# seconds between two wake-ups of the parent waiting for its children: a Ctrl-C whose signal
# another thread took is only seen when the main thread runs Python again
WAKE = 0.5


@dataclass(eq=False)  # one per child: compared and found by identity
class Child:
    """Checks running in a forked child, one after the other (the first of ``checks`` runs):
    their steps and results come through ``receiver``, each within ``timeout``."""

    checks: list[tuple[ModelGroup, Progress]]
    process: multiprocessing.process.BaseProcess
    receiver: Connection
    timeout: float | None
    deadline: float | None = None
    results: list[ModelResult] = field(default_factory=list)  # received, not yet taken

    def __post_init__(self) -> None:
        self._begin()

    def _begin(self) -> None:
        """The next check begins: its time and its time limit count from now."""
        self.checks[0][1].begin = time.perf_counter()
        self.deadline = None if self.timeout is None else time.monotonic() + self.timeout

    def read(self) -> bool:
        """Take one message from the child; ``False`` once it has nothing more to say."""
        try:
            kind, value = self.receiver.recv()
        except EOFError:
            return False
        tracker = self.checks[0][1]
        if kind == "result":
            self.results.append(tracker.done(ModelResult.from_json(value)))
            self.checks.pop(0)
            if self.checks:
                self._begin()
            else:  # every check done: the child only has to exit, which no time limit bounds
                self.deadline = None
        else:
            tracker(Stage(value[0]), value[1])
        return True

    def drain(self) -> bool:
        """Take every message the child has sent by now; ``False`` once it has nothing more to say."""
        while self.receiver.poll():
            if not self.read():
                return False
        return True

    def taken(self) -> list[ModelResult]:
        """The results received since last taken."""
        results, self.results = self.results, []
        return results

    def end(self) -> list[ModelResult]:
        """Wait for the child to exit: the failure its death is for the check it was running,
        if any (those it had not begun stay in ``checks``)."""
        self.process.join()
        self.receiver.close()
        if not self.checks:
            return []
        group, tracker = self.checks.pop(0)
        reason = f"the isolated check process died ({exit_reason(self.process.exitcode)})"
        return [tracker.done(unfinished(group, stage=Stage.ISOLATE, kind=Kind.ERROR, reason=reason))]

    def kill_timed_out(self, settings: CheckSettings) -> list[ModelResult]:
        """Kill the child: the check it was running is out of time."""
        self.kill()
        group, tracker = self.checks.pop(0)
        return [tracker.done(timed_out(group, settings, tracker.stage))]

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.receiver.close()


def ended(running: list[Child], block: bool = True) -> list[tuple[Child, bool]]:
    """Read the children's messages until some have ended or run out of time (``True``);
    without ``block``, those that have by now (maybe none)."""
    while True:
        deadlines = [c.deadline for c in running if c.deadline is not None]
        timeout = min([WAKE, *(max(0.0, d - time.monotonic()) for d in deadlines)]) if block else 0.0
        readable = wait([c.receiver for c in running], timeout)
        done = [c for c in running if c.receiver in readable and not c.drain()]
        now = time.monotonic()
        late = [c for c in running if c not in done and c.deadline is not None and now >= c.deadline]
        if done or late or not block:
            return [(c, False) for c in done] + [(c, True) for c in late]


def exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"exit code {code}"
