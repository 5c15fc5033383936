"""Which input dimensions are dynamic, how they relate, and what to call them.

:class:`ShapeModel` reads the aligned calls (see :mod:`.inference` for the rules and
:mod:`.naming` for the names) and renders what torch.export and onnxruntime need: dynamic
shapes in the arguments' structure, and the flat inputs of each call with absent inputs stood in
for.  Relations need calls that vary independently: with a single call nothing is related, and
the model says so in ``notes``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.text import identifier
from ..observe.alignment import AlignedCalls
from .dims import Axis, Relation, Variable
from .inference import derive_relations, forced_batch_axes, infer_variables
from .naming import name_variables


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
        forced = forced_batch_axes(aligned, set_batch_dimension_for)
        variables = infer_variables(aligned, forced)
        notes: list[str] = []
        relations: list[Relation] = []
        if aligned.n_calls < 2:
            notes.append("one observed call: no relation between dimensions can be inferred")
        else:
            relations = derive_relations(variables)
        overrides = dim_names if isinstance(dim_names, dict) else {}
        relations = name_variables(aligned, variables, relations, overrides, forced)
        return cls(aligned, variables, relations, notes)

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
