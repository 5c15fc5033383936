"""The scheduler replacing ``--dist load`` in a session that checks exports.

Imported only by xdist's ``pytest_xdist_make_scheduler`` hook, so only where xdist is installed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from xdist.workermanage import WorkerController

from ..compat.xdist_private import ScopeScheduling


class ModelScheduling(ScopeScheduling):
    """xdist's scope scheduling where a scope is a placement group (see :mod:`.xdist`): the tests
    of one model run on one worker, the models are dealt evenly to the workers, and every other
    test is a scope of its own, as under ``--dist load``.  Without the workers' placement (workers
    on other hosts) a scope is a test module, as under ``--dist loadfile``.

    A crashed worker is handled as ``--dist load`` handles it:

    * the test that was running when its worker crashed is reported once and not run again
      (scope scheduling puts it back into the queue with the rest of its unit, where it crashes
      each replacement worker in turn, up to ``--max-worker-restart``);
    * only units with tests left to run go back into the queue (a unit whose tests had all run
      was sent to a replacement worker as an empty batch, which never reports back: the
      session hung);
    * a replacement worker gets work once its collection has arrived (rescheduling all nodes
      when a first replacement has collected used to hand work to a second one still collecting:
      an INTERNALERROR).
    """

    def __init__(self, config: pytest.Config, log: Any, directory: Path):
        super().__init__(config, log)
        self.directory = directory
        self.placement: dict[str, str] | None = None
        self.undealt: set[str] = set()  # model groups not yet dealt to the workers

    def schedule(self) -> None:
        if self.collection is None:  # the first call: every worker has collected and written
            self.placement = _read_placement(self.directory)
            self.undealt = set((self.placement or {}).values())
        super().schedule()

    def assign(self, node: WorkerController) -> None:
        """The first assignment deals all model groups round-robin (largest first) to the
        workers, which check them at their end; the other tests follow as workers free up."""
        if self.undealt:
            models = [scope for scope in self.queue if scope in self.undealt]
            self.undealt.clear()
            for position, scope in enumerate(models):
                self.queue.move_to_end(scope, last=False)
                self.send_next_scope(self.nodes[position % len(self.nodes)])
            if self.assigned_work[node]:
                return
        if self.queue:
            self.send_next_scope(node)

    def scope_of(self, nodeid: str) -> str:
        if self.placement is None:
            return nodeid.split("::", 1)[0]
        return self.placement.get(nodeid, nodeid)

    def remove_node(self, node: WorkerController) -> str | None:
        left = {scope: unit for scope, unit in self.assigned_work.pop(node).items() if not all(unit.values())}
        crashed = next((nodeid for unit in left.values() for nodeid, done in unit.items() if not done), None)
        if crashed is None:
            return None  # a worker shutting down with nothing left to run
        left[self.scope_of(crashed)][crashed] = True  # xdist reports it failed; never sent again
        self.queue.update((scope, unit) for scope, unit in left.items() if not all(unit.values()))
        for other in self.assigned_work:
            self.reschedule(other)
        return crashed

    def reschedule(self, node: WorkerController) -> None:
        if node in self.registered_collections:
            super().reschedule(node)


def _read_placement(directory: Path) -> dict[str, str] | None:
    """The placement the workers wrote (they collect the same tests); ``None`` when none did
    (workers on other hosts write to their own file system)."""
    for path in sorted(directory.glob("*.json")):
        return json.loads(path.read_text(encoding="utf-8"))
    return None
