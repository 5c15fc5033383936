"""ExecuTorch's private surfaces, kept here (``--export-target executorch``)."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

__all__ = ["python_sym_functions_verified"]


@contextlib.contextmanager
def python_sym_functions_verified() -> Iterator[None]:
    """ExecuTorch's edge verifier taking torch's Python functions on sizes (``torch.sym_not``,
    ``torch.sym_max``...) while in the context.  Its lowering keeps them from the traced program,
    or makes them for the runtime asserts its retrace inserts (a transformers mask's ``Ne(s, 1)``),
    and replaces them by its own prim ops only after the verifier has rejected them (executorch
    1.5: ``assert op.__name__ in ("alloc",)``)."""
    from executorch.exir.passes import executorch_prim_ops_registry as registry

    functions = {f for f in registry._PYTHON_SYM_OPS_TO_EXECUTORCH_SYM_OPS if isinstance(f, types.FunctionType)}
    added = functions - registry._EXECUTORCH_SYM_OPS
    registry._EXECUTORCH_SYM_OPS.update(added)
    try:
        yield
    finally:
        registry._EXECUTORCH_SYM_OPS.difference_update(added)
