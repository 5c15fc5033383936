"""The forward hooks transformers installs on a model for itself, set aside while it is pickled.

transformers 5 captures ``output_hidden_states`` and ``output_attentions`` with forward hooks it
installs the first time a call asks for them: closures (``output_capturing_hook``) pickle cannot
take, so a model that was asked for them once cannot be saved.  Set aside, with the flag that
says they were installed, the model pickles as any other and installs them again when a call
asks for them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

_HOOKS_MODULE = "transformers.utils.output_capturing"  # where transformers defines the closures
_INSTALLED = "_output_capturing_hooks_installed"  # the attribute that says a model has them


@contextlib.contextmanager
def without_output_capturing_hooks(model: torch.nn.Module) -> Iterator[None]:
    """``model`` without transformers' output-capturing hooks for the duration of the block
    (their handles stay valid: the hook dicts are the same objects, refilled in order)."""
    held: list[tuple[dict[int, Callable[..., Any]], list[tuple[int, Callable[..., Any]]]]] = []
    flagged = [module for module in model.modules() if vars(module).get(_INSTALLED, False)]
    for module in model.modules():
        hooks = module._forward_hooks
        if any(_is_capturing(hook) for hook in hooks.values()):
            held.append((hooks, list(hooks.items())))
            for key in [key for key, hook in hooks.items() if _is_capturing(hook)]:
                del hooks[key]
    for module in flagged:
        delattr(module, _INSTALLED)
    try:
        yield
    finally:
        for hooks, items in held:
            hooks.clear()
            hooks.update(items)
        for module in flagged:
            setattr(module, _INSTALLED, True)


def _is_capturing(hook: Callable[..., Any]) -> bool:
    return getattr(hook, "__module__", None) == _HOOKS_MODULE
