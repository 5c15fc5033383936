"""The text of ``repro.py``: its skeleton (:data:`SCRIPT`) and the functions each :class:`Flow`
adds to it, by what the script reruns."""

from __future__ import annotations

from ..core.vocabulary import StrEnum, Target

SCRIPT = '''\
"""Reproduces the failure of {model} at stage {stage!r}, found by pytest-exportobs.

`python repro.py` exits with 1 when the failure reproduces. Beside it: weights.pt (state_dict),
inputs.pt (flat inputs of the failing call and their structure){config_file}.
"""

{imports}

HERE = pathlib.Path(__file__).resolve().parent
# one name per dynamic dimension, in the structure of the arguments
DYNAMIC_SHAPES = {dynamic_shapes}
{constants}


def build_model() -> torch.nn.Module:
    """The model, its weights not loaded yet."""
{build}


def load_model() -> torch.nn.Module:
    model = build_model()
    model.load_state_dict(torch.load(HERE / "weights.pt", weights_only=True), assign=True)
{method}    return model.eval()


def load_call() -> tuple[tuple, dict]:
    """(args, kwargs) of the failing call, loaded anew each time: models update caches in place."""
    saved = torch.load(HERE / "inputs.pt", weights_only=True)
    return _pytree.tree_unflatten(saved["leaves"], _pytree.treespec_loads(saved["spec"]))

{functions}

if __name__ == "__main__":
    with {context}torch.no_grad():
        sys.exit(main())
'''

_EXPORT = '''
def export(model: torch.nn.Module, args: tuple, kwargs: dict) -> torch.export.ExportedProgram:
    """torch.export as the check captured the model, every named dimension Dim.DYNAMIC (torch
    finds the equal ones)."""
    dynamic_shapes = _pytree.tree_map(lambda name: torch.export.Dim.DYNAMIC, DYNAMIC_SHAPES)
    with torch.fx.experimental._config.patch(backed_size_oblivious=SIZE_OBLIVIOUS):
        return torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes, strict=STRICT)
'''

_MAIN_EXPORT = '''
def main() -> int:
    export(load_model(), *load_call())
    print("torch.export succeeded: the failure does not reproduce")
    return 0
'''

_RUN_PROGRAM = '''
def run_exported(model: torch.nn.Module, args: tuple, kwargs: dict) -> list:
    """Outputs of the program captured by torch.export."""
    return _pytree.tree_leaves(export(model, args, kwargs).module()(*args, **kwargs))
'''

_RUN_ONNX = '''
ONNX_PATH = HERE / "model.onnx"


def export_onnx(model: torch.nn.Module, args: tuple, kwargs: dict) -> torch.onnx.ONNXProgram:
    """Export to ONNX beside this script the program captured as the check captured it, and check
    the model."""
    onnx_program = torch.onnx.export(export(model, args, kwargs), dynamo=True)
    onnx_program.save(str(ONNX_PATH))
    onnx.checker.check_model(str(ONNX_PATH))
    return onnx_program


def run_onnx(args: tuple, kwargs: dict) -> list:
    """Run the ONNX model with onnxruntime."""
    session = onnxruntime.InferenceSession(str(ONNX_PATH), providers=["CPUExecutionProvider"])
    tensors = [t.numpy() for t in _pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    return session.run(None, dict(zip([i.name for i in session.get_inputs()], tensors)))
'''

_MAIN_VERIFY = '''
def main() -> int:
    model = load_model()
    actual = run_exported(model, *load_call())
    args, kwargs = load_call()
    result = compare(actual, _pytree.tree_leaves(model(*args, **kwargs)), Tolerance(ATOL, RTOL))
    print(f"max abs diff {result.max_abs:.3g}, max rel diff {result.max_rel:.3g}: "
          f"{result.detail or 'within tolerance'}")
    return 0 if result.ok else 1
'''

_MAIN_ONNX = '''
def main() -> int:
    """``--localize``: on a mismatch, also name the first ONNX node that differs from torch on
    torch's own values for its inputs, and the source line behind it."""
    model = load_model()
    onnx_program = export_onnx(model, *load_call())
    actual = run_onnx(*load_call())
    args, kwargs = load_call()
    expected = _pytree.tree_leaves(model(*args, **kwargs))
    result = compare(actual, expected, Tolerance(ATOL, RTOL))
    print(f"max abs diff {result.max_abs:.3g}, max rel diff {result.max_rel:.3g}: "
          f"{result.detail or 'within tolerance'}")
    if "--localize" in sys.argv[1:] and not result.ok:
        tensors = [t for t in _pytree.tree_leaves(load_call()) if isinstance(t, torch.Tensor)]
        found = localize(onnx_program.exported_program, ONNX_PATH, tensors, Tolerance(ATOL, RTOL), expected=expected)
        print(found.table())
    return 0 if result.ok else 1
'''

# ExecuTorch plans memory for the largest size: every named dimension bounded as the check bounded it
_EXPORT_BOUNDED = _EXPORT.replace(
    "every named dimension Dim.DYNAMIC", "every named dimension Dim.DYNAMIC up to\n    its UPPER_BOUNDS",
).replace(
    "lambda name: torch.export.Dim.DYNAMIC,", "lambda name: torch.export.Dim.DYNAMIC(max=UPPER_BOUNDS.get(name)),",
)

_RUN_EXECUTORCH = '''
PTE_PATH = HERE / "model.pte"


def lower(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Lower the program to ExecuTorch as the check did (the edge dialect, XNNPACK's partitions)
    and write model.pte beside this script."""
    edge = to_edge_transform_and_lower(export(model, args, kwargs), partitioner=[XnnpackPartitioner()])
    PTE_PATH.write_bytes(edge.to_executorch().buffer)


def run_exported(model: torch.nn.Module, args: tuple, kwargs: dict) -> list:
    """Outputs of model.pte, lowered from the program, run by ExecuTorch's runtime."""
    lower(model, args, kwargs)
    method = Runtime.get().load_program(PTE_PATH).load_method("forward")
    return list(method.execute([t for t in _pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]))
'''


class Flow(StrEnum):
    """What repro.py reruns: torch.export only, torch.export and the program, ONNX and onnxruntime,
    or the lowering to ExecuTorch and its runtime."""

    TORCH_EXPORT = "torch.export"
    PROGRAM = "program"
    ONNX = "onnx"
    EXECUTORCH = "executorch"


FUNCTIONS = {
    Flow.TORCH_EXPORT: (_EXPORT, _MAIN_EXPORT),
    Flow.PROGRAM: (_EXPORT, _RUN_PROGRAM, _MAIN_VERIFY),
    Flow.ONNX: (_EXPORT, _RUN_ONNX, _MAIN_ONNX),
    Flow.EXECUTORCH: (_EXPORT_BOUNDED, _RUN_EXECUTORCH, _MAIN_VERIFY),
}
FLOWS = {Target.TORCH: Flow.PROGRAM, Target.ONNX: Flow.ONNX, Target.EXECUTORCH: Flow.EXECUTORCH}

EXECUTORCH_IMPORTS = [
    "from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner",
    "from executorch.exir import to_edge_transform_and_lower", "from executorch.runtime import Runtime"]
