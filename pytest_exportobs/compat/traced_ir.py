"""torch.export's program taken by torch.onnx's translation as traced, without decomposing it.

torch.onnx decomposes a traced program (``run_decompositions``: a second trace of the whole
model, most of an export's time on a small model) so that only ops its registry translates are
left, and no in-place op.  Most programs are one small step from that already: a few ops whose
decomposition is a single op the registry translates (``tensor.to`` is ``_to_copy``, a batch
norm in eval ``_native_batch_norm_legit_no_training``, a global average pool a mean), in-place
ops on tensors nothing else sees (``relu_``, ``x += y``), and code under ``torch.no_grad()``
or ``torch.autocast(..., enabled=False)`` (a region the translation does not take, and grad
mode means nothing to ONNX, nor an autocast that casts nothing).
Those are rewritten on a copy of the program, as the decomposition would rewrite them, and the
copy is translated.  Another op the registry lacks (``broadcast_tensors``, ``diff``,
``reshape_as``, ``binary_cross_entropy_with_logits``, an average pool to another size than 1)
is replaced by its decomposition traced alone on the fake values torch.export recorded for its
inputs: what the decomposition of the whole program would make of it, without tracing the model
again.  An op whose decomposition does not trace so, an in-place op another value could see, or
another higher-order op (an enabled autocast, control flow) leaves the program to the
decomposition.
"""

from __future__ import annotations

import copy
import functools
import operator
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
from torch._guards import detect_fake_mode

__all__ = ["as_translatable", "promote_types"]

aten = torch.ops.aten
_GRAD_REGION = torch.ops.higher_order.wrap_with_set_grad_enabled
_AUTOCAST_REGION = torch.ops.higher_order.wrap_with_autocast
_SOURCE_METADATA = ("stack_trace", "nn_module_stack", "source_fn_stack")  # where a node comes from in the model
# the assertions torch.onnx's preparation removes after its decomposition (``remove_assertion_nodes``)
_ASSERTS_TORCH_ONNX_REMOVES = frozenset({
    aten.sym_constrain_range_for_size.default, aten._assert_async.default, aten._assert_async.msg,
    aten._assert_scalar.default, aten._assert_tensor_metadata.default,
})


def _arguments(node: torch.fx.Node) -> dict[str, Any]:
    """The node's arguments by the names of its op's schema, defaults filled in."""
    schema = node.target._schema  # type: ignore[union-attr]
    arguments: dict[str, Any] = {argument.name: argument.default_value for argument in schema.arguments}
    arguments.update(zip(arguments, node.args))
    arguments.update(node.kwargs)
    return arguments


def _fake(value: Any) -> Any:
    """The fake value torch.export recorded for a node (``None``: none, or not a node)."""
    return value.meta.get("val") if isinstance(value, torch.fx.Node) else None


def _to_copy(node: torch.fx.Node) -> bool:
    """``tensor.to(...)`` as ``aten._to_copy`` with its dtype (a device on a CPU graph and a
    memory format mean nothing to ONNX)."""
    dtype = _arguments(node).get("dtype")
    node.target, node.args = aten._to_copy.default, node.args[:1]
    node.kwargs = {} if dtype is None else {"dtype": dtype}
    return True


def _renamed(op: Any) -> Callable[[torch.fx.Node], bool]:
    def rename(node: torch.fx.Node) -> bool:
        node.target = op
        return True

    return rename


def _global_mean(node: torch.fx.Node) -> bool:
    """``adaptive_avg_pool2d`` to a size of 1 as a mean over the two last axes (torch's own
    decomposition of it)."""
    arguments = _arguments(node)
    if list(arguments["output_size"]) != [1, 1]:
        return False
    node.target, node.args, node.kwargs = aten.mean.dim, (arguments["self"], [-1, -2], True), {}
    return True


def _batch_norm(node: torch.fx.Node) -> bool:
    """``batch_norm`` as torch's decomposition gives it: with running statistics, not training,
    the first output of ``_native_batch_norm_legit_no_training``; without running statistics (a
    weight standardization: NFNet's convolutions), the first output of
    ``_native_batch_norm_legit.no_stats``.  Training with running statistics updates them in
    place: not rewritten."""
    a = _arguments(node)
    if a["running_mean"] is None and a["running_var"] is None:
        no_stats = (a["input"], a["weight"], a["bias"], a["training"], a["momentum"], a["eps"])
        return _by_first_output(node, aten._native_batch_norm_legit.no_stats, no_stats)
    if a["training"] or a["running_mean"] is None or a["running_var"] is None:
        return False
    args = (a["input"], a["weight"], a["bias"], a["running_mean"], a["running_var"], a["momentum"], a["eps"])
    return _by_first_output(node, aten._native_batch_norm_legit_no_training.default, args)


