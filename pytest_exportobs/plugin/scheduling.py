"""The scheduler of a session whose ``--dist load`` the plugin turned into group scheduling.

Imported only by xdist's ``pytest_xdist_make_scheduler`` hook, so only where xdist is installed.
"""

from __future__ import annotations

from xdist.scheduler import LoadGroupScheduling
from xdist.workermanage import WorkerController


class PinnedScheduling(LoadGroupScheduling):
    """xdist's LoadGroupScheduling, handling a crashed worker as ``--dist load`` (the user's
    choice) does:

    * the test that was running when its worker crashed is reported once and not run again
      (group scheduling puts it back into the queue with the rest of its unit, where it crashes
      each replacement worker in turn, up to ``--max-worker-restart``);
    * only units with tests left to run go back into the queue (a unit whose tests had all run
      was sent to a replacement worker as an empty batch, which never reports back: the
      session hung);
    * a replacement worker gets work once its collection has arrived (rescheduling all nodes
      when a first replacement has collected used to hand work to a second one still collecting:
      an INTERNALERROR).
    """

    def remove_node(self, node: WorkerController) -> str | None:
        left = {scope: unit for scope, unit in self.assigned_work.pop(node).items() if not all(unit.values())}
        crashed = next((nodeid for unit in left.values() for nodeid, done in unit.items() if not done), None)
        if crashed is None:
            return None  # a worker shutting down with nothing left to run
        left[self._split_scope(crashed)][crashed] = True  # xdist reports it failed; never sent again
        self.workqueue.update((scope, unit) for scope, unit in left.items() if not all(unit.values()))
        for other in self.assigned_work:
            self._reschedule(other)
        return crashed

    def _reschedule(self, node: WorkerController) -> None:
        if node in self.registered_collections:
            super()._reschedule(node)
