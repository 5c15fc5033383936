"""What runs an exported graph on the flat leaves of a call: onnxruntime, the same with a
half-precision graph widened to float32 where its CPU provider lacks a kernel, onnx's reference
evaluator where onnxruntime cannot load even that, or the exported program itself
(``--export-target torch``).

onnxruntime's CPU provider lacks many float16/bfloat16 kernels (``Add``, ``Mul``, ``Where``) and
crashes natively on some half-precision graphs; such a graph runs widened (see :mod:`.widening`:
float32 inside each op, rounded at its outputs, as a half-precision kernel computes).  onnx's
``ReferenceEvaluator`` runs the rest, in numpy, slowly: a graph over :data:`MAX_REFERENCE_NODES`
nodes or :data:`MAX_REFERENCE_WEIGHTS` weights is not run by it.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils import _pytree

from ...compat.onnxruntime_text import kernel_lacked, lacks_kernel
from ...core.onnx_wire import element_types
from ...core.text import error_line
from ...core.vocabulary import Runtime
from ...observe.alignment import AlignedCalls
from .widening import widened

# onnx.TensorProto FLOAT16, BFLOAT16: onnxruntime's CPU provider crashes natively on some such graphs
HALF_PRECISION = frozenset({10, 16})
_TORCH_DTYPES = {10: torch.float16, 16: torch.bfloat16}
HALF_DTYPES = frozenset(_TORCH_DTYPES.values())
MAX_REFERENCE_NODES = 3_000  # nodes of a graph onnx's reference evaluator runs (numpy, node by node)
MAX_REFERENCE_WEIGHTS = 20_000_000  # values of its initializers


class RuntimeGap(Exception):
    """onnxruntime has no kernel for an op of the graph in its dtype (``NOT_IMPLEMENTED`` at
    session load, or a type error on a float16/bfloat16 input of an op at the graph's opset)."""

    def explain(self, dtype: torch.dtype | None) -> str:
        """The op and the dtype: ``Mul (opset 14, node node_mul_3) in bfloat16``."""
        in_dtype = f" in {str(dtype).removeprefix('torch.')}" if dtype is not None else ""
        return f"onnxruntime's CPUExecutionProvider has no kernel for {kernel_lacked(str(self))}{in_dtype}"


class NativeCrash(Exception):
    """onnxruntime died natively (a signal) loading the graph, in the process that probed it."""


class Unrunnable(Exception):
    """No runtime here runs the graph: why, and whether onnxruntime crashed natively on it."""

    def __init__(self, reason: str, crash: bool = False):
        super().__init__(reason)
        self.crash = crash


def onnx_runner(
    path: Path, dtype: torch.dtype | None, notes: list[str],
) -> OnnxRunner | WidenedRunner | ReferenceRunner:
    """onnxruntime's session for the graph, else (a kernel it lacks, a native crash on a half-
    precision graph) the graph widened to float32 in onnxruntime, else onnx's reference
    evaluator, with a note saying why; raises :class:`Unrunnable` when none can run it (a graph
    too large for the evaluator, an op it does not implement)."""
    try:
        probe_load(path)
        return OnnxRunner(path)
    except (RuntimeGap, NativeCrash) as gap:
        crash = isinstance(gap, NativeCrash)
        why = (f"onnxruntime crashed natively ({gap}) creating a session for it, in a process of its own"
               if crash else gap.explain(dtype))  # type: ignore[union-attr]  # a RuntimeGap otherwise
        try:
            widened_runner = WidenedRunner(path)
        except Exception as e:  # a graph onnx cannot infer, or onnxruntime cannot load widened
            why += f"; widened to float32 it cannot run either ({error_line(e)})"
        else:
            notes.append(f"run by onnxruntime in float32, each op's outputs rounded to their half-precision type (as "
                         f"a half-precision kernel computes): {why}")
            return widened_runner
        too_large = ReferenceRunner.too_large(path)
        if too_large:
            raise Unrunnable(f"{why}, and onnx's reference evaluator runs no graph of {too_large}", crash) from gap
        try:
            runner = ReferenceRunner(path)
        except Exception as e:  # an op the reference evaluator does not implement
            raise Unrunnable(f"{why}, and onnx's reference evaluator cannot run it ({error_line(e)})", crash) from e
        notes.append(f"run by onnx's reference evaluator: {why}")
        return runner


_LOAD = (
    "import sys, onnxruntime\n"
    "options = onnxruntime.SessionOptions()\noptions.log_severity_level = 3\n"
    "try:\n    onnxruntime.InferenceSession(sys.argv[1], options, providers=['CPUExecutionProvider'])\n"
    "except Exception:\n    pass\n"
)


def probe_load(path: Path) -> None:
    """Load a half-precision graph in a fresh process before this one does: onnxruntime 1.32
    segfaults creating a session for some (an fp16 ``nn.MultiheadAttention``), which would end
    the pytest session and every other model's verdict.  Raises :class:`NativeCrash`."""
    if not _half_precision(path):
        return
    completed = subprocess.run([sys.executable, "-c", _LOAD, str(path)], capture_output=True, timeout=600)
    if completed.returncode < 0:
        raise NativeCrash(signal.Signals(-completed.returncode).name)


def _half_precision(path: Path) -> bool:
    """Whether the graph holds a half-precision value, read without parsing its weights (timm's
    42 graphs, 733 MB: 0.13 s, 0.3-0.5 s parsed whole)."""
    return bool(element_types(path) & HALF_PRECISION)


class OnnxRunner:
    """An onnxruntime session fed with the flat leaves of an aligned call."""

    runtime = Runtime.ONNXRUNTIME

    def __init__(self, onnx_model_or_path: Any):
        import onnxruntime

        if hasattr(onnx_model_or_path, "model_proto"):  # torch.onnx.ONNXProgram
            onnx_model_or_path = onnx_model_or_path.model_proto
        if not isinstance(onnx_model_or_path, (str, Path)):
            onnx_model_or_path = onnx_model_or_path.SerializeToString()
        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3
        # no memory arena: a model's sessions stay open while its check lasts (a later plan may run
        # on an earlier graph), and each arena keeps what its largest variation needed (DINOv2's
        # largest check peaked at 2.44 GB with them, 1.95 GB without)
        options.enable_cpu_mem_arena = False
        # the check's share of the cores (see runner.check_all), and no thread spinning between
        # runs: parallel checks would otherwise each start a pool over every core
        options.intra_op_num_threads = torch.get_num_threads()
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        try:
            self.session = onnxruntime.InferenceSession(
                str(onnx_model_or_path) if isinstance(onnx_model_or_path, Path) else onnx_model_or_path,
                options, providers=["CPUExecutionProvider"],
            )
        except Exception as e:
            if lacks_kernel(str(e)):
                raise RuntimeGap(str(e)) from e
            raise
        self.input_names = [i.name for i in self.session.get_inputs()]

    def __call__(self, leaves: Sequence[Any]) -> list[np.ndarray]:
        feeds = dict(zip(self.input_names, _tensors(leaves, len(self.input_names))))
        return self.session.run(None, {name: t.detach().cpu().numpy() for name, t in feeds.items()})


class WidenedRunner:
    """onnxruntime running a half-precision graph widened to float32 (see :mod:`.widening`): fed the
    flat leaves of an aligned call widened, its outputs narrowed to the types the graph declares."""

    runtime = Runtime.WIDENED

    def __init__(self, onnx_model_or_path: Any):
        import onnx

        model = onnx_model_or_path
        if isinstance(model, (str, Path)):
            model = onnx.load(str(model))
        wide, types = widened(model)
        self.session = OnnxRunner(wide)
        self.input_names = self.session.input_names
        self.output_dtypes = [_TORCH_DTYPES.get(t) for t in types]

    def __call__(self, leaves: Sequence[Any]) -> list[torch.Tensor]:
        wide = [t.float() if isinstance(t, torch.Tensor) and t.dtype in HALF_DTYPES else t for t in leaves]
        outputs = [_to_torch(np.asarray(o)) for o in self.session(wide)]
        return [o.to(dtype) if dtype is not None else o for o, dtype in zip(outputs, self.output_dtypes)]


class ReferenceRunner:
    """onnx's ``ReferenceEvaluator`` fed with the flat leaves of an aligned call, half precision
    included (bfloat16 through ``ml_dtypes``); its outputs as torch tensors."""

    runtime = Runtime.REFERENCE

    def __init__(self, onnx_model_or_path: Any):
        import onnx
        from onnx.reference import ReferenceEvaluator

        model = onnx_model_or_path
        if isinstance(model, (str, Path)):
            model = onnx.load(str(model))
        self.evaluator = ReferenceEvaluator(model, new_ops=[_gather_elements()])
        self.input_names = [i.name for i in model.graph.input]

    @staticmethod
    def too_large(path: Path) -> str:
        """Why the reference evaluator does not run the graph (its size), or ``""``."""
        import onnx

        graph = onnx.load(str(path), load_external_data=False).graph
        nodes = len(graph.node)
        weights = sum(int(np.prod(t.dims)) for t in graph.initializer)
        if nodes > MAX_REFERENCE_NODES:
            return f"{nodes} nodes, over the reference evaluator's limit of {MAX_REFERENCE_NODES}"
        if weights > MAX_REFERENCE_WEIGHTS:
            return f"{weights} weights, over the reference evaluator's limit of {MAX_REFERENCE_WEIGHTS}"
        return ""

    def __call__(self, leaves: Sequence[Any]) -> list[torch.Tensor]:
        feeds = dict(zip(self.input_names, _tensors(leaves, len(self.input_names))))
        outputs = self.evaluator.run(None, {name: _to_numpy(t) for name, t in feeds.items()})
        return [_to_torch(np.asarray(o)) for o in outputs]


def _gather_elements() -> type:
    """``GatherElements`` done by numpy's ``take_along_axis``: the reference evaluator's own fails
    on some shapes (onnx 1.23: "cannot reshape array of size 1 into shape (1,7)", a BERT's
    position ids)."""
    from onnx.reference.op_run import OpRun

    class GatherElements(OpRun):
        def _run(self, data: np.ndarray, indices: np.ndarray, axis: int = 0) -> tuple[np.ndarray]:
            indices = np.where(indices < 0, indices + data.shape[axis], indices)
            return (np.take_along_axis(data, indices, axis=axis),)

    return GatherElements


def _tensors(leaves: Sequence[Any], expected: int) -> list[torch.Tensor]:
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    if len(tensors) != expected:
        raise ValueError(f"the ONNX model has {expected} inputs, the call gives {len(tensors)} tensors")
    return tensors


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """numpy has no bfloat16: ml_dtypes' (onnx's) reads its bits."""
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def _to_torch(array: np.ndarray) -> torch.Tensor:
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.require(array, requirements="C"))  # a 0-d array stays one (not ascontiguousarray's)


def program_runner(
    program: torch.export.ExportedProgram, aligned: AlignedCalls, constants: bool = True
) -> Callable[[Sequence[Any]], list]:
    """Run an ExportedProgram's module on flat leaves (``--export-target torch``); ``constants``
    false when the program was exported with its constant arguments bound."""
    module = program.module()

    def run(leaves: Sequence[Any]) -> list:
        args, kwargs = aligned.split_arguments(leaves, constants=constants)
        return [t for t in _pytree.tree_leaves(module(*args, **kwargs)) if isinstance(t, torch.Tensor)]

    return run