def _nll_loss(node: torch.fx.Node) -> bool:
    """``nll_loss_nd`` of one or two dims: the first output of ``nll_loss_forward``, as
    torch's decomposition gives it (more dims are flattened first)."""
    arguments = _arguments(node)
    scores = _fake(arguments["self"])
    if not isinstance(scores, torch.Tensor) or scores.dim() > 2:
        return False
    return _by_first_output(node, aten.nll_loss_forward.default, tuple(arguments.values()))


def _by_first_output(node: torch.fx.Node, op: Any, args: tuple[Any, ...]) -> bool:
    """Make ``node`` the first output of ``op`` called on ``args`` (the node keeps its name,
    which the program's signature may hold); ``False`` when the op fails on the arguments'
    fake values."""
    values = [_fake(arg) if isinstance(arg, torch.fx.Node) else arg for arg in args]
    fake_mode = detect_fake_mode([value for value in values if isinstance(value, torch.Tensor)])
    if fake_mode is None:
        return False
    try:
        with fake_mode:
            result = op(*values)
    except Exception:
        return False
    with node.graph.inserting_before(node):
        call = node.graph.call_function(op, args)
    call.meta = {**node.meta, "val": result}
    node.target, node.args, node.kwargs = operator.getitem, (call, 0), {}
    return True


# op: how a node of it is rewritten to what torch's decomposition makes of it (False: it is not)
_REWRITES: dict[Any, Callable[[torch.fx.Node], bool]] = {
    aten.to.dtype: _to_copy, aten.to.dtype_layout: _to_copy, aten.to.device: _to_copy,
    aten.__and__.Tensor: _renamed(aten.bitwise_and.Tensor), aten.__or__.Tensor: _renamed(aten.bitwise_or.Tensor),
    aten.adaptive_avg_pool2d.default: _global_mean,
    aten.batch_norm.default: _batch_norm,
    aten.nll_loss_nd.default: _nll_loss,
}
# ops decomposed alone where their rewrite does not apply: an average pool to another size than 1
# (a segmentation head's pyramid pooling: BEiT's, UperNet's)
_ALONE_UNREWRITTEN = frozenset({aten.adaptive_avg_pool2d.default})


def as_translatable(
    program: torch.export.ExportedProgram, translated: Collection[Any],
    decompositions: Mapping[Any, Callable[..., Any]] | None = None,
) -> torch.export.ExportedProgram | None:
    """A copy of ``program`` whose ops are all in ``translated`` (the registry's ops), with
    grad-mode and disabled autocast regions inlined, the ops of :data:`_REWRITES` rewritten,
    in-place ops on values nothing else aliases made functional, and any other op the registry
    lacks replaced by its decomposition traced on its own (``decompositions``: torch.onnx's
    table; see :func:`_decompose_in_place`), as is an average pool the global-mean rewrite does
    not take; ``None`` when an op cannot be so.  ``program`` itself is left as it is."""
    graph = copy.deepcopy(program.graph)
    for traced, copied in zip(program.graph.nodes, graph.nodes):
        copied.name = traced.name  # the names the signature holds: a copy avoids builtins (``input``)
    graph_module = torch.fx.GraphModule(program.graph_module, graph)
    graph_module.meta.update(program.graph_module.meta)
    if not all(_inline(region) for region in _inert_regions(graph)):
        return None
    if decompositions is not None:
        for node in list(graph.nodes):
            if _decomposable(node, translated) and not _decompose_in_place(node, decompositions):
                return None
    before: set[torch.fx.Node] = set()
    for node in list(graph.nodes):
        if node.op == "call_function":
            rewrite = _REWRITES.get(node.target)
            if rewrite is not None and not rewrite(node) and not (
                    node.target in _ALONE_UNREWRITTEN and decompositions is not None
                    and _decompose_in_place(node, decompositions)):
                return None
            if _in_place(node.target) and not _functionalize(node, before):
                return None
        before.add(node)
    if not all(_translatable(node.target, translated) for node in graph.nodes if node.op == "call_function"):
        return None
    graph_module.delete_all_unused_submodules()
    graph_module.recompile()
    return program._update(graph_module, program.graph_signature)


