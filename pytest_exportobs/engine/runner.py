"""Check the groups one after the other, in process or each in a forked child (``--export-isolate``)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Iterable, Iterator

from ..observe.store import ModelGroup
from .check import check_model
from .result import FAILED, ModelResult
from .settings import CheckSettings


def check_all(
    groups: Iterable[ModelGroup], settings: CheckSettings, isolate: bool,
    progress: Callable[[str], None] | None = None,
) -> Iterator[ModelResult]:
    """Yield one result per group; ``progress`` receives one line per model and stage."""
    groups = list(groups)
    for position, group in enumerate(groups, 1):
        begin = time.perf_counter()
        prefix = f"exportobs [{position}/{len(groups)}] {group.name}"

        def stage(name: str, prefix: str = prefix, begin: float = begin) -> None:
            if progress:
                progress(f"{prefix}: {name} ({time.perf_counter() - begin:.1f}s)")

        result = _isolated(group, settings) if isolate else check_model(group, settings, stage)
        if progress:
            progress(f"{prefix}: {result.verdict} in {time.perf_counter() - begin:.1f}s")
        yield result


def _isolated(group: ModelGroup, settings: CheckSettings) -> ModelResult:
    """Run the check in a forked child: a native crash fails this model, not the session."""
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(group, settings, sender), daemon=True)
    child.start()
    sender.close()
    try:
        data = receiver.recv()
    except EOFError:
        data = None
    child.join()
    if data is not None and child.exitcode == 0:
        return ModelResult.from_json(data)
    return ModelResult(
        name=group.name, verdict=FAILED, stage="isolate", kind="error", sources=list(group.sources),
        reason=f"the isolated check process died ({_exit_reason(child.exitcode)})",
    )


def _child(group: ModelGroup, settings: CheckSettings, sender: multiprocessing.connection.Connection) -> None:
    sender.send(check_model(group, settings).to_json())
    sender.close()
    os._exit(0)  # skip pytest's atexit handlers inherited by the fork


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"exit code {code}"
