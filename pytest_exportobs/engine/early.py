"""Checks while the tests still run, on the core they leave idle (``--export-overlap``).

A group whose recorded calls stay the same over a whole test has settled: most later tests of a
model call it with inputs it has recorded already.  Settled groups are checked in a forked child,
one child at a time, at the lowest priority, with one torch thread: the child writes the export
cache and nothing else (its files go to a directory of its own, removed at the end), so the
session's own check, at the end as always, finds the traces, graphs, comparisons and variations
of every group that did not change since, and checks the others as it would have.  No verdict
comes from the child: a group that gained calls or changed weights since misses the cache, and
the child is killed when the tests end (its unfinished work is done again by the session's
check).  A group whose check the cache recorded as it is now is left out: the child finds that
out, where checking it would only read the cache back while the tests run.  A child handed only
such groups ends the session's early checks: a rerun, whose other groups are most likely recorded
too, and whose tests each fork would slow (the child takes a share of the core one of their
threads runs on; timm's rerun: 3.6 s of its 20 s of tests, a child forked after nearly every test).
The test process imports none of the exporter's modules for them (the child does, in 0.3 s): their
objects would add to every full collection the tests run (diffusers' model tests call
``gc.collect()`` twice a test, 70 % of their time without the plugin).
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import shutil
import signal
import tempfile
from collections.abc import Iterable
from dataclasses import replace
from multiprocessing.process import BaseProcess
from pathlib import Path

import torch

from ..observe.store import ModelGroup
from .base.settings import CheckSettings
from .settled import settled

LOWEST_PRIORITY = 19  # the child's niceness: the tests' threads always come first
ALL_RECORDED = 3  # a child's exit status: the export cache recorded the check of every group it was handed


class EarlyChecks:
    """Settled groups checked in the background while the tests run; see the module's docstring."""

    def __init__(self, settings: CheckSettings):
        self.settings = settings
        self.calls: dict[int, int] = {}  # id(group) -> its recorded calls after the last test
        self.handed: dict[int, int] = {}  # id(group) -> its recorded calls when handed to a child
        self.checked = 0  # groups handed to children
        self.child: BaseProcess | None = None
        self.scratch: Path | None = None  # the children's export directory (not the session's)

    def after_test(self, groups: Iterable[ModelGroup]) -> None:
        """Note each group's calls after a test; when no child runs, fork one for the groups
        that kept theirs over the whole test and were not checked with them yet (none once a
        child found all of its checks recorded)."""
        if self.child is not None and self.child.exitcode == ALL_RECORDED:
            return  # a rerun: the other groups' checks are most likely recorded too
        ready = []
        for group in groups:
            calls = group.recorder.num_obs()
            unchanged = self.calls.get(id(group)) == calls
            self.calls[id(group)] = calls
            if calls and unchanged and self.handed.get(id(group)) != calls:
                ready.append(group)
        if not ready or self.child is not None and self.child.is_alive():
            return
        for group in ready:
            self.handed[id(group)] = self.calls[id(group)]
        to_check = [group for group in ready if settled(group) is None]  # nothing to export: nothing to prepare
        if to_check:
            self._start(to_check)

    def _start(self, groups: list[ModelGroup]) -> None:
        if self.scratch is None:
            self.scratch = Path(tempfile.mkdtemp(prefix="exportobs-early-"))
        settings = replace(self.settings, export_dir=self.scratch, cache_root=self.settings.cache_dir)
        process = multiprocessing.get_context("fork").Process(target=_child, args=(groups, settings), daemon=True)
        gc.freeze()  # the child's collections neither walk nor copy the test process's objects
        try:
            process.start()
        except OSError:
            return  # no process to spare: the session's own check does it all
        finally:
            gc.unfreeze()
        self.child = process
        self.checked += len(groups)

    def stop(self) -> None:
        """The tests are over: kill the child (what it did not finish, the session's check
        does), remove what it left half-written in the cache and its export directory."""
        if self.child is not None:
            if self.child.is_alive():
                self.child.kill()
                self.child.join()
                for leftover in self.settings.cache_dir.glob(".*.tmp"):  # an atomic write cut short
                    leftover.unlink(missing_ok=True)
            self.child = None
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None


def _child(groups: list[ModelGroup], settings: CheckSettings) -> None:
    """Check ``groups`` in turn for the export cache, those it recorded left out (exit status
    :data:`ALL_RECORDED` when that is all of them); print nothing, answer no signal but a kill."""
    status = 0
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the test process's
        os.nice(LOWEST_PRIORITY)
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 1)
            os.dup2(devnull.fileno(), 2)
        # one thread: GNU OpenMP (torch's) is not fork-safe (see runner._child)
        torch.set_num_threads(1)
        with contextlib.suppress(Exception):
            from .runner import check_all  # the exporter's modules, imported here only (see the module's docstring)

            checked = sum(1 for _ in check_all(groups, settings, isolate=False, jobs=1, threads=1,
                                               unrecorded_only=True))
            status = 0 if checked else ALL_RECORDED
    finally:
        os._exit(status)  # skip pytest's atexit handlers inherited by the fork