def _decomposable(node: torch.fx.Node, translated: Collection[Any]) -> bool:
    """Whether ``node`` calls a functional op the registry lacks that no rewrite takes."""
    target = node.target
    return (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
            and target not in _REWRITES and not target._schema.is_mutable
            and not _translatable(target, translated))


def _decompose_in_place(node: torch.fx.Node, decompositions: Mapping[Any, Callable[..., Any]]) -> bool:
    """Replace ``node`` by its op's decomposition, traced alone on the fake values torch.export
    recorded for its inputs, tensors and sizes (what torch.onnx's decomposition of the whole
    program, a second trace of the model, makes of this one node): sizes stay the program's
    symbols, read from the inputs where the decomposition needs them.  The new nodes carry the
    node's source metadata.  ``False``, the graph untouched, when the op has no decomposition
    that traces to plain ops (one reading a constant tensor, one whose results are not the
    node's tensors)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    inputs = node.all_input_nodes
    values = [_fake(value) for value in inputs]
    fake_mode = detect_fake_mode([value for value in values if isinstance(value, torch.Tensor)])
    result = _fake(node)
    indexed = isinstance(result, (tuple, list))
    if fake_mode is None or not all(isinstance(v, (torch.Tensor, torch.SymInt)) for v in values) or not all(
            isinstance(v, torch.Tensor) for v in (result if indexed else [result])):
        return False
    op: Any = node.target
    decomposition = decompositions.get(op, op)

    def call(*arguments: torch.Tensor | torch.SymInt) -> Any:
        by_node = dict(zip(inputs, arguments))
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), by_node.__getitem__)
        return decomposition(*args, **kwargs)

    try:
        with fake_mode:
            traced = make_fx(call, decomposition_table=decompositions)(*values)
    except Exception:  # no decomposition, or one that needs more than the fake values give
        return False
    body = traced.graph
    if body.find_nodes(op="get_attr") or isinstance(body.output_node().args[0], (tuple, list)) != indexed or (
            indexed and any(index.target is not operator.getitem for index in node.users)):
        return False
    graph = node.graph
    copies: dict[torch.fx.Node, torch.fx.Node] = dict(zip(body.find_nodes(op="placeholder"), inputs))
    with graph.inserting_before(node):
        outputs: Any = graph.graph_copy(body, copies)
    source: dict[str, Any] = {key: node.meta[key] for key in _SOURCE_METADATA if key in node.meta}
    for original, new in copies.items():
        if original.op != "placeholder":
            new.meta.update(source)
    # the node (or each of its indexed outputs) becomes a copy of what replaces it: it keeps
    # its name, which the program's signature holds when it is an output
    for kept, value in ([(index, outputs[index.args[1]]) for index in node.users] if indexed else [(node, outputs)]):
        kept.target, kept.args, kept.kwargs = aten.clone.default, (value,), {}
    if indexed:
        graph.erase_node(node)
    return True


def _in_place(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable


def _functionalize(node: torch.fx.Node, before: set[torch.fx.Node]) -> bool:
    """An in-place op (``relu_``, ``add_``) as its functional op when nothing can see the
    difference: the tensor it writes is made by an op that returns no view (not an input, not
    a view of another tensor), every other node reading it comes ``before`` the op and none
    of them is a view of it, and the op does not cast what it computes back to the tensor's
    dtype (its tensor arguments share that dtype, but for boolean ones, which promote nothing:
    ``masked_fill_``'s mask)."""
    schema = node.target._schema  # type: ignore[union-attr]
    written = [argument for argument in schema.arguments if argument.alias_info and argument.alias_info.is_write]
    if written != schema.arguments[:1] or not schema.name.endswith("_"):
        return False
    functional = getattr(getattr(aten, schema.name.split("::")[-1][:-1], None), schema.overload_name or "default", None)
    target: Any = node.args[0]
    if functional is None or functional._schema.is_mutable or not _fresh(target):
        return False
    if not all(user in before and not _view(user.target) for user in target.users if user is not node):
        return False
    # the tensors it reads (a size it takes from a symbol, as_strided_'s on a pooled mean, has no dtype)
    dtypes: set[Any] = {_fake(arg).dtype for arg in node.all_input_nodes if isinstance(_fake(arg), torch.Tensor)}
    written_dtype = getattr(_fake(target), "dtype", None)
    dtypes -= {torch.bool} - {written_dtype}
    if len(dtypes) != 1 or None in dtypes or not _keeps_dtype(node.args[1:], dtypes.pop()):
        return False
    node.target = functional
    return True


def _keeps_dtype(scalars: Sequence[Any], dtype: torch.dtype) -> bool:
    """Whether Python scalars among an op's arguments promote nothing: any number to a floating
    tensor, an ``int`` or ``bool`` to an integer one."""
    allowed: tuple[type, ...] = (int, float, bool) if dtype.is_floating_point else (int, bool)
    return all(isinstance(arg, allowed) for arg in scalars if isinstance(arg, (int, float, bool, complex)))


def _fresh(node: Any) -> bool:
    """Whether ``node`` is a tensor of its own: an op's output that is no view (or one output
    of such an op)."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return _fresh(node.args[0])
    return isinstance(node.target, torch._ops.OpOverload) and not _view(node.target)


def _view(target: Any) -> bool:
    """Whether ``target`` may return a view of (or the same tensor as) an input."""
    if not isinstance(target, torch._ops.OpOverload):
        return target is not operator.getitem
    return any(result.alias_info is not None for result in target._schema.returns)


def _translatable(target: Any, translated: Collection[Any]) -> bool:
    if isinstance(target, torch._ops.OpOverload):
        return target in _ASSERTS_TORCH_ONNX_REMOVES or (target in translated and not target._schema.is_mutable)
    return not isinstance(target, torch._ops.HigherOrderOperator)  # getitem, arithmetic on sizes


def _inert_regions(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The regions whose mode means nothing to an ONNX graph: grad mode, and an autocast that is
    disabled (``wrap_with_autocast(device, dtype, enabled, cache_enabled, body, *operands)``; at
    the program's top level no autocast encloses it)."""
    disabled = [region for region in graph.find_nodes(op="call_function", target=_AUTOCAST_REGION)
                if region.args[2] is False]
    return [*graph.find_nodes(op="call_function", target=_GRAD_REGION), *disabled]


def _inline(region: torch.fx.Node) -> bool:
    """Replace the call of an inert region (:func:`_inert_regions`) by the region's nodes;
    ``False``, the graph untouched, when its outputs are used otherwise than by index, are the
    program's outputs (the signature names them) or it holds a region of its own."""
    graph = region.graph
    body_at = 1 if region.target is _GRAD_REGION else 4
    body_node: Any = region.args[body_at]
    operands: Any = region.args[body_at + 1:]
    body = getattr(graph.owning_module, body_node.target)
    indexed = isinstance(body.graph.output_node().args[0], (tuple, list))
    readers = [user for index in region.users for user in index.users] if indexed else list(region.users)
    if body.graph.find_nodes(op="get_attr") or any(user.op == "output" for user in readers) or (
            indexed and any(index.target is not operator.getitem for index in region.users)):
        return False
    with graph.inserting_before(region):
        outputs: Any = graph.graph_copy(body.graph, dict(zip(body.graph.find_nodes(op="placeholder"), operands)))
    if indexed:
        for index in list(region.users):
            position: Any = index.args[1]
            index.replace_all_uses_with(outputs[position])
            graph.erase_node(index)
    else:
        region.replace_all_uses_with(outputs)
    graph.erase_node(region)
    if not body_node.users:
        graph.erase_node(body_node)
    return True


def promote_types(graph_module: torch.fx.GraphModule) -> None:
    """torch.onnx's explicit type promotions inserted in a prepared program (and the programs
    of its higher-order ops), the values of the nodes they leave as they are taken from what
    torch.export recorded.  torch.onnx's own pass runs every node again on fake tensors: most
    of the pass's time, and a view torch.export recorded on the strides of its trace can fail
    there (T5's attention output)."""
    from torch.onnx._internal.fx import passes

    for module in graph_module.modules():
        assert isinstance(module, torch.fx.GraphModule), type(module)
        promotion = passes.InsertTypePromotion(module)
        promotion.interpreter = _recorded_values_interpreter()(module, promotion.interpreter.type_promotion_table)
        promotion.run()


@functools.cache
def _recorded_values_interpreter() -> type:
    from torch.onnx._internal.fx.passes import type_promotion

    class RecordedValues(type_promotion._TypePromotionInterpreter):
        def run_node(self, node: torch.fx.Node) -> Any:
            with self._set_current_node(node):
                if rule := type_promotion.get_type_promotion_rule(node, self.type_promotion_table):
                    self._maybe_promote_node(node, rule)
            if node.op == "call_function" and "val" in node.meta:
                return node.meta["val"]
            return torch.fx.Interpreter.run_node(self, node)

    return RecordedValues
