"""Readable names of dimension variables, from the roles of the inputs and axes they span."""

from __future__ import annotations

from ..core.text import identifier
from ..observe.alignment import AlignedCalls
from .dims import Axis, Relation, Variable

BATCH_FIRST_INPUTS = (
    "input_ids", "attention_mask", "position_ids", "token_type_ids", "inputs_embeds",
    "decoder_input_ids", "decoder_attention_mask", "pixel_values", "input_features",
)
SEQUENCE_INPUTS = ("input_ids", "inputs_embeds", "position_ids", "token_type_ids", "decoder_input_ids")
CACHE_INPUTS = ("past_key_values", "cache", "past")


def name_variables(
    aligned: AlignedCalls, variables: list[Variable], relations: list[Relation],
    overrides: dict[str, str], forced: set[Axis],
) -> list[Relation]:
    """Name ``variables`` in place (roles, then ``overrides`` by name or ``input:axis``) and
    return ``relations`` spelled with the names."""
    taken: set[str] = set()
    for var in variables:
        name = "batch" if forced & set(var.axes) else default_name(aligned, var)
        while name in taken:
            name = bump(name)
        taken.add(name)
        var.name = name
    axis_keys = {
        f"{aligned.leaf_names[leaf]}:{dim}": var for var in variables for leaf, dim in var.axes
    }
    unknown = [k for k in overrides if k not in taken and k not in axis_keys]
    if unknown:
        raise ValueError(
            f"dim_names keys {unknown} name no dynamic dimension; known names: {sorted(taken)}, "
            f"known axes: {sorted(axis_keys)}"
        )
    by_index: dict[str, str] = {}
    for index, var in enumerate(variables):
        keys = [f"{aligned.leaf_names[leaf]}:{dim}" for leaf, dim in var.axes]
        var.name = next((overrides[k] for k in keys if k in overrides), overrides.get(var.name, var.name))
        by_index[str(index)] = var.name
    named = [v.name for v in variables]
    clashes = sorted({n for n in named if named.count(n) > 1})
    if clashes:  # one name for two variables would silently tie them in torch.export
        raise ValueError(
            f"dim_names {overrides} gives the name(s) {clashes} to several independent "
            f"dimensions; names after overriding: {named}"
        )
    # terms sorted by name: one spelling of a relation whatever the order of the inputs
    return [
        Relation(by_index[r.derived], tuple(sorted(by_index[t] for t in r.terms)), r.constant)
        for r in relations
    ]


def default_name(aligned: AlignedCalls, var: Variable) -> str:
    """Readable name of a variable from the inputs and axes it spans (as transformers names them)."""
    roles = [axis_role(aligned, leaf, dim) for leaf, dim in var.axes]
    for preferred in ("batch", "seq", "past_seq", "total_seq", "encoder_seq", "height", "width", "frames"):
        if preferred in roles:
            return preferred
    leaf, dim = var.axes[0]
    if dim == 0 and len({aligned.leaf_slot(l).name for l, d in var.axes if d == 0}) > 1:
        return "batch"
    return f"{identifier(aligned.leaf_names[leaf])}_dim{dim}"


def axis_role(aligned: AlignedCalls, leaf: int, dim: int) -> str | None:
    slot = aligned.leaf_slot(leaf).name
    leaf_name = aligned.leaf_names[leaf]
    is_cache = any(slot.startswith(c) for c in CACHE_INPUTS) and leaf_name != slot
    if dim == 0 and (slot in BATCH_FIRST_INPUTS or is_cache):
        return "batch"
    if is_cache and dim == 2:
        return "encoder_seq" if "cross" in leaf_name else "past_seq"
    if dim == 1 and slot in SEQUENCE_INPUTS:
        return "seq"
    if dim == 0 and slot == "cache_position":
        return "seq"
    if dim == 1 and slot in ("attention_mask", "decoder_attention_mask"):
        return "total_seq"  # "seq" wins when the mask shares the tokens' variable
    if slot in ("pixel_values",) and dim in (2, 3):
        return ("height", "width")[dim - 2]
    if slot == "input_features" and dim == 2:
        return "frames"
    return None


def bump(name: str) -> str:
    base, _, number = name.rpartition("_")
    return f"{base}_{int(number) + 1}" if base and number.isdigit() else f"{name}_2"
