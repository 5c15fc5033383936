"""Constant arguments (``use_cache=True``, ``return_dict``) bound outside the exported graph."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ...observe.alignment import AlignedCalls


class BoundConstants(torch.nn.Module):
    """``module.<method>`` with the calls' constant arguments bound: torch.export then sees tensor
    inputs only, under a plain signature (it cannot take a constant collected by ``**kwargs``,
    as transformers' ``return_dict``)."""

    def __init__(self, module: torch.nn.Module, method: str, constants: dict[str, Any]):
        super().__init__()
        self.module = module
        self.method = method
        self.constants = constants

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.module, self.method)(*args, **kwargs, **self.constants)


def bind_constants(module: torch.nn.Module, method: str, aligned: AlignedCalls) -> torch.nn.Module:
    """``module`` itself when its ``forward`` takes the recorded tensors as they are, else a
    :class:`BoundConstants` whose ``forward`` signature names the tensor arguments."""
    if method == "forward" and not aligned.constants() and not any(s.var_keyword for s in aligned.slots):
        return module
    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    kind: inspect._ParameterKind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    for slot in aligned.slots:
        if slot.is_constant:
            continue
        if slot.var_positional:
            parameters.append(inspect.Parameter(slot.name, inspect.Parameter.VAR_POSITIONAL))
            kind = inspect.Parameter.KEYWORD_ONLY
        else:
            parameters.append(inspect.Parameter(slot.name, kind))

    def forward(self: BoundConstants, *args: Any, **kwargs: Any) -> Any:
        return BoundConstants.forward(self, *args, **kwargs)

    forward.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    bound_class = type(f"Bound{type(module).__name__}", (BoundConstants,), {"forward": forward})
    return bound_class(module, method, aligned.constants())
