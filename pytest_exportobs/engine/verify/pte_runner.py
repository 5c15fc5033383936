"""ExecuTorch's runtime running a ``.pte`` program (``--export-target executorch``) on the flat
leaves of an aligned call.

The runtime is native code that aborts on some programs; a program is first loaded and run on
one call in a forked process (:func:`probe_run`), so that a crash fails its model, not the
session.  Each size of an input is checked against the upper bound memory was planned for
before a call: a size beyond it is a clear failure (:class:`BeyondBound`), not the runtime's
error code.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ...core.vocabulary import Runtime
from .runtimes import NativeCrash

PROBE_SECONDS = 600  # a probe still running then is killed: the runtime hangs on the program


# executorch/runtime/core/error.h
_ERRORS = {
    0x01: "Internal", 0x02: "InvalidState", 0x03: "EndOfMethod", 0x04: "AlreadyLoaded", 0x10: "NotSupported",
    0x11: "NotImplemented", 0x12: "InvalidArgument", 0x13: "InvalidType", 0x14: "OperatorMissing",
    0x20: "NotFound", 0x21: "MemoryAllocationFailed", 0x22: "AccessFailed", 0x23: "InvalidProgram",
    0x24: "InvalidExternalData", 0x25: "OutOfResources", 0x30: "DelegateInvalidCompatibility",
    0x31: "DelegateMemoryAllocationFailed", 0x32: "DelegateInvalidHandle",
}
_ERROR_CODE = re.compile(r"failed with error (0x[0-9a-fA-F]+)")


class BeyondBound(Exception):
    """A call's size of a dynamic dim exceeds the upper bound the program's memory was planned for."""


class PteRunner:
    """The ``forward`` method of a ``.pte`` program loaded by ExecuTorch's runtime; its outputs
    copied out of the memory the runtime plans (the next call overwrites it)."""

    runtime = Runtime.EXECUTORCH

    def __init__(self, path: Path, bounds: dict[int, dict[int, tuple[str, int]]] | None = None,
                 mutated_inputs: int = 0):
        from executorch.runtime import Runtime as ExecuTorchRuntime

        self.program = ExecuTorchRuntime.get().load_program(str(path))  # the method needs it alive
        self.method = self.program.load_method("forward")
        self.inputs = self.method.metadata.num_inputs()
        self.bounds = bounds or {}  # per leaf: {dim: (its variable, the largest size planned for)}
        self.mutated_inputs = mutated_inputs  # the first outputs: inputs the program updates in place

    def __call__(self, leaves: Sequence[Any]) -> list[torch.Tensor]:
        for leaf, bounds in self.bounds.items():
            for dim, (name, largest) in bounds.items():
                if isinstance(leaves[leaf], torch.Tensor) and leaves[leaf].shape[dim] > largest:
                    raise BeyondBound(f"{name} = {leaves[leaf].shape[dim]} is beyond the upper bound {largest} the "
                                      "program's memory was planned for")
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        if len(tensors) != self.inputs:
            raise ValueError(f"the ExecuTorch program has {self.inputs} inputs, the call gives {len(tensors)} tensors")
        try:
            outputs = self.method.execute([t.contiguous() for t in tensors])[self.mutated_inputs:]
        except RuntimeError as e:  # "... failed with error 0x10": the code's name says more
            code = _ERROR_CODE.search(str(e))
            named = f"{e} ({_ERRORS.get(int(code.group(1), 16), 'unknown')})" if code else str(e)
            if "set_inputs" in named:  # the sizes were found within the bounds before the call
                named += ": the program's inputs do not resize to these sizes, within the bounds planned for"
            raise RuntimeError(named) from e
        return [o.clone() for o in outputs if isinstance(o, torch.Tensor)]


def probe_run(path: Path, leaves: Sequence[Any]) -> None:
    """Load the program and run it on ``leaves`` in a forked process first: raises
    :class:`~.runtimes.NativeCrash` when the runtime dies there (a signal), or does not end within
    :data:`PROBE_SECONDS`.  An error the runtime reports is left to the run in this process."""
    pid = os.fork()
    if pid == 0:  # the child: never back into the parent's code (pytest's handlers, atexit)
        status = 1
        try:
            torch.set_num_threads(1)  # torch's OpenMP pool is not fork-safe; ExecuTorch's makes its own
            PteRunner(path)(leaves)
            status = 0
        finally:
            os._exit(status)
    deadline = time.monotonic() + PROBE_SECONDS
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise NativeCrash(f"no end within {PROBE_SECONDS} s")
        time.sleep(0.02)
    if os.WIFSIGNALED(status):
        raise NativeCrash(signal.Signals(os.WTERMSIG(status)).name)
