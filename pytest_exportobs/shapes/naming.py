"""Readable names of dimension variables, from the roles of the inputs and axes they span."""

from __future__ import annotations

from ..core.text import identifier
from ..core.vocabulary import AxisRole
from ..observe.alignment import AlignedCalls
from .axis_roles import Role, axis_roles
from .dims import Axis, Relation, Variable


def name_variables(
    aligned: AlignedCalls, variables: list[Variable], relations: list[Relation],
    overrides: dict[str, str], forced: set[Axis],
) -> list[Relation]:
    """Name ``variables`` in place (roles, then ``overrides`` by name or ``input:axis``) and
    return ``relations`` spelled with the names."""
    taken: set[str] = set()
    roles = axis_roles(aligned, generic=False)
    for var in variables:
        name = AxisRole.BATCH.value if forced & set(var.axes) else default_name(aligned, var, roles)
        if name in taken and var.role == name:  # a second variable of one role: named by its axis
            name = generic_name(aligned, var)
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


def default_name(aligned: AlignedCalls, var: Variable, roles: dict[Axis, Role]) -> str:
    """Readable name of a variable: its role, else the preferred role among its axes (as
    transformers names them), ``batch`` for first axes of several inputs, else ``input_dimN``."""
    if var.role:
        return var.role.value
    names = [roles[axis].name for axis in var.axes if axis in roles]
    for preferred in AxisRole:  # as transformers prefers them
        if preferred in names:
            return preferred.value
    leaf, dim = var.axes[0]
    if dim == 0 and len({aligned.leaf_slot(leaf).name for leaf, d in var.axes if d == 0}) > 1:
        return AxisRole.BATCH.value
    return generic_name(aligned, var)


def generic_name(aligned: AlignedCalls, of: Variable | Axis) -> str:
    """``input_dimN`` of an axis, or of a variable's first axis."""
    leaf, dim = of.axes[0] if isinstance(of, Variable) else of
    return f"{identifier(aligned.leaf_names[leaf])}_dim{dim}"


def bump(name: str) -> str:
    base, _, number = name.rpartition("_")
    return f"{base}_{int(number) + 1}" if base and number.isdigit() else f"{name}_2"
