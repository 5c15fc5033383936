"""Context managers that let ``torch.export`` take what transformers' ``generate()`` feeds forward.

Observing ``model.generate(...)`` records calls that ``torch.export.export`` and
``torch.onnx.export(..., dynamo=True)`` reject as they are (torch 2.13, transformers 5):

* the extra keywords of ``forward(..., **kwargs)`` (``return_dict=True``): torch nests their
  dynamic shapes under ``kwargs`` when it checks them but not when it computes the range
  constraints, and fails with ``Must provide a tree_name when there might be a mismatch``;
  :func:`nested_var_keywords` retries that step with the extra keywords nested;
* transformers' SDPA attention decides ``is_causal`` (and whether it needs a mask) from
  ``query.shape[2] > 1``, a ``SymBool`` while exporting with a dynamic sequence (``argument
  'is_causal' must be bool, not SymBool``) and a guard that specializes the sequence length;
  :func:`explicit_attention_masks` makes transformers always build the mask and attends with it,
  which is what eager computes, without deciding on the sequence length.

:func:`unbacked_cache_lengths` reads a cache's length without testing whether it holds values,
a data-dependent branch on the unbacked sizes of a ``ShapesSpec`` export (torch >= 2.14).
:func:`batched_image_features` keeps LLaVA's image batch dynamic (its image features become a
Python list, one entry per image).

:func:`export_patches` enters them all; the transformers ones only when transformers is imported.
"""

from __future__ import annotations

import builtins
import contextlib
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch


@contextlib.contextmanager
def export_patches() -> Iterator[None]:
    """Every patch of this module, for the duration of the block."""
    with contextlib.ExitStack() as stack:
        for _, patch in named_export_patches():
            stack.enter_context(patch())
        yield


def named_export_patches() -> list[tuple[str, Callable[[], contextlib.AbstractContextManager[None]]]]:
    """The patches :func:`export_patches` enters, by name: the transformers ones only when
    transformers is imported."""
    patches: list[tuple[str, Callable[[], contextlib.AbstractContextManager[None]]]] = [
        ("nested_var_keywords", nested_var_keywords)]
    if "transformers" in sys.modules:
        patches += [("explicit_attention_masks", explicit_attention_masks),
                    ("unbacked_cache_lengths", unbacked_cache_lengths),
                    ("batched_image_features", batched_image_features)]
    return patches


@contextlib.contextmanager
def nested_var_keywords() -> Iterator[None]:
    """Let torch.export compute range constraints for the extra keywords of ``**kwargs``."""
    from torch.export import _trace

    original = getattr(_trace, "_get_range_constraints", None)
    if original is None:  # a torch without this step has nothing to patch
        yield
        return
    _trace._get_range_constraints = _retry_nested(original)
    try:
        yield
    finally:
        _trace._get_range_constraints = original


def _retry_nested(get_range_constraints: Callable[..., Any]) -> Callable[..., Any]:
    def range_constraints(mod: Any, export_artifact: Any, args: Any, kwargs: Any, dynamic_shapes: Any) -> Any:
        try:
            return get_range_constraints(mod, export_artifact, args, kwargs, dynamic_shapes)
        except AssertionError:
            nested = _nest_extra_keywords(mod, kwargs or {})
            if nested is None:
                raise
            return get_range_constraints(mod, export_artifact, args, nested, dynamic_shapes)

    return range_constraints


def _nest_extra_keywords(mod: Any, kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """``kwargs`` with the keywords ``**<name>`` collects nested under ``<name>``, placed where
    the first of them was (torch orders the graph inputs like ``kwargs``); ``None`` if none."""
    parameters = inspect.signature(mod.forward).parameters
    var_keyword = next((n for n, p in parameters.items() if p.kind is p.VAR_KEYWORD), None)
    extras = {k: v for k, v in kwargs.items() if k not in parameters}
    if var_keyword is None or not extras:
        return None
    nested: dict[str, Any] = {}
    for name, value in kwargs.items():
        if name in parameters:
            nested[name] = value
        elif var_keyword not in nested:
            nested[var_keyword] = extras
    return nested


@contextlib.contextmanager
def explicit_attention_masks() -> Iterator[None]:
    """Transformers always builds attention masks and its ``"sdpa"`` attention uses them with
    ``is_causal=False``, so no decision depends on the length of the sequence."""
    try:
        import transformers.masking_utils as masking_utils
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:  # transformers < 4.53 has neither: nothing decides on the length there
        yield
        return
    skip_mask = masking_utils._ignore_causal_mask_sdpa
    had_local = "sdpa" in ALL_ATTENTION_FUNCTIONS._local_mapping
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    masking_utils._ignore_causal_mask_sdpa = _never
    ALL_ATTENTION_FUNCTIONS["sdpa"] = _masked_attention(sdpa)
    try:
        yield
    finally:
        masking_utils._ignore_causal_mask_sdpa = skip_mask
        if had_local:
            ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
        else:
            del ALL_ATTENTION_FUNCTIONS["sdpa"]


@contextlib.contextmanager
def unbacked_cache_lengths() -> Iterator[None]:
    """``DynamicLayer.get_seq_length`` without ``keys.numel() == 0``: a data-dependent guard on
    the unbacked sizes of a ``ShapesSpec`` export; the length of the keys is the same answer."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    layer = getattr(cache_utils, "DynamicLayer", None)
    if layer is None or "get_seq_length" not in vars(layer):
        yield
        return
    original = layer.get_seq_length
    layer.get_seq_length = _seq_length
    try:
        yield
    finally:
        layer.get_seq_length = original


def _seq_length(self: Any) -> int:
    return self.keys.shape[-2] if self.is_initialized else 0


_HANDLED_BY_SDPA = ("position_bias", "cache", "softcap")  # arguments transformers' SDPA uses specially


def _never(*args: Any, **kwargs: Any) -> bool:
    return False


def _masked_attention(sdpa: Callable[..., Any]) -> Callable[..., Any]:
    """Transformers' SDPA attention when given a mask (and nothing it handles specially), without
    the shape-dependent branches; ``sdpa`` itself otherwise."""
    from transformers.integrations.sdpa_attention import repeat_kv

    def attention(
        module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        if attention_mask is None or any(kwargs.get(name) is not None for name in _HANDLED_BY_SDPA):
            return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        groups = getattr(module, "num_key_value_groups", 1)
        output = torch.nn.functional.scaled_dot_product_attention(
            query, repeat_kv(key, groups), repeat_kv(value, groups),
            attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
        )
        return output.transpose(1, 2).contiguous(), None

    return attention


@contextlib.contextmanager
def batched_image_features() -> Iterator[None]:
    """LLaVA's ``get_image_features`` makes its features ``[images, tokens, dim]`` a Python list of
    one tensor per image, which ``forward`` concatenates again: the list fixes the number of images
    in a graph (``batch specialized``).  Within the block ``list`` of such a tensor in LLaVA's
    module is one tensor of every image's tokens, which the concatenation reads the same."""
    module = sys.modules.get("transformers.models.llava.modeling_llava")
    if module is None:
        yield
        return
    names = vars(module)
    shadowed = names.get("list")  # an enclosing block's (blocks nest)
    names["list"] = _images_as_one
    try:
        yield
    finally:
        if shadowed is None:
            del names["list"]
        else:
            names["list"] = shadowed


def _images_as_one(*args: Any) -> list[Any]:
    """``list``, but a tensor of image features becomes ``[all the images' tokens]``."""
    if len(args) == 1 and isinstance(args[0], torch.Tensor) and args[0].dim() == 3:
        return [args[0].flatten(0, 1)]
    return builtins.list(*args)
