"""The words a check is made of: verdicts, stages, failure kinds, runtimes, dim sources, axis roles,
stand-ins, refinements.

Each is a ``str`` enum: a member equals its text, so results read from JSON (plain strings)
compare equal to members, and JSON written from results holds the plain text.
"""

from __future__ import annotations

import enum
import sys

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # pragma: no cover - Python 3.10

    class StrEnum(str, enum.Enum):
        """``enum.StrEnum`` of Python 3.11: ``str()`` and ``format()`` give the value."""

        def __str__(self) -> str:
            return str(self.value)

        def __format__(self, spec: str) -> str:
            return format(str(self.value), spec)


class Verdict(StrEnum):
    """The outcome of a model or of one of its graphs."""

    PASSED = "passed"
    FAILED = "failed"
    SKIPPED = "skipped"
    INCOMPLETE = "incomplete"  # the process checking it ended without a result
    # The session was interrupted (Ctrl-C) before the check finished: never a pass, judged like
    # an incomplete check, never written into a baseline.
    INTERRUPTED = "interrupted"


class Stage(StrEnum):
    """The stages of a check, in the order it goes through them; a failure names the one it
    stopped at.  ``isolate``: the forked process checking the model died (stage unknown);
    ``engine``: the plugin itself failed (a bug of pytest-exportobs, never the model's)."""

    OBSERVE = "observe"
    INFER = "infer"
    TORCH_EXPORT = "torch.export"
    DECOMPOSE = "decompose"
    ONNX_TRANSLATE = "onnx-translate"
    ONNX_CHECKER = "onnx-checker"
    ORT_LOAD = "ort-load"
    LOWER = "lower"  # ExecuTorch: the edge dialect, the XNNPACK delegate, the .pte file
    RUN = "run"  # ExecuTorch's runtime loading the .pte and running the recorded calls
    VERIFY = "verify"
    VARIATIONS = "variations"
    ISOLATE = "isolate"
    ENGINE = "engine"


STAGES = tuple(Stage)
# Stages after which the dynamic dims of a failed check are known (not an early or unknown stop).
STAGES_WITH_DIMS = STAGES[STAGES.index(Stage.TORCH_EXPORT) : STAGES.index(Stage.ISOLATE)]


class Kind(StrEnum):
    """What kind of failure (or skip) a result is: the model's, the machine's, or ours."""

    ERROR = "error"  # an exception of torch, the translation or the runtime
    UNSUPPORTED_INPUT = "unsupported-input"  # arguments torch.export cannot take
    UNSUPPORTED_OUTPUT = "unsupported-output"  # outputs with no tensor to export
    SPECIALIZED = "specialized"  # a dynamic dim became a constant, or was bounded below a size eager reaches
    UNVERIFIED = "unverified"  # recorded calls no exported graph can run
    MISMATCH = "mismatch"  # numbers beyond tolerance
    OUTPUTS = "outputs"  # output count or shape differs
    NONDETERMINISTIC = "nondeterministic"  # eager itself differs from run to run
    VARIATION = "variation"  # a generated shape fails
    CRASH = "crash"  # the process running the exported graph died
    INCOMPLETE = "incomplete"  # the process checking it died
    INTERRUPTED = "interrupted"  # Ctrl-C during the check
    TIMEOUT = "timeout"  # the check ran out of its time
    INTERNAL = "internal"  # a bug of the plugin
    # The machine's problem (I/O, permissions, disk full), not the model's: a session error,
    # never a verdict, never written into a baseline.
    ENVIRONMENT = "environment"
    # Exported fine, but onnxruntime's provider here has no kernel for one of its ops in its dtype
    # (the CPU provider lacks many float16/bfloat16 kernels): a skip, not verified.
    RUNTIME = "runtime"


class GateOutcome(StrEnum):
    """The gate's outcome for one model (one ``exportobs::<name>`` test outcome): its verdict
    judged against the baseline."""

    PASSED = "passed"
    FAILED = "failed"
    SKIPPED = "skipped"
    XFAILED = "xfailed"  # a known failure: failing in the baseline or marked xfail
    XPASSED = "xpassed"  # fixed: failing in the baseline, passing now
    MISSING = "missing"  # in the baseline, its tests collected, not observed


class Target(StrEnum):
    """Where a check goes (``--export-target``, several at once): to ONNX run by onnxruntime, to
    an ExecuTorch program run by ExecuTorch's runtime (on-device), or only through torch.export,
    the exported program checked against eager (a quick stand-in for ONNX)."""

    ONNX = "onnx"
    TORCH = "torch"
    EXECUTORCH = "executorch"  # last: the program traced for the others is lowered for it


class Runtime(StrEnum):
    """What ran a graph to verify it (a graph's ``runtime`` in the reports)."""

    ONNXRUNTIME = "onnxruntime"
    # a half-precision graph onnxruntime's CPU provider cannot run, run by it in float32, rounded at each op's outputs
    WIDENED = "onnxruntime-float32"
    REFERENCE = "onnx-reference"  # onnx's ReferenceEvaluator: a graph onnxruntime cannot load even so
    PROGRAM = "torch-program"  # the exported program itself (--export-target torch)
    EXECUTORCH = "executorch"  # ExecuTorch's runtime on the .pte, its XNNPACK delegate on what it took


class DimSource(StrEnum):
    """Why a dimension is dynamic, strongest first."""

    DECLARED = "declared"  # the marker's ``dims``/``dynamic``
    FORCED = "forced"  # its input was named in ``set_batch_dimension_for``
    OBSERVED = "observed"  # the tests varied it
    ROLE = "role"  # its role demands it (batch, sequence, cache length)
    GUESS = "guess"  # its role is a guess (a generic input)


class StandIn(StrEnum):
    """What an input absent from a call means, when its name says (the graph then takes it)."""

    ONES = "ones"  # a mask: every position attended
    ZEROS = "zeros"  # token types: the first segment
    POSITIONS = "positions"  # position ids following the cache
    EMPTY = "empty"  # a self-attention cache holding nothing yet


class RefinementKind(StrEnum):
    """What an export established of a dynamic dimension (kept with the export in its cache)."""

    MERGE = "merge"  # the same as another variable
    SCALE = "scale"  # a multiple of a constant
    SPLIT = "split"  # some of its axes a length of their own (a sliding window's layers)
    ASSERT = "assert"  # a condition on sizes the program asserts at run time (the ONNX file does not check it)
    STATIC = "static"  # made static while tracing (torch pinned a guessed dim)


class AxisRole(StrEnum):
    """What an input axis means; a variable is named after its role, or after the first of
    its axes' roles in this order."""

    BATCH = "batch"
    SEQ = "seq"  # new tokens
    PAST_SEQ = "past_seq"  # a cache's length
    TOTAL_SEQ = "total_seq"  # a mask over the cache and the new tokens
    ENCODER_SEQ = "encoder_seq"
    HEIGHT = "height"
    WIDTH = "width"
    FRAMES = "frames"  # audio
    LENGTH = "length"  # a signal's: a 1-D convolution's input (batch, channels, length)
