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


def family(group: ModelGroup) -> str:
    """The family of a group's model: the module its class is defined in (the same code: a
    process's first trace of one of them costs about twice the next, as torch and sympy warm up
    on its expressions)."""
    return type(group.module).__module__


@dataclass(eq=False)
class SharedQueue:
    """Checks waiting their turn, in order, their next position and who took each in memory that
    forked children share: each check is taken once, by this process (taker 0) or by a child
    (its number)."""

    checks: list[tuple[ModelGroup, Progress]]
    _next: Any  # multiprocessing.Value, with its lock
    _takers: Any  # multiprocessing.Array

    @classmethod
    def of(cls, checks: list[tuple[ModelGroup, Progress]]) -> SharedQueue:
        context = multiprocessing.get_context("fork")
        return cls(checks, context.Value("i", 0), context.Array("i", max(1, len(checks)), lock=False))

    @property
    def waiting(self) -> list[tuple[ModelGroup, Progress]]:
        return self.checks[self._next.value:]

    def take(self, taker: int, of_family: str | None = None) -> int | None:
        """The position of the next check, now ``taker``'s; ``None`` when none waits or, given
        ``of_family``, when the next is a model of another family."""
        with self._next.get_lock():
            position = self._next.value
            if position >= len(self.checks) or of_family not in (None, family(self.checks[position][0])):
                return None
            self._next.value = position + 1
            self._takers[position] = taker
            return position

    def taken_by(self, taker: int) -> list[int]:
        return [p for p in range(self._next.value) if self._takers[p] == taker]


# seconds between two wake-ups of the parent waiting for its children: a Ctrl-C whose signal
# another thread took is only seen when the main thread runs Python again
WAKE = 0.5


@dataclass(eq=False)  # one per child: compared and found by identity
class Child:
    """A forked child checking models one after the other, each taken from ``queue`` as child
    ``number``: the check it begins, its steps and its result come through ``receiver``, each
    check within ``timeout``."""

    queue: SharedQueue
    number: int
    process: multiprocessing.process.BaseProcess
    receiver: Connection
    timeout: float | None
    current: int | None = None  # the position of the check running
    deadline: float | None = None
    results: list[ModelResult] = field(default_factory=list)  # received, not yet taken
    finished: set[int] = field(default_factory=set)

    def read(self) -> bool:
        """Take one message from the child; ``False`` once it has nothing more to say."""
        try:
            kind, value = self.receiver.recv()
        except EOFError:
            return False
        if kind == "begin":  # its time and its time limit count from now
            self.current = value
            self.queue.checks[value][1].begin = time.perf_counter()
            self.deadline = None if self.timeout is None else time.monotonic() + self.timeout
            return True
        assert self.current is not None, f"{kind} of no check begun"
        tracker = self.queue.checks[self.current][1]
        if kind == "result":  # until the next begins, the child takes it or exits: no time limit
            self.results.append(tracker.done(ModelResult.from_json(value)))
            self.finished.add(self.current)
            self.current = self.deadline = None
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
        """Wait for the child to exit: a check it took and did not finish failed with its death."""
        self.process.join()
        self.receiver.close()
        reason = f"the isolated check process died ({exit_reason(self.process.exitcode)})"
        return self._unfinished(lambda group, stage: unfinished(group, stage=Stage.ISOLATE, kind=Kind.ERROR,
                                                                reason=reason))

    def kill_timed_out(self, settings: CheckSettings) -> list[ModelResult]:
        """Kill the child: the check it was running is out of time."""
        self.kill()
        return self._unfinished(lambda group, stage: timed_out(group, settings, stage))

    def kill_interrupted(self) -> list[ModelResult]:
        """Kill the child (Ctrl-C): the check it was running is interrupted."""
        self.kill()
        return self._unfinished(interrupted)

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.receiver.close()

    def _unfinished(self, result: Callable[[ModelGroup, Stage], ModelResult]) -> list[ModelResult]:
        """For each check the child took and did not finish (the one it was running), ``result``
        of its model and the stage it reached."""
        lost = []
        for position in self.queue.taken_by(self.number):
            if position not in self.finished:
                group, tracker = self.queue.checks[position]
                lost.append(tracker.done(result(group, tracker.stage)))
                self.finished.add(position)
        self.current = self.deadline = None
        return lost


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
