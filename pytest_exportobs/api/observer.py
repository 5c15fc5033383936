"""``InputObserver``: record a model's calls, then ask for export arguments and dynamic shapes."""

from __future__ import annotations

from typing import Any

from ..core.trees import flattening_context
from ..engine.verify import OnnxRunner, Tolerance, verify_calls
from ..observe.recorder import CallRecorder
from ..shapes.model import ShapeModel


class InputObserver(CallRecorder):
    """Records the calls of a module's method, then infers what ``torch.export`` needs.

    >>> observer = InputObserver()
    >>> with observer(model):
    ...     model(x1, y1)
    ...     model(x2, y2)
    >>> torch.export.export(model, observer.infer_arguments(),
    ...                     dynamic_shapes=observer.infer_dynamic_shapes())

    ``value_if_missing`` gives, by argument name or position, the value to assume for an
    argument absent from some calls (e.g. ``pixel_values`` after the prefill step); it is
    only used to infer shapes and arguments, never to run the model.
    """

    def infer_dynamic_shapes(
        self,
        set_batch_dimension_for: bool | set[int | str] | None = None,
        dim_names: bool | dict[str, str] | None = None,
    ) -> tuple[Any, ...] | dict[str, Any]:
        """Dynamic shapes for ``torch.export.export`` inferred from the recorded calls.

        By default every dimension that varies across calls is ``Dim.DYNAMIC`` (the seed form).
        ``set_batch_dimension_for`` forces the first dimension of the given inputs (all with
        ``True``) to be dynamic. ``dim_names=True`` names the dimensions with their relations
        (one symbol for a shared batch, ...), a dict overrides names.
        """
        model = ShapeModel.from_aligned(self.aligned(), set_batch_dimension_for, dim_names)
        with flattening_context():
            return model.to_dynamic_shapes(named=bool(dim_names))

    def infer_arguments(self, index: int | None = None) -> tuple[Any, ...] | dict[str, Any]:
        """Arguments for ``torch.export.export``: one recorded call, in the structure of the
        richest call, absent optional inputs replaced by empty tensors.

        ``index`` selects a recorded call; by default the first one that has every input.
        """
        aligned = self.aligned()
        if index is not None and not -len(self.observations) <= index < len(self.observations):
            raise IndexError(f"index {index} out of range: {len(self.observations)} recorded calls")
        shapes = ShapeModel.from_aligned(aligned)
        with flattening_context():
            return aligned.arguments(
                shapes.call_leaves(aligned.complete_call() if index is None else index % aligned.n_calls)
            )

    def check_discrepancies(
        self, onnx_model_or_path: Any, atol: float = 1e-4, rtol: float = 0.1
    ) -> list[dict[str, Any]]:
        """Run the ONNX model on every recorded call and compare with the eager outputs.

        One row per observation: ``index``, ``SUCCESS``, ``abs``, ``rel``, ``n``.
        """
        shapes = ShapeModel.from_aligned(self.aligned())
        calls = [shapes.call_leaves(index) for index in range(shapes.aligned.n_calls)]
        discrepancies = verify_calls(
            OnnxRunner(onnx_model_or_path), calls, [o.outputs for o in self.observations],
            Tolerance(atol=atol, rtol=rtol),
        )
        return [d.as_row() for d in discrepancies]
