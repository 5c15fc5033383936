"""The ONNX stages of an export: the traced program decomposed, translated, optimized, written
and checked (torch.onnx's own steps, each called on its own so that each is timed and a failure
names its stage)."""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from ...compat.onnxscript_private import rules_tried_by_root_op
from ...compat.torch_private import (
    guards_on_data,
    prepare_for_onnx,
    rename_onnx_axes,
    taken_as_traced,
    to_onnx_program,
)
from ...compat.torch_text import translated_op
from ...core.onnx_wire import write_with_weights
from ...core.text import error_line
from ...core.vocabulary import Stage
from ..base.environment import writing
from ..base.result import ExportFiles
from .decompositions import UNGUARDED_CROSS_ENTROPY
from .digests import tensor_bytes

MAX_DECOMPOSED = 6  # ops decomposed, one after the other, when their translation to ONNX fails


def decompose(
    program: torch.export.ExportedProgram, notes: list[str], as_traced: bool = True,
    decomposed_alone: Mapping[Any, Any] | None = None,
) -> torch.export.ExportedProgram:
    """torch.onnx's preparation (with ``as_traced``, the program taken as traced when it can
    be, ``decomposed_alone`` ops decomposed alone in it), then the nodes left without users
    removed: it drops the runtime
    asserts but not what only they read (transformers' ``torch_compilable_check`` of a tensor
    condition leaves ``_is_all_true``, which has no ONNX translation).  A loss over a
    data-dependent number of targets, which torch's decomposition cannot take, is decomposed
    with :data:`~.decompositions.UNGUARDED_CROSS_ENTROPY` first (and a note says so)."""
    try:
        program = prepare_for_onnx(program, as_traced, decomposed_alone)
    except Exception as e:
        if not guards_on_data(e, "nll_loss"):
            raise
        program = prepare_for_onnx(program.run_decompositions(UNGUARDED_CROSS_ENTROPY), as_traced, decomposed_alone)
        notes.append("cross_entropy_loss decomposed into _log_softmax and nll_loss_forward: torch's own"
                     " decomposition guards on its data-dependent number of targets")
    if program.graph_module.graph.eliminate_dead_code():
        program.graph_module.recompile()
    return program


def translate(
    program: torch.export.ExportedProgram, notes: list[str], traced: torch.export.ExportedProgram | None = None,
) -> Any:
    """The program translated (not yet optimized).  When the translation of an op fails
    (torchlib's ``cross_entropy_loss`` with a symbolic ``ignore_index``, as the
    question-answering heads of GPT-2 and BERT pass), that op is decomposed with torch's default
    decomposition and the program translated again: a program taken as traced is prepared again
    from ``traced`` (the program before its preparation) with the op decomposed alone, any other
    program is decomposed again with it.  When a program taken as traced fails otherwise, or
    the op cannot be decomposed alone, ``traced`` is decomposed as torch.onnx decomposes it and
    translated instead, as before programs were taken as traced (a note says so)."""
    decomposed: dict[Any, Any] = {}  # op -> its decomposition, for each op whose translation failed
    for _ in range(MAX_DECOMPOSED):
        try:
            onnx_program = to_onnx_program(program)
        except Exception as e:
            op = _failing_op(e)
            table = torch.export.default_decompositions() if op is not None else {}
            if traced is not None and taken_as_traced(program):
                if op in table and op not in decomposed:
                    program = decompose(traced, notes, decomposed_alone={**decomposed, op: table[op]})
                    if taken_as_traced(program):
                        decomposed[op] = table[op]
                        continue
                else:
                    program = decompose(traced, notes, as_traced=False)
                notes.append("translated after torch.onnx's decomposition: the program as traced failed"
                             f" ({error_line(e)})")
                traced, decomposed = None, {}
                continue
            if op not in table or op in decomposed:
                raise
            decomposed[op] = table[op]
            program = decompose(program.run_decompositions({op: table[op]}), notes)
            continue
        if decomposed:
            notes.append(f"translated after decomposing {', '.join(map(str, decomposed))}: torch's ONNX translation "
                         "failed on it")
        return onnx_program
    return to_onnx_program(program)


def _failing_op(error: BaseException) -> Any:
    """The op (``torch.ops.aten.nll_loss_nd.default``) of the node whose translation failed."""
    found = translated_op(f"{error} {error.__cause__}")
    if found is None:
        return None
    ops: Any = torch.ops
    return functools.reduce(lambda obj, name: getattr(obj, name, None), found.split("."), ops)


def check_onnx(path: Path, outcome: ExportFiles) -> None:
    """onnx's checker on the file written; its opset and op counts kept in ``outcome``."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    onnx.checker.check_model(str(path))
    outcome.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    outcome.op_counts = dict(sorted(Counter(n.op_type for n in model.graph.node).items()))


def finish(onnx_program: Any, names: dict[str, str], path: Path, state: Collection[str]) -> None:
    """Optimize the translated program with its initializers named in ``state`` (the module's
    weights) held as inputs, name its symbolic axes, write it.  Held as inputs, the weights are
    not constants to the optimizer: none is folded into another initializer (a batch norm into
    its convolution, a weight transposed), so the file written serves any values of them applied
    by name (onnxruntime folds them when it loads the file).  The optimizer's rewrite rules are
    tried at the nodes their pattern can match only (:func:`rules_tried_by_root_op`)."""
    graph = onnx_program.model.graph
    weights = [value for name, value in list(graph.initializers.items()) if name in state]
    values = {value.name: value.const_value for value in weights}
    for value in weights:
        graph.initializers.pop(value.name)
        value.const_value = None
        graph.inputs.append(value)
    with rules_tried_by_root_op():
        onnx_program.optimize()
    for value in weights:
        graph.inputs.remove(value)
        if value.uses() or value.is_graph_output():
            value.const_value = values[value.name]
            graph.register_initializer(value)
    if names:  # ONNXProgram.rename_axes does the same from torch 2.11 on
        rename_onnx_axes(onnx_program.model, names)
    with writing_onnx(path):
        onnx_program.save(str(path))


@contextlib.contextmanager
def writing_onnx(path: Path) -> Iterator[None]:
    """Around the writing of the ONNX file ``path``, its directory made: a file that cannot be
    written is the machine's problem (see :func:`~..base.environment.writing`)."""
    with writing(Stage.ONNX_TRANSLATE, f"the ONNX file {path}"):
        path.parent.mkdir(parents=True, exist_ok=True)
        yield


def save_with_weights(source: Path, weights: dict[str, torch.Tensor], path: Path) -> bool:
    """Write the ONNX file ``source`` to ``path`` with its initializers named in ``weights``
    holding those values, as the raw bytes the file stores them in (the file is copied and
    those bytes overwritten, not parsed); whether they differed from those ``source`` holds.
    Raises ``ValueError`` when one does not take its weight (another size)."""
    values = {name: tensor_bytes(tensor) for name, tensor in weights.items()}
    with writing_onnx(path):
        return write_with_weights(source, values, path)
