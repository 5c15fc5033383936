"""Which input dimensions are dynamic, how they relate, and what to call them.

:class:`ShapeModel` reads the aligned calls (see :mod:`.inference` for the rules and
:mod:`.naming` for the names) and renders what torch.export and onnxruntime need: dynamic
shapes in the arguments' structure, and the flat inputs of each call with absent inputs stood in
for.  Relations need calls that vary independently: with a single call nothing is related, and
the model says so in ``notes``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.text import identifier
from ..core.vocabulary import AxisRole, StandIn
from ..observe.alignment import AlignedCalls
from ..observe.binding import value_text
from .dims import Axis, Relation, Variable, Window
from .inference import AS_OBSERVED, DimPolicy, derive_relations, forced_batch_axes, infer_variables, role_relations
from .naming import generic_name, name_variables
from .standins import stand_in, stand_in_kind


@dataclass(frozen=True)
class ShapeModel:
    """Dynamic dimensions of the flat inputs of a set of aligned calls; never changed in place:
    a refinement (:meth:`merged`, :meth:`derived`, :meth:`split`, :meth:`without`) is a new model."""

    aligned: AlignedCalls
    variables: list[Variable]
    relations: list[Relation] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    meaningful_stand_ins: bool = False  # absent masks are ones, positions follow the cache...
    windows: list[Window] = field(default_factory=list)  # sizes of the model's states, not the graph's

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_aligned(
        cls,
        aligned: AlignedCalls,
        set_batch_dimension_for: bool | Collection[int | str] | None = None,
        dim_names: bool | dict[str, str] | None = None,
        policy: DimPolicy = AS_OBSERVED,
    ) -> ShapeModel:
        """Infer variables, relations and names from aligned calls; the default ``policy`` makes
        dynamic only what the calls vary (the peers' API), the plugin adds roles."""
        forced = forced_batch_axes(aligned, set_batch_dimension_for)
        variables = infer_variables(aligned, forced, policy)
        notes: list[str] = []
        relations = role_relations(variables) if policy.roles else []
        notes += [f"{name} ({value_text(value)}) bound as the tests passed it: an object only Python uses is no "
                  "graph input" for name, value in aligned.opaque_arguments().items()]
        if aligned.n_calls < 2:
            notes.append("one observed call: no relation between dimensions can be inferred")
        else:
            derived = {r.derived for r in relations}
            relations += [r for r in derive_relations(variables) if r.derived not in derived]
        overrides = dim_names if isinstance(dim_names, dict) else {}
        relations = name_variables(aligned, variables, relations, overrides, forced)
        return cls(aligned, variables, relations, notes)

    def merged(self, name: str, into: str) -> ShapeModel:
        """Variable ``name`` the same as ``into`` (torch.export proved them equal)."""
        source = next((v for v in self.variables if v.name == name), None)
        target = next((v for v in self.variables if v.name == into), None)
        if source is None or target is None or source is target:
            return self
        variables = [dataclasses.replace(v, axes=[*v.axes, *source.axes]) if v is target else v
                     for v in self.variables if v is not source]
        return dataclasses.replace(self, variables=variables, relations=self._relations_without(name),
                                   windows=self._windows_without(name))

    def derived(self, name: str, relation: Relation) -> ShapeModel:
        """Variable ``name`` following ``relation`` from a new free variable without axes
        (torch.export restricted it: ``height = 2*height_half``), instead of any it followed."""
        var = next(v for v in self.variables if v.name == name)
        (free,) = relation.terms
        values = [None if v is None else v // relation.scale for v in var.values]
        replaced = {t for r in self.relations if r.derived == name for t in r.terms}
        stale = {v.name for v in self.variables if v.name in replaced and not v.axes}  # an earlier step's
        return dataclasses.replace(
            self, variables=[*(v for v in self.variables if v.name not in stale),
                             Variable(free, [], values, list(var.stood_in), var.source, var.role)],
            relations=[relation, *(r for r in self.relations if r.derived != name)],
        )

    def split(self, name: str, axes: Collection[Axis], into: str, limit: int) -> ShapeModel:
        """Variable ``name`` without ``axes``, which become variable ``into`` of the same sizes,
        ``min(name, limit)`` in the model's states (a sliding window's layers hold a cache length
        of their own); relations stay with ``name``."""
        var = next(v for v in self.variables if v.name == name)
        moved = dataclasses.replace(var, name=into, axes=[a for a in var.axes if a in axes])
        kept = dataclasses.replace(var, axes=[a for a in var.axes if a not in axes])
        return dataclasses.replace(
            self, variables=[*(kept if v is var else v for v in self.variables), moved],
            windows=[*self.windows, Window(into, name, limit)],
        )

    def tied(self, name: str, partners: Collection[tuple[Axis, int]]) -> ShapeModel:
        """Variable ``name`` with the axes the model ties to it, each ``(axis, scale)`` of a size
        ``scale`` times its own in every call (``img_ids``' tokens to ``hidden_states``',
        ``controlnet_cond``'s sides to twice ``sample``'s): scale 1 joins the variable (with the
        axis's variable, if any); another scale makes the axis's variable (or a new one) follow
        ``scale * name``."""
        shapes = self
        for (leaf, dim), scale in partners:  # a probe entry's JSON gives lists: the axis a tuple again
            axis = (leaf, dim)
            var = next(v for v in shapes.variables if v.name == name)
            other = shapes.variable_of(axis)
            if scale == 1 and other is not None:
                shapes = shapes.merged(other.name, name)
            elif scale == 1:
                variables = [dataclasses.replace(v, axes=[*v.axes, axis]) if v is var else v for v in shapes.variables]
                shapes = dataclasses.replace(shapes, variables=variables)
            else:
                if other is None:
                    values = [None if v is None else scale * v for v in var.values]
                    other = dataclasses.replace(var, name=generic_name(shapes.aligned, axis), axes=[axis],
                                                values=values, role=None)
                    shapes = dataclasses.replace(shapes, variables=[*shapes.variables, other])
                relation = Relation(other.name, (name,), scale=scale)
                shapes = dataclasses.replace(shapes, relations=[*shapes._relations_without(other.name), relation])
        return shapes

    def stepped(self, name: str, step: int) -> ShapeModel:
        """Variable ``name`` in multiples of ``step`` (sizes the model accepts: its patch, its
        downsampling): ``name = step * <name>_blocks``, a free variable without axes."""
        return self.derived(name, Relation(name, (f"{name}_blocks",), scale=step))

    def blocks_of(self, name: str) -> str:
        """The free variable a stepped variable ``name`` is a multiple of (``name`` itself when it
        is not stepped)."""
        return next((r.terms[0] for r in self.relations if r.derived == name and r.terms == (f"{name}_blocks",)), name)

    def step_of(self, name: str) -> int:
        """The multiple variable ``name`` is in (1: any size)."""
        return next((r.scale for r in self.relations if r.derived == name and r.terms == (f"{name}_blocks",)), 1)

    def without(self, name: str) -> ShapeModel:
        """Variable ``name`` static again (eager or torch.export cannot vary it), and so every
        variable following it alone (``height = 2*height_blocks``, ``cond_height = 2*height``)."""
        following = [r.derived for r in self.relations if r.terms == (name,) and not r.constant]
        shapes = dataclasses.replace(
            self, variables=[v for v in self.variables if v.name != name], relations=self._relations_without(name),
            windows=self._windows_without(name))
        return functools.reduce(ShapeModel.without, following, shapes)

    @property
    def derivations(self) -> list[Relation | Window]:
        """Every size that follows others: the relations, then the sliding windows."""
        return [*self.relations, *self.windows]

    def _relations_without(self, name: str) -> list[Relation]:
        return [r for r in self.relations if name not in (r.derived, *r.terms)]

    def _windows_without(self, name: str) -> list[Window]:
        return [w for w in self.windows if name not in (w.derived, w.term)]

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

    def bounds(self, recorded_only: bool = False) -> dict[str, tuple[int, int]]:
        """Min and max size of each variable, over real inputs only with ``recorded_only``."""
        return {v.name: v.recorded_bounds() if recorded_only else v.bounds for v in self.variables}

    # -- renderers ------------------------------------------------------------------------------
    def to_dynamic_shapes(self, named: bool = False, constants: bool = True) -> tuple[Any, ...] | dict[str, Any]:
        """Dynamic shapes in the arguments' structure: ``Dim.DYNAMIC`` per dynamic dimension
        (the peers' form), or with ``named=True`` one named ``torch.export.Dim`` per variable.
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
            var.name: torch.export.Dim(identifier(var.name), min=sums[var.name]) if var.name in sums
            else torch.export.Dim(identifier(var.name))
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
        """The flat leaves of call ``index``.  An absent input is sized like the call's other
        inputs (a cache absent at prefill gets the prefill's batch); with meaningful stand-ins
        its value is what its absence means (see :mod:`.standins`), else an empty tensor with 0
        on its missing dimension when that dimension is dynamic (zeros otherwise).  A leaf no call
        holds a tensor for stays ``None`` (Jamba's ``attention_mask["linear_attention"]``): nothing
        gives a stand-in its shape."""
        leaves = list(self.aligned.calls[index])
        sizes = self.sizes_at(index)
        for leaf, value in enumerate(leaves):
            if value is not None or not self.aligned.is_tensor_leaf(leaf):
                continue
            kind = stand_in_kind(self.aligned, self.aligned.leaf_slot(leaf)) if self.meaningful_stand_ins else None
            if kind is None and leaf not in self.aligned.missing_dims:
                continue
            reference = self.aligned.reference_tensor(leaf)
            shape = [
                sizes.get(var.name, size) if (var := self.variable_of((leaf, dim))) else size
                for dim, size in enumerate(reference.shape)
            ]
            if kind is None:
                missing = self.aligned.missing_dims[leaf]
                shape[missing] = 0 if self.variable_of((leaf, missing)) else shape[missing]
                kind = StandIn.ZEROS
            leaves[leaf] = stand_in(kind, reference, shape, sizes.get(self._past_name(), 0))
        return leaves

    def sizes_at(self, index: int) -> dict[str, int]:
        """The size of every variable in call ``index`` that is known or follows from a relation
        (a total length from the past and new lengths)."""
        sizes = {v.name: value for v in self.variables if (value := v.values[index]) is not None}
        for relation in self.relations:
            if relation.derived not in sizes and all(t in sizes for t in relation.terms):
                sizes[relation.derived] = relation.size(sizes)
        return sizes

    def broken(self, index: int) -> list[Relation]:
        """The relations call ``index``'s recorded sizes break: a side of 40 where torch.export
        restricted it to ``height = 16*height_div16``."""
        known = {v.name: value for v in self.variables if (value := v.values[index]) is not None}
        return [r for r in self.relations
                if r.derived in known and all(t in known for t in r.terms) and r.size(known) != known[r.derived]]

    def _past_name(self) -> str:
        return next((v.name for v in self.variables if v.role == AxisRole.PAST_SEQ), "")

    def project(self, calls: list[int], slots: Collection[str], strict: bool = True) -> ShapeModel:
        """This model on some calls and arguments (a graph of its own), absent inputs of known
        meaning stood in for meaningfully.  Variables keep their names and stay dynamic even
        where the given calls do not vary them.  ``strict``: see ``AlignedCalls.subset``."""
        aligned, origin = self.aligned.subset(calls, slots, strict)
        new_leaf = {old: new for new, old in enumerate(origin)}
        variables = [
            dataclasses.replace(
                var, axes=[(new_leaf[leaf], dim) for leaf, dim in var.axes if leaf in new_leaf],
                values=[var.values[i] for i in calls], stood_in=[var.stood_in[i] for i in calls],
            )
            for var in self.variables if any(leaf in new_leaf for leaf, _ in var.axes)
        ]
        by_name = {v.name: v for v in variables}
        relations = [r for r in self.relations if {r.derived, *r.terms} <= by_name.keys()]
        windows = [w for w in self.windows if {w.derived, w.term} <= by_name.keys()]
        projected = ShapeModel(aligned, variables, relations, list(self.notes), meaningful_stand_ins=True,
                               windows=windows)
        for relation in self.relations:
            reduced = _without_absent_terms(relation, by_name)
            if reduced is None:
                continue
            if (reduced.scale, reduced.constant, len(reduced.terms)) == (1, 0, 1):
                projected = projected.merged(reduced.derived, reduced.terms[0])
            else:
                projected = dataclasses.replace(projected, relations=[*projected.relations, reduced])
        return _total_is_new_without_past(projected, by_name)

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


def _total_is_new_without_past(projected: ShapeModel, variables: dict[str, Variable]) -> ShapeModel:
    """A graph with no past (no cache, no past length) reads the mask's total length as the new
    tokens (``input_ids``' length, or ``inputs_embeds``' in a graph without ids) when its calls
    agree, even where no relation was inferred (the other calls of the model gave a cache):
    Whisper's decoder had a free total_seq, variations fed masks longer than the ids."""
    by_role = {v.role: v for v in variables.values() if v.role in (AxisRole.TOTAL_SEQ, AxisRole.PAST_SEQ)}
    total = by_role.get(AxisRole.TOTAL_SEQ)
    if total is None or AxisRole.PAST_SEQ in by_role or total.name not in {v.name for v in projected.variables}:
        return projected
    if any(r.derived == total.name or total.name in r.terms for r in projected.relations):
        return projected
    for new in (v for v in variables.values() if v.role == AxisRole.SEQ):
        if all(t is None or n is None or t == n for t, n in zip(total.values, new.values)):
            return projected.merged(total.name, new.name)
    return projected


def _without_absent_terms(relation: Relation, variables: dict[str, Variable]) -> Relation | None:
    """``relation`` in a graph without the inputs of some of its terms: a total length in a
    graph without a cache is the new length (the absent past is 0).  ``None`` unless the derived
    dim and a term are present, a term is absent, and the graph's calls follow the reduced
    relation."""
    derived = variables.get(relation.derived)
    present = tuple(t for t in relation.terms if t in variables)
    if derived is None or not present or len(present) == len(relation.terms):
        return None
    reduced = dataclasses.replace(relation, terms=present)
    for index, size in enumerate(derived.values):
        terms = {t: value for t in present if (value := variables[t].values[index]) is not None}
        if size is not None and len(terms) == len(present) and reduced.size(terms) != size:
            return None
    return reduced
