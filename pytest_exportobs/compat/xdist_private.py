"""The private steps of xdist's scope scheduler (``LoadScopeScheduling``, pytest-xdist 3.x),
behind public names :class:`~..plugin.scheduling.ModelScheduling` overrides.

Imported only by xdist's ``pytest_xdist_make_scheduler`` hook, so only where xdist is installed.
"""

from __future__ import annotations

from collections import OrderedDict

from xdist.scheduler import LoadScopeScheduling
from xdist.workermanage import WorkerController


class ScopeScheduling(LoadScopeScheduling):
    """xdist's scope scheduling with its steps as public methods: :meth:`scope_of` (the scope
    of a test), :meth:`assign` (what a worker that needs work gets), :meth:`reschedule` (what a
    worker gets after another one crashed), and :attr:`queue` (the scopes not yet sent, each
    ``{nodeid: done}``)."""

    @property
    def queue(self) -> OrderedDict[str, dict[str, bool]]:
        return self.workqueue

    def scope_of(self, nodeid: str) -> str:
        return LoadScopeScheduling._split_scope(self, nodeid)

    def assign(self, node: WorkerController) -> None:
        self.send_next_scope(node)

    def send_next_scope(self, node: WorkerController) -> None:
        """Send the first scope of the queue to ``node``."""
        LoadScopeScheduling._assign_work_unit(self, node)

    def reschedule(self, node: WorkerController) -> None:
        LoadScopeScheduling._reschedule(self, node)

    # xdist's private steps, routed to the public ones
    def _split_scope(self, nodeid: str) -> str:
        return self.scope_of(nodeid)

    def _assign_work_unit(self, node: WorkerController) -> None:
        self.assign(node)

    def _reschedule(self, node: WorkerController) -> None:
        self.reschedule(node)
