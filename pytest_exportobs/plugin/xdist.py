"""pytest-xdist support: keep every observing test on one worker, bring results to the controller.

The observations of one model must all reach the process that checks it.  On the controller the
plugin switches ``--dist load`` to ``loadgroup`` (LoadGroupScheduling sends the tests whose node
id ends in ``@<group>`` to one worker; see :mod:`.scheduling` for how crashes are handled); on
each worker it gives every observing test (marker or ``export_observer`` fixture) the
``@exportobs`` suffix.  xdist's own suffixing of ``xdist_group``-marked tests writes
``item._nodeid``, which pytest ≥ 9.1 no longer reads, so the suffix is set here for both layouts.
"""

from __future__ import annotations

from typing import Any

import pytest

from .observing import ANNOUNCED_PROPERTY, marked_names, observes

GROUP = "exportobs"
PIN_KEY = "exportobs_pin"  # workerinput: the controller pins observing tests to one worker
OUTPUT_KEY = "exportobs"  # workeroutput: the worker's JSON results


def is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def is_controller(config: pytest.Config) -> bool:
    """Whether this process distributes the tests to xdist workers."""
    return config.pluginmanager.hasplugin("xdist") and getattr(config.option, "dist", "no") != "no"


def pin_on_controller(config: pytest.Config) -> bool:
    """Schedule by group so that the observing tests share one worker; whether the plugin
    changed the scheduling (``--dist load``, the default, becomes ``loadgroup``)."""
    if config.option.dist != "load":
        return False
    config.option.dist = "loadgroup"
    return True


def make_scheduler(config: pytest.Config, log: Any) -> Any:
    """The scheduler replacing ``--dist load``: group scheduling that handles crashes as load does."""
    from .scheduling import PinnedScheduling

    return PinnedScheduling(config, log)


def configure_node(node: Any) -> None:
    """Tell a new worker whether to pin (only ``loadgroup`` scheduling reads the suffix)."""
    node.workerinput[PIN_KEY] = node.config.option.dist == "loadgroup"


def pin_on_worker(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give every observing test the ``@exportobs`` group suffix, when the controller asked."""
    if not config.workerinput.get(PIN_KEY):
        return
    for item in items:
        if observes(item):
            _add_group_suffix(item)


def announce(item: pytest.Item) -> None:
    """At setup, name the groups the item's markers will observe (sent with the setup report)."""
    item.user_properties.extend((ANNOUNCED_PROPERTY, name) for name in marked_names(item))


def worker_of(report: pytest.TestReport) -> str | None:
    """The id of the worker that sent ``report`` (``None`` for the controller's own reports)."""
    node = getattr(report, "node", None)
    return node.gateway.id if node is not None else None


def _add_group_suffix(item: pytest.Item) -> None:
    nodeid = f"{item.nodeid}@{GROUP}"
    if hasattr(item, "_id"):  # pytest >= 9.1: a structured NodeId
        from _pytest.nodeid import NodeId

        item._id = NodeId.parse(nodeid)
    else:
        item._nodeid = nodeid
