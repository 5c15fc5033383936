"""Every private torch name the plugin relies on, in one place: a torch release that moves one
breaks this module only, and its tests say which (``tests/unit/test_compat.py``).

torch.onnx.export's two steps (torch.onnx._internal.exporter), called apart so that each is timed
and reported on its own with one torchlib registry per process; what it enters around
torch.export (size-oblivious sizes, the RNN while-loop decompositions); the error torch.export
raises for rejected dims; fake tensors; the removal of a pytree node, which torch offers for its
Python side only.  The rest of ``torch.utils._pytree`` is not here: it is the pytree API the
ecosystem (torch.export's own docs, transformers, the peers) uses under that name.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import sys
from collections.abc import Iterator, Mapping
from types import ModuleType
from typing import Any

import torch
import torch.utils._pytree as pytree

from .traced_ir import as_translatable, promote_types

__all__ = [
    "deregister_pytree_node", "drop_runtime_asserts", "flat_call_spec", "is_fake_tensor",
    "import_export_machinery", "onnx_registry", "prepare_for_onnx", "register_translations",
    "rename_onnx_axes", "rnn_while_loops", "size_oblivious", "sympy_functions", "taken_as_traced",
    "to_onnx_program", "translated_ops", "unchecked_module", "upper_bounded",
]



def __getattr__(name: str) -> Any:
    """The names that bring torch.export's machinery with them (dynamo, functorch, networkx: 400
    modules, whose objects every full garbage collection of a test session would walk), imported
    when first read: a session imports them for its checks, not while its tests run.

    ``DEFERRED_ASSERTS``: torch.onnx.export's guards that can wait become runtime asserts (a GRU's
    ``seq != 1``), where torch takes the option: read from the function torch.export.export
    calls, not from whatever is bound to that name (a profiler's ``(*args, **kwargs)`` wrapper
    says nothing of its options, and without them a Swin's padded sides are rejected, not
    asserted).  ``ExportUserError``: what torch.export raises for rejected dims."""
    if name == "DEFERRED_ASSERTS":
        return _deferred_asserts()
    if name == "ExportUserError":
        return importlib.import_module("torch._dynamo.exc").UserError
    if name == "FakeTensor":
        return importlib.import_module("torch._subclasses.fake_tensor").FakeTensor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _deferred_asserts() -> bool:
    return "prefer_deferred_runtime_asserts_over_guards" in inspect.signature(
        importlib.import_module("torch.export._trace")._export).parameters


def is_fake_tensor(value: Any) -> bool:
    """Whether ``value`` is a fake tensor (none exists before torch imported them)."""
    fake = sys.modules.get("torch._subclasses.fake_tensor")
    return fake is not None and isinstance(value, fake.FakeTensor)


def deregister_pytree_node(cls: type) -> None:
    """Undo ``torch.utils._pytree.register_pytree_node(cls, ...)``.

    With optree installed, the registration also registers ``cls`` with torch's C++ pytree, or
    queues it for when torch imports that (dynamo does); torch's ``_deregister_pytree_node``
    forgets both, so that registering ``cls`` again raises "already registered" there, or each
    queued copy does when the import comes."""
    pytree._deregister_pytree_node(cls)
    if pytree._cxx_pytree_imported:
        import optree

        with contextlib.suppress(ValueError):  # registered on the Python side only (a structseq)
            optree.unregister_pytree_node(cls, namespace="torch")
    else:
        pytree._cxx_pytree_pending_imports[:] = [
            pending for pending in pytree._cxx_pytree_pending_imports if pending[0][0] is not cls]


_ASSERTS = (torch.ops.aten._assert_scalar.default, torch.ops.aten._assert_async.msg)


def unchecked_module(program: torch.export.ExportedProgram) -> torch.fx.GraphModule:
    """The program's module as its ONNX translation runs: without the checks of its inputs'
    sizes (``check_guards=False`` from torch 2.12, and the forward pre-hook left then: a range
    from 2 rejects a batch of 1 the graph serves) and without its runtime asserts on sizes."""
    takes_guards = "check_guards" in inspect.signature(program.module).parameters
    graph_module = program.module(check_guards=False) if takes_guards else program.module()
    graph_module._forward_pre_hooks.clear()
    for node in list(graph_module.graph.nodes):
        if node.op == "call_function" and node.target in _ASSERTS and not node.users:
            graph_module.graph.erase_node(node)
    graph_module.recompile()
    return graph_module


def drop_runtime_asserts(program: torch.export.ExportedProgram) -> None:
    """Remove the program's runtime asserts on sizes, and the symbolic computations only they
    used, in place.  ExecuTorch removes them too, after a verifier that rejects ``torch.sym_not``
    among their conditions (the asserts torch.onnx.export's capture defers instead of guarding)."""
    graph = program.graph
    pending = [node for node in graph.nodes if node.op == "call_function" and node.target in _ASSERTS]
    while pending:
        node = pending.pop()
        if node.users or node.op != "call_function":
            continue
        inputs = [arg for arg in node.all_input_nodes if _symbolic(arg)]
        graph.erase_node(node)
        pending.extend(inputs)
    program.graph_module.recompile()


def _symbolic(node: torch.fx.Node) -> bool:
    """Whether ``node`` computes a size or a condition on sizes (no tensor)."""
    value = node.meta.get("val")
    return node.op == "call_function" and isinstance(value, (torch.SymInt, torch.SymBool, torch.SymFloat, int, bool))


def import_export_machinery() -> None:
    """Import what the first torch.export imports (about 2 s): forked checks inherit it."""
    importlib.import_module("torch.export._trace")


@functools.cache
def sympy_functions() -> dict[str, type]:
    """torch's own sympy functions by name (``FloorDiv``, ``PythonMod``...): what the conditions
    of an exported program's runtime asserts are made of besides sympy's."""
    import sympy
    from torch.utils._sympy import functions

    return {name: value for name, value in vars(functions).items()
            if isinstance(value, type) and issubclass(value, sympy.Basic) and value.__module__ == functions.__name__}


def onnx_registry() -> Any:
    """torchlib's registry of ONNX translations, built once per process (with the translations
    :func:`register_translations` added)."""
    return _torchlib_registry()


def register_translations(table: dict[Any, Any]) -> None:
    """Add translations of ops (``{torch op: onnxscript function}``) to the registry, as
    ``torch.onnx.export(custom_translation_table=...)`` does: torch.onnx prefers them to
    torchlib's, and keeps the ops out of its decompositions.  Each op is registered once."""
    registry = onnx_registry()
    for op, function in table.items():
        if op not in _REGISTERED:
            registry.register_op(op, function)
            _REGISTERED.add(op)
            translated_ops.cache_clear()
            onnx_decompositions.cache_clear()


_REGISTERED: set[Any] = set()


@functools.cache
def _torchlib_registry() -> Any:
    from torch.onnx._internal.exporter import _registration

    return _registration.ONNXRegistry.from_torchlib()


@functools.cache
def translated_ops() -> frozenset[Any]:
    """The op overloads the registry translates."""
    from torch.onnx._internal.exporter import _decomp

    return frozenset(_decomp.get_onnx_implemented_overloads(onnx_registry()))


@functools.cache
def onnx_decompositions() -> dict[Any, Any]:
    """torch.onnx's decompositions: torch's default ones but of the ops the registry translates."""
    from torch.onnx._internal.exporter import _decomp

    return _decomp.create_onnx_friendly_decomposition_table(set(translated_ops()))


def prepare_for_onnx(
    program: torch.export.ExportedProgram, as_traced: bool = True, decomposed_alone: Mapping[Any, Any] | None = None,
) -> torch.export.ExportedProgram:
    """torch.onnx's first step (``_core._prepare_exported_program_for_export``): decompositions,
    explicit type promotions, assertions removed.  With ``as_traced``, a program the registry
    translates as traced up to a few rewrites is not decomposed
    (:func:`~.traced_ir.as_translatable`: the decomposition is a second trace of the model that
    would change nothing the translation reads); ``decomposed_alone`` (op: decomposition) are ops
    the registry translates but whose translation failed on this program, decomposed alone in it
    as the ops the registry lacks are.  The decomposition table is built once per registry, not
    for every export (0.08 s each); the type promotions are made from the values torch.export
    recorded (:func:`~.traced_ir.promote_types`)."""
    from torch.onnx._internal.exporter import _fx_passes

    with size_oblivious():
        prepared = _as_traced_and_promoted(program, decomposed_alone or {}) if as_traced else None
        if prepared is None:  # run_decompositions is given a copy of the table: torch takes entries out
            prepared = program.run_decompositions(dict(onnx_decompositions()))
            promote_types(prepared.graph_module)
        prepared._graph_module = _fx_passes.remove_assertion_nodes(prepared.graph_module)
    return prepared


def _as_traced_and_promoted(
    program: torch.export.ExportedProgram, decomposed_alone: Mapping[Any, Any],
) -> torch.export.ExportedProgram | None:
    """The program rewritten to be translated as traced (``decomposed_alone`` taken as ops the
    registry lacks), its type promotions explicit; ``None`` when it cannot be, or the rewriting
    or the promotions fail on it (an op decomposed alone whose sizes the program cannot hold):
    the decomposition is then torch.onnx's path."""
    try:
        prepared = as_translatable(program, translated_ops() - decomposed_alone.keys(),
                                   {**onnx_decompositions(), **decomposed_alone})
        if prepared is not None:
            promote_types(prepared.graph_module)
    except Exception:
        return None
    return prepared


def taken_as_traced(prepared: torch.export.ExportedProgram) -> bool:
    """Whether :func:`prepare_for_onnx` took the program as traced (torch.export's training
    dialect), not decomposed."""
    return prepared.dialect == "TRAINING"


def output_order(traced: torch.export.ExportedProgram, translated: torch.export.ExportedProgram) -> list[int]:
    """For each output of the ``translated`` program (the ONNX graph's, in order), the index of
    the ``traced`` program's output it is; ``[]`` when they come in the same order.  A program
    torch decomposed was traced again through its module, whose outputs are rebuilt from the out
    spec and flattened again: a model output whose keys were set out of its fields' order
    (transformers' captured ``router_logits`` before ``hidden_states``) comes out in its fields'
    order, while the out spec keeps the first one (torch 2.13, 2.15).  The order is taken only
    when the graphs' output values agree with it."""
    values = [_output_values(traced), _output_values(translated)]
    if taken_as_traced(translated) or len(values[1]) != len(values[0]):
        return []
    try:
        rebuilt = pytree.tree_leaves(pytree.tree_unflatten(values[0], traced.call_spec.out_spec))
    except Exception:  # a class whose unflattening needs more than its values: torch's retrace would fail alike
        return []
    positions: dict[int, list[int]] = {}  # one value may be several outputs (the last hidden state twice)
    for index, value in enumerate(values[0]):
        positions.setdefault(id(value), []).append(index)
    order = [positions[id(value)].pop(0) if positions.get(id(value)) else -1 for value in rebuilt]
    identity = list(range(len(order)))
    if order == identity or sorted(order) != identity:  # the same order, or not a permutation
        return []
    described = [[(str(getattr(v, "dtype", "")), str(getattr(v, "shape", v))) for v in vs] for vs in values]
    return order if described[1] == [described[0][i] for i in order] else []


def _output_values(program: torch.export.ExportedProgram) -> list[Any]:
    """The values (fake tensors, symbolic or constant sizes) of the program's user outputs (not
    its buffers' mutations), in order."""
    output = next(node for node in program.graph.nodes if node.op == "output")
    user = torch.export.graph_signature.OutputKind.USER_OUTPUT
    kinds = [spec.kind for spec in program.graph_signature.output_specs]
    return [arg.meta.get("val", arg) if isinstance(arg, torch.fx.Node) else arg
            for arg, kind in zip(output.args[0], kinds, strict=True) if kind == user]


def guards_on_data(error: BaseException, function: str) -> bool:
    """Whether ``error`` is torch's guard on a data-dependent size, raised in ``function`` (as the
    message's "Caused by" names it: ``nll_loss``)."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return isinstance(error, GuardOnDataDependentSymNode) and f" in {function})" in str(error)


def to_onnx_program(program: torch.export.ExportedProgram) -> Any:
    """torch.onnx's second step: the prepared program translated to an ``ONNXProgram``, which
    imports the default domain at the registry's opset even when no op needs it (a graph without
    ops, ``nn.Identity``: onnx's checker rejects a model that imports no opset)."""
    from torch.onnx._internal.exporter import _core

    registry = onnx_registry()
    onnx_program = _core._exported_program_to_onnx_program(program, registry=registry)
    onnx_program.model.opset_imports.setdefault("", registry.opset_version)
    return onnx_program


def rename_onnx_axes(model: Any, names: dict[Any, str]) -> None:
    """Rename the symbolic axes of an ONNX IR model (``ONNXProgram.rename_axes`` from torch 2.11)."""
    from torch.onnx._internal.exporter import _ir_passes

    _ir_passes.rename_axis(model, names)


def size_oblivious() -> contextlib.AbstractContextManager[Any]:
    """Sizes 0 and 1 not specialized while tracing (what torch.onnx.export sets)."""
    return torch.fx.experimental._config.patch(backed_size_oblivious=True)  # type: ignore[attr-defined]


@contextlib.contextmanager
def rnn_while_loops() -> Iterator[None]:
    """torch's decompositions of GRU and LSTM into a while loop, where this torch has them (they
    keep the sequence dynamic), with the ops' dispatch caches cleared on entry and exit: the
    registrations replace the ops' Python kernels without clearing them, so a second export in a
    process used the kernel the first left cached."""
    _patches: ModuleType | None
    try:
        from torch.export import _patches
    except ImportError:  # torch < 2.10
        _patches = None
    ops = (torch.ops.aten.lstm.input, torch.ops.aten.gru.input)
    with contextlib.ExitStack() as stack:
        for name in ("register_gru_while_loop_decomposition", "register_lstm_while_loop_decomposition"):
            if hasattr(_patches, name):
                stack.enter_context(getattr(_patches, name)())
        for op in ops:
            op._dispatch_cache.clear()
        try:
            yield
        finally:
            for op in ops:
                op._dispatch_cache.clear()


@contextlib.contextmanager
def upper_bounded(program: torch.export.ExportedProgram, maxima: Mapping[str, int]) -> Iterator[None]:
    """The program's symbolic sizes named in ``maxima`` (by their symbols' text, ``s23``) bounded
    above, in its range constraints and in the shape environment its fake values hold, as an
    export with ``Dim(..., max=...)`` would have them (ExecuTorch plans memory from these
    bounds), torch's own tighter bounds kept, and below by 2 as sizes traced size-obliviously
    are (a retrace then does not assert ``s != 1``, which ExecuTorch's verifier rejects); the
    runtime asserts the environment defers (the capture torch.onnx.export makes defers guards
    as asserts) not inserted again by a retrace.  Every range and assert is restored on exit."""
    from torch.utils._sympy.value_ranges import ValueRanges

    environments = list({id(env): env for env in _shape_environments(program)}.values())
    saved = (dict(program.range_constraints), [(dict(env.var_to_range), dict(env.deferred_runtime_asserts))
                                               for env in environments])
    try:
        for env in environments:
            env.deferred_runtime_asserts.clear()
        for symbol, known in list(program.range_constraints.items()):
            if str(symbol) in maxima:
                upper = max(known.lower, min(known.upper, maxima[str(symbol)]))
                bounded = ValueRanges(max(known.lower, min(2, upper)), upper)
                program.range_constraints[symbol] = bounded
                for env in environments:
                    if symbol in env.var_to_range:
                        env.var_to_range[symbol] = bounded
        yield
    finally:
        program.range_constraints.clear()
        program.range_constraints.update(saved[0])
        for env, (ranges, asserts) in zip(environments, saved[1]):
            env.var_to_range.clear()
            env.var_to_range.update(ranges)
            env.deferred_runtime_asserts.clear()
            env.deferred_runtime_asserts.update(asserts)


@contextlib.contextmanager
def flat_call_spec(program: torch.export.ExportedProgram) -> Iterator[None]:
    """The program's inputs and outputs taken as flat tuples of their leaves (its example inputs
    dropped) while in the context, restored on exit: for ExecuTorch's emitter, which rebuilds the
    containers from placeholder leaves that the unflatten of a cache class (tensors expected)
    rejects.  A retrace binds the inputs to the module's signature: not within the context."""
    signature = program._module_call_graph[0].signature
    assert signature is not None
    saved = signature.in_spec, signature.out_spec, program.example_inputs
    signature.in_spec = pytree.tree_structure((tuple(range(saved[0].num_leaves)), {}))
    signature.out_spec = pytree.tree_structure(tuple(range(saved[1].num_leaves)))
    program._example_inputs = None
    try:
        yield
    finally:
        signature.in_spec, signature.out_spec, program._example_inputs = saved


def _shape_environments(program: torch.export.ExportedProgram) -> list[Any]:
    """The shape environments of the fake values of the program's inputs (one, as traced)."""
    found: list[Any] = []
    for node in program.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            for size in value.shape:
                if isinstance(size, torch.SymInt):
                    found.append(size.node.shape_env)
    return found
