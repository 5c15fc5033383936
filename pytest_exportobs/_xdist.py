"""pytest-xdist support: keep every observing test on one worker, bring results to the controller.

The observations of one model must all reach the process that checks it.  On the controller the
plugin switches ``--dist load`` to ``loadgroup`` (LoadGroupScheduling sends the tests whose node
id ends in ``@<group>`` to one worker); on each worker it gives every observing test (marker or
``export_observer`` fixture) the ``@exportobs`` suffix.  xdist's own suffixing of
``xdist_group``-marked tests writes ``item._nodeid``, which pytest ≥ 9.1 no longer reads, so the
suffix is set here for both layouts.
"""

from __future__ import annotations

from typing import Any

import pytest

GROUP = "exportobs"
PIN_KEY = "exportobs_pin"


class XdistHooks:
    """Registered next to the plugin when pytest-xdist is installed and the check is on."""

    def __init__(self, export: Any):
        self.export = export

    def pytest_configure_node(self, node: Any) -> None:
        node.workerinput[PIN_KEY] = node.config.option.dist == "loadgroup"

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        if not getattr(config, "workerinput", {}).get(PIN_KEY):
            return
        from .session import MARKER

        for item in items:
            if item.get_closest_marker(MARKER) or "export_observer" in getattr(item, "fixturenames", ()):
                _add_group_suffix(item)

    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        from .session import OUTPUT_KEY

        output = getattr(node, "workeroutput", {}).get(OUTPUT_KEY)
        self.export.merge_worker_output(output, node.gateway.id)


def pin_observing_tests(config: pytest.Config) -> None:
    """On the controller: schedule by group so that the observing tests share one worker."""
    if getattr(config.option, "dist", "no") == "load":
        config.option.dist = "loadgroup"


def _add_group_suffix(item: pytest.Item) -> None:
    nodeid = f"{item.nodeid}@{GROUP}"
    if hasattr(item, "_id"):  # pytest >= 9.1: a structured NodeId
        from _pytest.nodeid import NodeId

        item._id = NodeId.parse(nodeid)
    else:
        item._nodeid = nodeid
