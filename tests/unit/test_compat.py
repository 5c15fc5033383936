"""The compatibility layer against the installed torch, onnxruntime and xdist, and its parsers on
messages captured from every supported torch: a release that moves or changes one fails here,
by name, before it fails a model's check somewhere else."""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import json
import logging
import os
import subprocess
import sys
import threading
import traceback
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple

import onnx
import pytest
import sympy
import torch
from torch._subclasses.fake_impls import get_fast_op_impls
from torch.utils._traceback import CapturedTraceback

from pytest_exportobs.compat.hypothesis_private import collect_local_constants
from pytest_exportobs.compat.lean_tracing import dispatches_cached, lean_tracing, sympy_caches_widened
from pytest_exportobs.compat.onnxruntime_text import failing_node, kernel_lacked, lacks_kernel
from pytest_exportobs.compat.onnxscript_private import rules_tried_by_root_op
from pytest_exportobs.compat.torch_private import (
    DEFERRED_ASSERTS,
    ExportUserError,
    FakeTensor,
    deregister_pytree_node,
    drop_runtime_asserts,
    flat_call_spec,
    import_export_machinery,
    onnx_registry,
    prepare_for_onnx,
    rename_onnx_axes,
    rnn_while_loops,
    size_oblivious,
    sympy_functions,
    to_onnx_program,
    unchecked_module,
    upper_bounded,
)
from pytest_exportobs.compat.torch_text import (
    SHAPES_LOGGER,
    guard_added,
    pinned_sizes,
    quoted_frames,
    raising_call,
    rejects_dims,
    suggested_fixes,
    symbol_created,
    symbol_replaced,
    translated_op,
    unsupported_ops,
)
from pytest_exportobs.core.vocabulary import Stage
from pytest_exportobs.engine.base.reasons import one_line_reason


class Doubling(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) * 2


