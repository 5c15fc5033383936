"""Which input dimensions are dynamic, how they relate, and what to call them.

:class:`ShapeModel` reads the aligned calls: a dimension whose size varies is dynamic (or the
first one of an input named in ``set_batch_dimension_for``); dynamic dimensions equal in every
call are one *variable*; a variable equal in every call to the sum of others plus a constant is
*derived* (``total_seq = past_seq + seq``).  Relations need calls that vary independently: with a
single call nothing is related, and the model says so in ``notes``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from .alignment import AlignedCalls
from .results import format_dims

Axis = tuple[int, int]  # (flat leaf index, dimension)

BATCH_FIRST_INPUTS = (
    "input_ids", "attention_mask", "position_ids", "token_type_ids", "inputs_embeds",
    "decoder_input_ids", "decoder_attention_mask", "pixel_values", "input_features",
)
SEQUENCE_INPUTS = ("input_ids", "inputs_embeds", "position_ids", "token_type_ids", "decoder_input_ids")
CACHE_INPUTS = ("past_key_values", "cache", "past")


@dataclass(frozen=True)
class Relation:
    """``derived = sum(terms) + constant`` in every observed call."""

    derived: str
    terms: tuple[str, ...]
    constant: int = 0

    def __str__(self) -> str:
        rhs = " + ".join(self.terms)
        if self.constant:
            rhs += f" {'+' if self.constant > 0 else '-'} {abs(self.constant)}"
        return f"{self.derived} = {rhs}"


@dataclass
class Variable:
    """A dimension variable: its axes, the size it had in each call (``None``: unknown)."""

    name: str
    axes: list[Axis]
    values: list[int | None]
    stood_in: list[bool] = field(default_factory=list)  # the size is only an empty stand-in's 0

    @property
    def known(self) -> list[int]:
        return [v for v in self.values if v is not None]

    @property
    def bounds(self) -> tuple[int, int]:
        return min(self.known), max(self.known)

    def recorded_bounds(self) -> tuple[int, int]:
        """Bounds over the sizes real inputs had (a stand-in's 0 left out)."""
        real = [v for v, stood_in in zip(self.values, self.stood_in) if v is not None and not stood_in]
        return (min(real), max(real)) if real else self.bounds


@dataclass
class ShapeModel:
    """Dynamic dimensions of the flat inputs of a set of aligned calls."""

    aligned: AlignedCalls
    variables: list[Variable]
    relations: list[Relation] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_aligned(
        cls,
        aligned: AlignedCalls,
        set_batch_dimension_for: bool | set[int | str] | None = None,
        dim_names: bool | dict[str, str] | None = None,
    ) -> ShapeModel:
        """Infer variables, relations and names from aligned calls."""
        forced = _forced_batch_axes(aligned, set_batch_dimension_for)
        sizes = _axis_sizes(aligned)
        dynamic = [
            axis for axis, values in sizes.items()
            if axis in forced or len({v for v in _present(aligned, axis, values)}) > 1
        ]
        groups = _group_equal(dynamic, sizes, forced)
        variables = [Variable("", group, _merged(sizes, group), _stood_in(aligned, group)) for group in groups]
        notes: list[str] = []
        relations: list[Relation] = []
        if aligned.n_calls < 2:
            notes.append("one observed call: no relation between dimensions can be inferred")
        else:
            relations = _derive(variables)
        model = cls(aligned, variables, relations, notes)
        model._name_variables(dim_names if isinstance(dim_names, dict) else {}, forced)
        return model

    def _name_variables(self, overrides: dict[str, str], forced: set[Axis]) -> None:
        taken: set[str] = set()
        for var in self.variables:
            name = "batch" if forced & set(var.axes) else _default_name(self.aligned, var)
            while name in taken:
                name = _bump(name)
            taken.add(name)
            var.name = name
        axis_keys = {
            f"{self.aligned.leaf_names[leaf]}:{dim}": var for var in self.variables for leaf, dim in var.axes
        }
        unknown = [k for k in overrides if k not in taken and k not in axis_keys]
        if unknown:
            raise ValueError(
                f"dim_names keys {unknown} name no dynamic dimension; known names: {sorted(taken)}, "
                f"known axes: {sorted(axis_keys)}"
            )
        by_index: dict[str, str] = {}
        for index, var in enumerate(self.variables):
            keys = [f"{self.aligned.leaf_names[leaf]}:{dim}" for leaf, dim in var.axes]
            var.name = next((overrides[k] for k in keys if k in overrides), overrides.get(var.name, var.name))
            by_index[str(index)] = var.name
        named = [v.name for v in self.variables]
        clashes = sorted({n for n in named if named.count(n) > 1})
        if clashes:  # one name for two variables would silently tie them in torch.export
            raise ValueError(
                f"dim_names {overrides} gives the name(s) {clashes} to several independent "
                f"dimensions; names after overriding: {named}"
            )
        # terms sorted by name: one spelling of a relation whatever the order of the inputs
        self.relations = [
            Relation(by_index[r.derived], tuple(sorted(by_index[t] for t in r.terms)), r.constant)
            for r in self.relations
        ]

    def merge(self, name: str, into: str) -> None:
        """Make variable ``name`` the same as ``into`` (torch.export proved them equal)."""
        source = next((v for v in self.variables if v.name == name), None)
        target = next((v for v in self.variables if v.name == into), None)
        if source is None or target is None or source is target:
            return
        target.axes.extend(source.axes)
        self.variables.remove(source)
        self.relations = [r for r in self.relations if name not in (r.derived, *r.terms)]

    # -- queries --------------------------------------------------------------------------------
    def variable_of(self, axis: Axis) -> Variable | None:
        return next((v for v in self.variables if axis in v.axes), None)

    def leaf_axes(self) -> list[dict[int, str]]:
        """``{dim: variable name}`` of every flat leaf."""
        axes: list[dict[int, str]] = [{} for _ in self.aligned.leaf_names]
        for var in self.variables:
            for leaf, dim in var.axes:
                axes[leaf][dim] = var.name
        return [dict(sorted(a.items())) for a in axes]

    def describe(self) -> str:
        """``input_ids{0:batch,1:seq}`` for every input with a dynamic dimension."""
        return format_dims(dict(zip(self.aligned.leaf_names, self.leaf_axes())))

    def bounds(self, recorded_only: bool = False) -> dict[str, tuple[int, int]]:
        """Min and max size of each variable, over real inputs only with ``recorded_only``."""
        return {v.name: v.recorded_bounds() if recorded_only else v.bounds for v in self.variables}

    # -- renderers ------------------------------------------------------------------------------
    def to_dynamic_shapes(self, named: bool = False, constants: bool = True) -> tuple[Any, ...] | dict[str, Any]:
        """Dynamic shapes in the arguments' structure: ``Dim.DYNAMIC`` per dynamic dimension
        (seed form), or with ``named=True`` one named ``torch.export.Dim`` per variable.
        A leaf that is no tensor (``None``, int, str inside a nest) gets ``None``; constant
        arguments get ``None``, or are left out with ``constants=False``."""
        if not named:
            flat = [dict.fromkeys(axes, torch.export.Dim.DYNAMIC) for axes in self.leaf_axes()]
        else:
            dims = self.export_dims()
            flat = [{d: dims[n] for d, n in axes.items()} for axes in self.leaf_axes()]
        return self.aligned.structure(self._tensors_only(flat), constants)

    def to_axis_names(self) -> tuple[Any, ...] | dict[str, Any]:
        """Dynamic shapes with variable names as strings (``torch.onnx.export`` axis names)."""
        return self.aligned.structure(self._tensors_only(self.leaf_axes()))

    def _tensors_only(self, per_leaf: list[dict[int, Any]]) -> list[dict[int, Any] | None]:
        """``per_leaf`` with ``None`` for the leaves that are no tensor (torch.export wants that)."""
        return [axes if self.aligned.is_tensor_leaf(leaf) else None for leaf, axes in enumerate(per_leaf)]

    def export_dims(self) -> dict[str, Any]:
        """One named ``torch.export.Dim`` per variable.

        torch.export derives dims only as ``a * u + b`` of one dim, so a sum relation stays a
        variable of its own, with the lower bound torch infers for it (each term is a dynamic
        size, at least 2 while tracing): without it torch rejects the dims and asks for it.
        """
        sums = {r.derived: 2 * len(r.terms) + r.constant for r in self.relations}
        return {
            var.name: torch.export.Dim(_identifier(var.name), min=sums[var.name]) if var.name in sums
            else torch.export.Dim(_identifier(var.name))
            for var in self.variables
        }

    def safe_call(self) -> int | None:
        """A recorded call with every input present and every dynamic size at least 2 (torch.export
        specializes sizes 0 and 1), preferring the call with most inputs."""
        for index in (self.aligned.complete_call(), *range(self.aligned.n_calls)):
            if None not in self.aligned.calls[index] and not self.small_variables(index):
                return index
        return None

    def small_variables(self, index: int) -> list[str]:
        """Variables whose size in call ``index`` is 0, 1 or unknown."""
        return [v.name for v in self.variables if (size := v.values[index]) is None or size < 2]

    def call_leaves(self, index: int) -> list[Any]:
        """The flat leaves of call ``index``; an absent input becomes an empty tensor sized like
        the call's other inputs (a cache absent at prefill gets the prefill's batch) with 0 on
        its missing dimension."""
        leaves = list(self.aligned.calls[index])
        for leaf, value in enumerate(leaves):
            if value is None and leaf in self.aligned.missing_dims:
                leaves[leaf] = self._stand_in(leaf, index)
        return leaves

    def _stand_in(self, leaf: int, index: int) -> torch.Tensor:
        reference = self.aligned.reference_tensor(leaf)
        shape = list(reference.shape)
        for dim in range(len(shape)):
            var = self.variable_of((leaf, dim))
            if var is not None and var.values[index] is not None:
                shape[dim] = var.values[index]
        shape[self.aligned.missing_dims[leaf]] = 0
        return torch.empty(shape, dtype=reference.dtype, device=reference.device)

    def example_leaves(self) -> list[Any]:
        """Flat leaves to export with: a safe recorded call, else inputs synthesized from the
        recorded ones with every dynamic size at least 2."""
        from .synthesis import build_leaves, export_sizes

        index = self.safe_call()
        if index is not None:
            return self.call_leaves(index)
        return build_leaves(self, export_sizes(self), torch.Generator().manual_seed(0))

    def example_arguments(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` of :meth:`example_leaves`."""
        from .observer import flattening_context

        with flattening_context():  # rebuilding a transformers cache needs its pytree node
            return self.aligned.split_arguments(self.example_leaves())

    def to_json(self) -> dict[str, Any]:
        """JSON-native summary (reports, baseline, xdist payloads)."""
        return {
            "dims": {
                name: {str(d): v for d, v in axes.items()}
                for name, axes in zip(self.aligned.leaf_names, self.leaf_axes()) if axes
            },
            "relations": [str(r) for r in self.relations],
            "bounds": {k: list(b) for k, b in self.bounds().items()},
            "notes": list(self.notes),
        }


def _forced_batch_axes(aligned: AlignedCalls, selector: bool | set[int | str] | None) -> set[Axis]:
    if not selector:
        return set()
    names = [s.name for s in aligned.slots]
    selected: set[str] = set()
    if selector is True:
        selected = set(names)
    else:
        for key in selector:
            if isinstance(key, int):
                if not 0 <= key < len(names):
                    raise ValueError(f"set_batch_dimension_for: no input at position {key}; inputs are {names}")
                selected.add(names[key])
            elif key in names:
                selected.add(key)
            else:
                raise ValueError(f"set_batch_dimension_for: no input named {key!r}; inputs are {names}")
    shapes = aligned.shapes()
    axes: set[Axis] = set()
    for slot in aligned.slots:
        if slot.name not in selected:
            continue
        for leaf in range(slot.start, slot.stop):
            ranks = {len(s[leaf]) for s in shapes if s[leaf] is not None}
            if ranks and ranks.pop() > 0:
                axes.add((leaf, 0))
    return axes


def _axis_sizes(aligned: AlignedCalls) -> dict[Axis, list[int | None]]:
    """Size of every tensor axis in every call; an absent input counts 0 on its empty dimension."""
    shapes = aligned.shapes()
    sizes: dict[Axis, list[int | None]] = {}
    for leaf in range(len(aligned.leaf_names)):
        rank = next((len(s[leaf]) for s in shapes if s[leaf] is not None), 0)
        for dim in range(rank):
            sizes[(leaf, dim)] = [
                s[leaf][dim] if s[leaf] is not None
                else (0 if aligned.missing_dims.get(leaf) == dim else None)
                for s in shapes
            ]
    return sizes


def _present(aligned: AlignedCalls, axis: Axis, values: list[int | None]) -> list[int]:
    """Sizes of an axis in the calls where its input was present (seed semantics)."""
    return [v for v, call in zip(values, aligned.calls) if call[axis[0]] is not None]


def _group_equal(dynamic: list[Axis], sizes: dict[Axis, list[int | None]], forced: set[Axis]) -> list[list[Axis]]:
    """Axes equal in every call where both are known, and seen varying together (or both forced)."""
    groups: list[list[Axis]] = []
    for axis in dynamic:
        for group in groups:
            if _same_variable(sizes[group[0]], sizes[axis], group[0] in forced and axis in forced):
                group.append(axis)
                break
        else:
            groups.append([axis])
    return groups


def _same_variable(a: list[int | None], b: list[int | None], both_forced: bool) -> bool:
    common = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    if not common or any(x != y for x, y in common):
        return False
    return both_forced or len({x for x, _ in common}) > 1


def _stood_in(aligned: AlignedCalls, group: list[Axis]) -> list[bool]:
    """Per call, whether no input holding the variable was present (its size is a stand-in's)."""
    return [all(call[leaf] is None for leaf, _ in group) for call in aligned.calls]


def _merged(sizes: dict[Axis, list[int | None]], group: list[Axis]) -> list[int | None]:
    columns = zip(*(sizes[axis] for axis in group))
    return [next((v for v in column if v is not None), None) for column in columns]


def _derive(variables: list[Variable]) -> list[Relation]:
    """Relations ``v = u + w (+ c)`` holding in every call where all three sizes are known.

    Larger variables are tried as sums first; a derived variable is no term of another.  A
    relation must be pinned down by the calls: ``u`` and ``w`` vary independently, and with a
    constant the calls outnumber the unknowns.  ``v = u + c`` is never inferred: test suites often
    grow two sizes together, which says nothing about the model.
    """
    order = sorted(range(len(variables)), key=lambda i: -max(variables[i].known, default=0))
    derived: set[int] = set()
    relations: list[Relation] = []
    for target in order:
        bases = [i for i in range(len(variables)) if i != target and i not in derived]
        found = next(
            (
                rel for terms in itertools.combinations(bases, 2)
                if (rel := _relation(variables, target, terms)) is not None
            ),
            None,
        )
        if found:
            relations.append(found)
            derived.add(target)
    return relations


def _relation(variables: list[Variable], target: int, terms: tuple[int, ...]) -> Relation | None:
    rows = [
        (variables[target].values[c], [variables[t].values[c] for t in terms])
        for c in range(len(variables[target].values))
    ]
    rows = [(v, ts) for v, ts in rows if v is not None and None not in ts]
    constants = {v - sum(ts) for v, ts in rows}
    if len(constants) != 1:
        return None
    constant = constants.pop()
    columns = [[1.0] * bool(constant) + [float(t) for t in ts] for _, ts in rows]
    unknowns = len(terms) + bool(constant)
    rank = torch.linalg.matrix_rank(torch.tensor(columns, dtype=torch.float64)).item()
    if rank < unknowns or (constant and len(rows) <= unknowns):
        return None
    return Relation(str(target), tuple(str(t) for t in terms), constant)


def _default_name(aligned: AlignedCalls, var: Variable) -> str:
    """Readable name of a variable from the inputs and axes it spans (as transformers names them)."""
    roles = [_axis_role(aligned, leaf, dim) for leaf, dim in var.axes]
    for preferred in ("batch", "seq", "past_seq", "total_seq", "encoder_seq", "height", "width", "frames"):
        if preferred in roles:
            return preferred
    leaf, dim = var.axes[0]
    if dim == 0 and len({aligned.leaf_slot(l).name for l, d in var.axes if d == 0}) > 1:
        return "batch"
    return f"{_identifier(aligned.leaf_names[leaf])}_dim{dim}"


def _axis_role(aligned: AlignedCalls, leaf: int, dim: int) -> str | None:
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


def _identifier(name: str) -> str:
    cleaned = "".join(c if c.isalnum() else "_" for c in name).strip("_")
    return cleaned if cleaned and not cleaned[0].isdigit() else f"d_{cleaned}"


def _bump(name: str) -> str:
    base, _, number = name.rpartition("_")
    return f"{base}_{int(number) + 1}" if base and number.isdigit() else f"{name}_2"


def _is_axis_key(key: str) -> bool:
    return ":" in key