class LargeBatchesContiguous(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= 64:  # torch bounds the batch to 63
            x = x.contiguous()
        return x * 2


def test_an_unchecked_module_runs_sizes_its_programs_guards_reject() -> None:
    """A batch of 1 (the range starts at 2) and one past torch's bound, as the ONNX graph runs them."""
    program = torch.export.export(LargeBatchesContiguous(), (torch.randn(3, 4),),
                                  dynamic_shapes=({0: torch.export.Dim.DYNAMIC},))
    with pytest.raises(Exception):  # noqa: B017  torch's guard error type differs between releases
        program.module()(torch.randn(64, 4))
    unchecked = unchecked_module(program)
    for batch in (1, 64):
        torch.testing.assert_close(unchecked(torch.ones(batch, 4)), torch.full((batch, 4), 2.0))


class NotThreeRows(torch.nn.Module):
    """Takes any number of rows but 3 (it says so to torch), gives a dict and a tuple."""

    def forward(self, x: torch.Tensor, extra: dict[str, torch.Tensor]) -> dict[str, Any]:
        torch._check(x.shape[0] != 3)
        return {"y": x * extra["scale"], "z": (x + 1,)}


@pytest.mark.skipif(not DEFERRED_ASSERTS, reason="this torch defers no guard as a runtime assert")
def test_a_program_is_bounded_and_flat_only_within_the_lowerings_contexts() -> None:
    program = torch.export.export(NotThreeRows(), (torch.randn(4, 3), {"scale": torch.randn(3)}),
                                  dynamic_shapes=({0: torch.export.Dim.DYNAMIC}, {"scale": None}),
                                  prefer_deferred_runtime_asserts_over_guards=True)
    (rows,) = [symbol for symbol in program.range_constraints if str(symbol).startswith("s")]
    ranges, specs = dict(program.range_constraints), (program.call_spec.in_spec, program.call_spec.out_spec)
    with upper_bounded(program, {str(rows): 8}):
        assert (program.range_constraints[rows].lower, program.range_constraints[rows].upper) == (2, 8)
    with flat_call_spec(program):
        assert program.call_spec.in_spec == torch.utils._pytree.tree_structure(((0, 1), {}))
        assert program.call_spec.out_spec == torch.utils._pytree.tree_structure((0, 1))
    assert dict(program.range_constraints) == ranges
    assert (program.call_spec.in_spec, program.call_spec.out_spec) == specs
    asserts = [node for node in program.graph.nodes if node.target == torch.ops.aten._assert_scalar.default]
    assert asserts
    drop_runtime_asserts(program)
    assert [node for node in program.graph.nodes if node.target == torch.ops.aten._assert_scalar.default] == []
    x, scale = torch.randn(6, 3), torch.randn(3)
    assert torch.equal(program.module()(x, {"scale": scale})["y"], x * scale)


def test_the_exporters_two_steps_and_axis_renaming_make_a_valid_onnx_model() -> None:
    import_export_machinery()
    batch = torch.export.Dim("batch")
    program = torch.export.export(Doubling(), (torch.randn(3, 4),), dynamic_shapes=({0: batch},))
    onnx_program = to_onnx_program(prepare_for_onnx(program))
    symbol = str(onnx_program.model.graph.inputs[0].shape[0])  # torch's symbol (s77)
    rename_onnx_axes(onnx_program.model, {symbol: "batch_size"})
    proto = onnx_program.model_proto
    onnx.checker.check_model(proto)
    (graph_input,) = proto.graph.input
    assert [d.dim_param or d.dim_value for d in graph_input.type.tensor_type.shape.dim] == ["batch_size", 4]
    assert onnx_registry() is onnx_registry()  # built once per process


class Reshaping(torch.nn.Module):
    """Ops onnxscript's rewrite rules merge: two unsqueezes, two reshapes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x.unsqueeze(0).unsqueeze(0).reshape(-1, 4).reshape(-1, 12), dim=-1)


def test_rules_tried_by_their_root_op_rewrite_the_same_graph_with_fewer_tries(monkeypatch: pytest.MonkeyPatch) -> None:
    from onnxscript.rewriter._rewrite_rule import RewriteRule

    tries = Counter[str]()
    try_rewrite = RewriteRule.try_rewrite

    def counted(rule: RewriteRule, *args: Any, **kwargs: Any) -> Any:
        tries[tries["mode"]] += 1
        return try_rewrite(rule, *args, **kwargs)

    monkeypatch.setattr(RewriteRule, "try_rewrite", counted)
    program = torch.export.export(Reshaping(), (torch.randn(2, 3, 4),),
                                  dynamic_shapes=({0: torch.export.Dim("batch")},))
    translated = to_onnx_program(prepare_for_onnx(program))
    ops = Counter(node.op_type for node in translated.model.graph)
    optimized = {}
    for mode in ("every rule", "by root op"):
        onnx_program = to_onnx_program(prepare_for_onnx(program))
        tries["mode"] = mode  # type: ignore[assignment]
        with rules_tried_by_root_op() if mode == "by root op" else contextlib.nullcontext():
            onnx_program.optimize()
        optimized[mode] = onnx_program.model_proto.SerializeToString()
    assert RewriteRule.try_rewrite is counted
    assert optimized["by root op"] == optimized["every rule"]
    rewritten = Counter(node.op_type for node in onnx.load_from_string(optimized["every rule"]).graph.node)
    assert rewritten["Reshape"] < ops["Reshape"] and rewritten["Unsqueeze"] < ops["Unsqueeze"]  # rules applied
    assert 0 < tries["by root op"] < tries["every rule"] / 5


class Promoting(torch.nn.Module):
    """A linear layer, a layer norm, a difference along rows (which torch.onnx decomposes) and
    an integer tensor added to a float one."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.norm = torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)

    def forward(self, x: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        return torch.diff(self.norm(self.linear(x)), dim=1) + steps


def test_the_onnx_preparation_is_torch_onnxs_own_with_its_decomposition_table_built_once() -> None:
    from torch.onnx._internal.exporter import _core

    import_export_machinery()

    def traced() -> torch.export.ExportedProgram:
        return torch.export.export(Promoting(), (torch.randn(3, 4), torch.arange(3)),
                                   dynamic_shapes=({0: torch.export.Dim("batch")}, None))

    def targets(program: torch.export.ExportedProgram) -> list[str]:
        return [str(node.target) for node in program.graph.nodes]

    # decomposed as torch.onnx decomposes (not taken as traced), the second with the table built by the first
    ours = [targets(prepare_for_onnx(traced(), as_traced=False)) for _ in range(2)]
    theirs = targets(_core._prepare_exported_program_for_export(traced(), registry=onnx_registry()))
    assert ours[0] == ours[1] == theirs
    assert "prims.convert_element_type.default" in theirs  # the integer tensor promoted explicitly
    assert "aten.diff.default" not in theirs


def test_hypothesis_reads_the_local_modules_constants_once_for_the_modules_loaded() -> None:
    import sys

    from hypothesis.internal.conjecture import providers

    collect_local_constants()

    assert providers._sys_modules_len == len(sys.modules)  # the next draw of a constant reads nothing again
    assert {id(module) for module in list(sys.modules.values())} <= providers._seen_modules


def test_a_pytree_node_deregistered_is_a_leaf_again_and_registers_again() -> None:
    class Pair:
        def __init__(self, a: Any, b: Any):
            self.a, self.b = a, b

    import torch.utils._pytree as pytree

    for _ in range(2):
        pytree.register_pytree_node(Pair, lambda p: ([p.a, p.b], None), lambda values, _: Pair(*values))
        assert pytree.tree_leaves(Pair(1, 2)) == [1, 2]
        deregister_pytree_node(Pair)
        assert len(pytree.tree_leaves(Pair(1, 2))) == 1
    assert all(args[0] is not Pair for args, _ in pytree._cxx_pytree_pending_imports)


def test_the_functions_of_torchs_size_conditions_are_found_by_name() -> None:
    """What an exported program's runtime asserts are made of (a patch grid: ``FloorDiv``)."""
    functions = sympy_functions()
    assert {"FloorDiv", "PythonMod", "CleanDiv"} <= functions.keys()
    side = sympy.Symbol("side", integer=True)
    assert functions["FloorDiv"](side, 5).xreplace({side: sympy.Integer(24)}) == 4


def test_size_oblivious_keeps_a_size_of_one_dynamic() -> None:
    batch = torch.export.Dim("batch")
    with size_oblivious():
        program = torch.export.export(Doubling(), (torch.randn(1, 4),), dynamic_shapes=({0: batch},))
    (placeholder,) = [n for n in program.graph.nodes if n.op == "placeholder"]
    assert not isinstance(placeholder.meta["val"].shape[0], int)


def test_an_lstm_exported_in_the_rnn_context_keeps_its_sequence_dynamic() -> None:
    lstm = torch.nn.LSTM(4, 3, batch_first=True).eval()
    seq = torch.export.Dim("seq")
    with rnn_while_loops(), size_oblivious():
        program = torch.export.export(lstm, (torch.randn(2, 5, 4),), dynamic_shapes=({1: seq},),
                                      prefer_deferred_runtime_asserts_over_guards=DEFERRED_ASSERTS)
    got = program.module()(torch.randn(2, 7, 4))[0]
    assert got.shape == (2, 7, 3)


class Attending(torch.nn.Module):
    """Attention of a sequence over itself and a longer memory: sizes multiplied, concatenated."""

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        keys = torch.cat([memory, x], dim=1)
        scores = torch.softmax(x @ keys.transpose(1, 2) / x.shape[-1] ** 0.5, dim=-1)
        return (scores @ keys).reshape(x.shape[0], -1)


class Outer(torch.nn.Module):
    """:class:`Attending` called from another module (a stack of two ``forward`` frames) on a
    normalized sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.inner = Attending()

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return self.inner(self.norm(x), memory).relu()


def _fake_dispatches() -> int:
    from torch._subclasses.fake_tensor import FakeTensorMode

    info = FakeTensorMode.cache_info()
    return info.hits + info.misses


_CACHE_DEPTHS = """
import sympy
from sympy.core.operations import AssocOp
from pytest_exportobs.compat.lean_tracing import lean_tracing
before = AssocOp.__new__.cache_info().maxsize
with lean_tracing():
    pass
x = sympy.Symbol("x", integer=True)
total = x + 2 * x + 1
assert x + 2 * x + 1 is total  # served by the cache
print(before, AssocOp.__new__.cache_info().maxsize, AssocOp.__new__.cache_info().hits > 0)
"""


@pytest.mark.parametrize(("environment", "depths"),
                         [({}, "1000 50000 True"), ({"SYMPY_CACHE_SIZE": "300"}, "300 300 True")])
def test_lean_tracing_widens_sympys_caches_unless_the_user_sized_them(environment: dict[str, str], depths: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SYMPY_CACHE_SIZE"} | environment
    done = subprocess.run([sys.executable, "-c", _CACHE_DEPTHS], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.split() == depths.split()


def test_sympys_widened_caches_return_what_the_functions_compute() -> None:
    sympy_caches_widened()
    sympy_caches_widened()  # once is enough: a second call changes nothing
    from sympy.core.cache import CACHE

    cached = [c for c in CACHE if c.__name__ == "__new__" and c.__qualname__ == "AssocOp.__new__"]
    assert [c.cache_info().maxsize for c in cached] == [50_000]
    side = sympy.Symbol("side", integer=True, positive=True)
    padded = (side + 1) // 2 * 2
    assert padded.subs(side, 7) == 8 and sympy.expand(padded + side - side) == padded


def test_lean_tracing_traces_the_same_program_without_dispatch_cache_pytests_handlers_or_symbolized_stacks() -> None:
    trace_log = logging.getLogger("torch.__trace")
    pytests = {h for h in trace_log.handlers if type(h).__module__ == "_pytest.logging"}
    assert pytests, "pytest's logging plugin attaches its handlers to torch's structured trace"
    own = logging.NullHandler()
    trace_log.addHandler(own)
    batch, seq, past = torch.export.Dim("batch"), torch.export.Dim("seq"), torch.export.Dim("past")
    example = (torch.randn(2, 3, 8), torch.randn(2, 5, 8))
    dims = ({0: batch, 1: seq}, {0: batch, 1: past})

    def traced() -> torch.export.ExportedProgram:
        return torch.export.export(Outer(), example, dynamic_shapes=dims)

    try:
        cached, before = traced(), _fake_dispatches()
        with lean_tracing():
            assert not pytests & set(trace_log.handlers) and own in trace_log.handlers
            lean = traced()
            assert _fake_dispatches() == before  # no fake dispatch went through the cache
        assert set(trace_log.handlers) >= pytests | {own}
        assert torch._dynamo.config.fake_tensor_cache_enabled
        assert torch.fx.proxy.CapturedTraceback is CapturedTraceback
    finally:
        trace_log.removeHandler(own)
    assert lean.graph_module.print_readable(print_output=False) == cached.graph_module.print_readable(
        print_output=False)
    assert _values(lean) == _values(cached)
    assert torch.ops.aten.native_layer_norm.default not in get_fast_op_impls()
    assert str(lean.range_constraints) == str(cached.range_constraints)
    traces = [node.meta.get("stack_trace") for node in lean.graph.nodes]
    assert traces == [node.meta.get("stack_trace") for node in cached.graph.nodes]  # read, not symbolized
    assert sum((trace or "").count("in forward\n") == 2 for trace in traces) >= 3  # Outer's, then Attending's
    assert lean.module()(torch.randn(3, 4, 8), torch.randn(3, 6, 8)).shape == (3, 4 * 8)
    before = _fake_dispatches()
    dispatches_cached(lean).run_decompositions()  # traced again on the trace's fake values
    assert _fake_dispatches() > before


def _values(program: torch.export.ExportedProgram) -> list[tuple[str, ...]]:
    """Each node's value as text: sizes, strides, dtype."""
    return [(node.name, *(str(f(v)) for f in (torch.Tensor.size, torch.Tensor.stride, lambda t: t.dtype)))
            for node in program.graph.nodes if isinstance(v := node.meta.get("val"), torch.Tensor)]


@pytest.mark.parametrize("op", [torch.ops.aten.native_layer_norm.default, torch.ops.aten.addmm.default])
def test_the_ops_sized_directly_are_those_fake_tensors_decompose(op: torch._ops.OpOverload) -> None:
    from torch._decomp import decomposition_table, meta_table

    assert op in decomposition_table and op not in meta_table


class Fake(NamedTuple):
    """A fake tensor to make: its size, its dynamic axes, its dtype."""

    shape: tuple[int, ...]
    dynamic: tuple[int, ...]
    dtype: torch.dtype = torch.float32


def _fake_run(op: torch._ops.OpOverload, lean: bool, arguments: list[Any], kwargs: dict[str, Any]) -> tuple[
        list[tuple[str, ...]], list[str], int]:
    """``op`` run on ``arguments`` (each :class:`Fake` made a fake tensor): each output's size,
    strides, dtype and device, the guards made and the number of ops dispatched to the fakes."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env)
    dispatched, ops = mode.dispatch, []
    mode.dispatch = lambda func, *rest: ops.append(func) or dispatched(func, *rest)  # type: ignore[method-assign]

    def made(argument: Any) -> Any:
        if not isinstance(argument, Fake):
            return argument
        sizes = [DimDynamic.DYNAMIC if i in argument.dynamic else DimDynamic.STATIC for i in range(len(argument.shape))]
        return mode.from_tensor(torch.ones(argument.shape, dtype=argument.dtype),
                                symbolic_context=StatelessSymbolicContext(dynamic_sizes=sizes))

    fakes = [made(argument) for argument in arguments]
    with lean_tracing() if lean else contextlib.nullcontext(), mode:
        outputs = op(*fakes, **kwargs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    return [(str(o.shape), str(o.stride()), str(o.dtype), str(o.device)) for o in outputs], [
        str(guard.expr) for guard in shape_env.guards], len(ops)


_NORM, _ADDMM = torch.ops.aten.native_layer_norm.default, torch.ops.aten.addmm.default
_ROW, _WEIGHTS = Fake((32,), ()), Fake((16, 24), ())


@pytest.mark.parametrize(("op", "arguments", "kwargs", "direct"), [
    (_NORM, [Fake((2, 7, 32), (0, 1)), [32], _ROW, _ROW, 1e-5], {}, True),
    (_NORM, [Fake((2, 7, 32), (1,), torch.float16), [32], _ROW, _ROW, 1e-5], {}, True),  # in float, cast back
    (_NORM, [Fake((2, 7, 4, 8), (0, 1), torch.bfloat16), [4, 8], Fake((4, 8), (), torch.bfloat16), None, 1e-5],
     {}, True),
    (_NORM, [Fake((2, 1, 32), (0,)), [32], None, None, 1e-5], {}, True),
    (_NORM, [Fake((2, 7, 32), (0, 2)), [32], _ROW, _ROW, 1e-5], {}, False),  # a dynamic normalized dim
    (_ADDMM, [Fake((24,), ()), Fake((14, 16), (0,)), _WEIGHTS], {}, True),
    (_ADDMM, [Fake((1, 24), (), torch.float16), Fake((14, 16), (0,), torch.float16), Fake((16, 24), (), torch.float16)],
     {"beta": 0.5, "alpha": 2}, True),
    (_ADDMM, [Fake((1,), ()), Fake((3, 16), (0,)), Fake((16, 1), ())], {}, True),  # one column
    (_ADDMM, [Fake((24,), ()), Fake((14, 16), (0, 1)), Fake((16, 24), (0,))], {}, False),  # a dynamic inner size
    (_ADDMM, [Fake((14, 24), (0,)), Fake((14, 16), (0,)), _WEIGHTS], {}, False),  # a bias of rows
    (_ADDMM, [Fake((24,), (), torch.int64), Fake((14, 16), (0,), torch.int64), Fake((16, 24), (), torch.int64)],
     {}, False),
])
def test_sizes_made_directly_are_those_of_torchs_decomposition_without_its_guards(
    op: torch._ops.OpOverload, arguments: list[Any], kwargs: dict[str, Any], direct: bool,
) -> None:
    lean, lean_guards, lean_ops = _fake_run(op, True, arguments, kwargs)
    reference, reference_guards, reference_ops = _fake_run(op, False, arguments, kwargs)
    assert lean == reference
    assert reference_ops > 2  # the decomposition's ops: var_mean, rsqrt, mm, mul, add...
    if direct:  # the op itself only
        assert (lean_guards, lean_ops) == ([], 1)
    else:
        assert (lean_guards, lean_ops) == (reference_guards, reference_ops)
    assert op not in get_fast_op_impls()


def _stacks() -> tuple[list[tuple[str, int, str]], ...]:
    """The stack as torch's tracer reads it at a node (whole, then its summary), and as Python's
    ``traceback`` reads it; outermost first."""
    read, python = torch.fx.proxy.CapturedTraceback.extract(), traceback.extract_stack()
    return tuple([(f.filename, f.lineno, f.name) for f in frames]  # type: ignore[attr-defined]
                 for frames in (read.frames[::-1], read.summary(), python))


class Reading(torch.nn.Module):
    def forward(self) -> tuple[list[tuple[str, int, str]], ...]:
        return _stacks()


def anchored_call(module: torch.nn.Module) -> Any:
    return module()


def test_stacks_read_in_a_lean_block_are_pythons_summarized_from_the_outermost_forward_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    code = anchored_call.__code__
    monkeypatch.setattr(torch.fx.proxy, "_STACK_TRACE_ANCHORS", {(code.co_filename, code.co_name)})
    threaded: list[Any] = []
    with lean_tracing():
        whole, summary, python = anchored_call(Reading())
        thread = threading.Thread(target=lambda: threaded.extend(_stacks()))
        thread.start()
        thread.join()
    assert whole == python and len(whole) > 20  # pytest's frames, read once
    forward = next(i for i, frame in enumerate(python) if frame[2] == "forward")
    assert summary == [next(frame for frame in python if frame[2] == "anchored_call"), *python[forward:]]
    assert threaded[0] == threaded[2] and threaded[0][-3][2] == "run"  # another thread's stack, read whole
    assert threaded[1] == []  # no forward there


def test_rejected_dims_raise_the_user_error_whose_suggested_fixes_are_parsed() -> None:
    class FixedBatch(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.reshape(3, -1)

    with pytest.raises(ExportUserError, match="Constraints violated") as info:
        torch.export.export(FixedBatch(), (torch.randn(3, 4),), dynamic_shapes=({0: torch.export.Dim("batch")},))
    assert suggested_fixes(info.value.msg) == [("batch", "3")]


def test_fake_tensors_are_the_class_torch_traces_with() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert isinstance(torch.empty(2, 3), FakeTensor)


class ValueCheck(torch.nn.Module):
    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if labels.max() >= 5:
            raise ValueError("labels out of range")
        return x * 2


def test_the_call_torch_says_raised_is_read_from_its_message() -> None:
    with pytest.raises(Exception, match="Could not guard on data-dependent expression") as info:
        torch.export.export(ValueCheck(), (torch.randn(2, 3), torch.tensor([1, 2])))
    file, line, code = raising_call(str(info.value))
    assert (Path(file).name, code) == ("test_compat.py", "if labels.max() >= 5:")
    assert Path(file).read_text().splitlines()[line - 1].strip() == code


def test_a_failure_in_a_models_installed_package_names_the_models_line(tmp_path: Path) -> None:
    installed = tmp_path / "site-packages" / "vendor_models.py"  # as transformers' modeling files are
    installed.parent.mkdir()
    installed.write_text(inspect.getsource(ValueCheck).replace("ValueCheck", "VendorModel"))
    spec = importlib.util.spec_from_file_location("vendor_models", installed)
    module = importlib.util.module_from_spec(spec)
    module.torch = torch
    spec.loader.exec_module(module)
    with pytest.raises(Exception) as info:
        torch.export.export(module.VendorModel(), (torch.randn(2, 3), torch.tensor([1, 2])))
    reason = one_line_reason(Stage.TORCH_EXPORT, info.value)
    assert reason.endswith("vendor_models.py:3: if labels.max() >= 5:)"), reason


# -- the parsers on messages captured from every supported torch (tests/unit/messages/capture.py) --

CAPTURED = sorted((Path(__file__).parent / "messages").glob("torch-*.json"))


def record(message: str, args: list[Any]) -> logging.LogRecord:
    return logging.LogRecord(SHAPES_LOGGER, logging.INFO, "symbolic_shapes.py", 1, message, tuple(args), None)


@pytest.fixture(params=CAPTURED, ids=[p.stem for p in CAPTURED])
def captured(request: pytest.FixtureRequest) -> dict[str, Any]:
    return json.loads(request.param.read_text())


def test_messages_of_the_oldest_and_newest_supported_torch_are_captured() -> None:
    assert {p.stem for p in CAPTURED} >= {"torch-2.13.0", "torch-2.15.0"}


def test_a_rejection_of_dims_and_its_fixes_are_read(captured: dict[str, Any]) -> None:
    message = captured["constraints_violated"]
    assert rejects_dims(message)
    assert suggested_fixes(message) == [("batch", "3")]
    assert pinned_sizes(suggested_fixes(message)) == {"batch": 3}
    assert not rejects_dims(captured["data_dependent"])


def test_dims_pinned_by_solving_the_guards_are_a_rejection_with_their_fixes(captured: dict[str, Any]) -> None:
    message = captured["specializations_required"]
    assert rejects_dims(message)
    assert pinned_sizes(suggested_fixes(message)) == {"height": 16, "width": 16}


def test_the_shapes_loggers_records_give_the_symbol_its_guards_and_its_constant(captured: dict[str, Any]) -> None:
    records = [record(message, args) for message, args in captured["shape_records"]]
    created = [found for r in records if (found := symbol_created(r))]
    guards = [found for r in records if (found := guard_added(r))]
    replaced = [found for r in records if (found := symbol_replaced(r))]
    ((symbol, size),) = created
    assert size == "L['x'].size()[0]"
    assert f"Eq({symbol}, 3)" in guards
    assert replaced == [(symbol, 3)]


def test_the_call_a_data_dependent_guard_raised_in_is_read(captured: dict[str, Any]) -> None:
    message = captured["data_dependent"]
    file, line, code = raising_call(message)
    assert (Path(file).name, code) == ("capture.py", "if labels.max() >= 5:")
    assert quoted_frames(message) == [(file, line)]


def test_the_op_whose_translation_failed_is_read(captured: dict[str, Any]) -> None:
    assert translated_op(captured["untranslatable"]) == "exportobs_capture.opaque.default"
    assert translated_op(captured["constraints_violated"]) is None
    assert translated_op("call_function[target=torch.ops.aten.add.Tensor]") is None  # no translation error


def test_onnxruntimes_missing_kernels_are_read(captured: dict[str, Any]) -> None:
    assert lacks_kernel(captured["type_error"]) and lacks_kernel(captured["not_implemented"])
    assert kernel_lacked(captured["type_error"]) == "Conv (node node_Conv_0) at the graph's opset"
    assert kernel_lacked(captured["not_implemented"]) == "Add (opset 14, node node_Add_0)"
    assert not lacks_kernel(captured["untranslatable"])


def test_the_node_a_run_failed_in_is_read(captured: dict[str, Any]) -> None:
    assert failing_node(captured["failed_run"]) == "node_view"
    assert failing_node(captured["type_error"]) is None


def test_aten_ops_a_translation_error_calls_unsupported_are_listed() -> None:
    message = "No ONNX function found for aten::_fft_r2c.default: unsupported\nother line aten::add"
    assert unsupported_ops(message) == ["aten::_fft_r2c.default"]


def test_transformers_installs_its_output_capturing_hooks_where_the_compat_layer_looks() -> None:
    transformers = pytest.importorskip("transformers")
    from pytest_exportobs.compat import transformers_hooks

    from models import tiny_llama_config

    model = transformers.LlamaModel(tiny_llama_config(num_hidden_layers=1)).eval()
    model(torch.randint(0, 100, (1, 3)), output_hidden_states=True)
    hooks = [hook for m in model.modules() for hook in m._forward_hooks.values()]
    assert hooks and {hook.__module__ for hook in hooks} == {transformers_hooks._HOOKS_MODULE}
    assert vars(model)[transformers_hooks._INSTALLED] is True
