"""``InputObserver``: record a model's calls, then ask for export arguments and dynamic shapes.

A superset of ``torch.onnx.InputObserver`` (torch >= 2.11) and of the observers of
onnx-diagnostic and yobx: the same methods and keywords, user errors that are both
``ValueError`` and ``RuntimeError``, and more call sequences inferred (see docs/api.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..core.trees import flattening_context
from ..engine.verify.compare import Tolerance, verify_calls
from ..engine.verify.runtimes import OnnxRunner
from ..observe.recorder import CallRecorder, Observation
from ..shapes.model import ShapeModel
from ..shapes.spec import spec_api, to_shapes_spec
from .dim_names import LLM, is_per_input, llm_names, names_per_input
from .errors import ObserverError, ObserverIndexError, user_errors
from .removal import without_inputs

DimNames = bool | str | dict[str, str] | dict[str | int, dict[int, str]] | None
Arguments = tuple[Any, ...] | dict[str, Any]


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

    def is_empty(self) -> bool:
        """Whether no call was recorded."""
        return not self.observations

    @contextlib.contextmanager
    def __call__(
        self, model: torch.nn.Module, store_n_calls: int = 3, method_name: str = "forward"
    ) -> Iterator[InputObserver]:
        """Record the calls of ``model.<method_name>`` made inside the ``with`` block (at most
        ``store_n_calls`` new distinct ones); the method is restored on exit."""
        if not callable(getattr(model, method_name, None)):
            raise ObserverError(f"{type(model).__name__} does not have a method {method_name!r} to observe")
        with contextlib.ExitStack() as stack:
            with user_errors():
                stack.enter_context(super().__call__(model, store_n_calls, method_name))
            yield self

    # -- inference ------------------------------------------------------------------------------
    def infer_dynamic_shapes(
        self, set_batch_dimension_for: bool | set[int | str] | None = None, dim_names: DimNames = None,
        as_spec: bool = False,
    ) -> Arguments:
        """Dynamic shapes for ``torch.export.export`` inferred from the recorded calls.

        Every dimension that varies across calls is ``Dim.DYNAMIC`` (the peers' form).
        ``set_batch_dimension_for`` forces the first dimension of the given inputs (all with
        ``True``) to be dynamic. ``dim_names`` names the dimensions:

        * ``True``: one ``torch.export.Dim`` per inferred dimension (a shared batch is one
          symbol), named by its role (``batch``, ``seq``, ``past_seq``, ``total_seq`` ...);
          a dict ``{name or "input:axis": new name}`` overrides names;
        * ``"llm"``: the same dimensions as strings named as LLM runtimes name them
          (``batch_size``, ``sequence_length``, ``past_sequence_length`` ...);
        * ``{input name or position: {axis: name}}`` (yobx): those names as strings, any
          other dynamic axis ``<input>_dim_<axis>``.

        ``as_spec=True`` (torch >= 2.14) returns a ``torch.fx.experimental.dynamic_spec``
        ``ShapesSpec`` instead: one ``ShapeVar`` per dimension and the relations as expressions
        (``attention_mask`` of length ``past_seq + seq``), which the exported program checks.
        """
        if as_spec:
            return self._shapes_spec(set_batch_dimension_for)
        if isinstance(dim_names, str) and dim_names != LLM:
            raise ObserverError(f"dim_names={dim_names!r}: expected None, True, {LLM!r} or a dict")
        ours = None if is_per_input(dim_names) else (True if dim_names == LLM else dim_names)
        shapes = self._shape_model(set_batch_dimension_for, ours)
        with flattening_context():
            dynamic_shapes = shapes.to_dynamic_shapes(named=bool(ours))
        if dim_names == LLM:
            return llm_names(dynamic_shapes)
        if is_per_input(dim_names):
            assert self.signature is not None
            with user_errors():
                return names_per_input(
                    dynamic_shapes, dim_names, list(self.signature.parameters), shapes.aligned.kwargs_name
                )
        return dynamic_shapes

    def _shapes_spec(self, set_batch_dimension_for: bool | set[int | str] | None) -> Any:
        if spec_api() is None:
            raise ObserverError(
                "as_spec=True needs torch >= 2.14 (torch.fx.experimental.dynamic_spec); "
                f"this is torch {torch.__version__}"
            )
        shapes = self._shape_model(set_batch_dimension_for, True)
        with flattening_context():
            return to_shapes_spec(shapes)

    def infer_arguments(
        self,
        index_or_args_or_kwargs: int | tuple[Any, ...] | dict[str, Any] | None = None,
        flat: bool = False,
        as_args_kwargs: bool = False,
        *,
        index: int | None = None,
    ) -> Arguments | list[Any] | tuple[tuple[Any, ...], dict[str, Any]]:
        """Arguments for ``torch.export.export``, in the structure of the richest call, absent
        optional inputs replaced by empty tensors.

        ``index_or_args_or_kwargs``: ``None`` for the first call that has every input, the
        index of a recorded call, or new inputs (a tuple of positional arguments or a dict of
        keyword arguments) to complete in the same way. The result is a tuple (positional
        calls) or a dict; ``as_args_kwargs=True`` always gives ``(args, kwargs)``, ``flat=True``
        the flat list of leaves. ``index=`` is the peers' keyword for an index.
        """
        shapes, index = self._call_to_complete(index_or_args_or_kwargs if index is None else index)
        aligned = shapes.aligned
        with flattening_context():
            leaves = shapes.call_leaves(index)
            if flat:
                return leaves
            args, kwargs = aligned.split_arguments(leaves)
        if as_args_kwargs:
            return args, kwargs
        if args and kwargs:
            raise ObserverError(
                "Cannot return arguments as a single tuple or a single dictionary because of "
                "'*args' in the signature: use infer_arguments(as_args_kwargs=True)"
            )
        return kwargs if kwargs else args

    def _call_to_complete(self, selected: int | tuple[Any, ...] | dict[str, Any] | None) -> tuple[ShapeModel, int]:
        """The shape model and the index of the call ``infer_arguments`` renders."""
        if selected is None or (isinstance(selected, int) and not isinstance(selected, bool)):
            shapes = self._shape_model()
            n_calls = shapes.aligned.n_calls
            if selected is None:
                return shapes, shapes.aligned.complete_call()
            if not -n_calls <= selected < n_calls:
                raise ObserverIndexError(f"index {selected} out of range: {n_calls} recorded calls")
            return shapes, selected % n_calls
        if isinstance(selected, (tuple, dict)):
            args, kwargs = (selected, {}) if isinstance(selected, tuple) else ((), selected)
            probe = self._with_call(args, kwargs)
            return probe._shape_model(), len(probe.observations) - 1
        raise ObserverError(
            f"Unexpected type {type(selected).__name__} for index_or_args_or_kwargs: expected None, "
            f"the index of a recorded call, a tuple of positional arguments or a dict of keyword arguments"
        )

    def _with_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> InputObserver:
        """A copy of this observer with one more recorded call (no outputs), which may lack
        required arguments: they are stood in for like absent optional ones."""
        if self.signature is None:
            self._shape_model()  # raises: nothing was recorded
        assert self.signature is not None
        probe = InputObserver(self.value_if_missing)
        probe.signature = self.signature.replace(parameters=[
            p.replace(default=None) if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) else p
            for p in self.signature.parameters.values()
        ])
        probe.observations = [*self.observations, Observation(args=args, kwargs=kwargs, outputs=[])]
        return probe

    def _shape_model(
        self, set_batch_dimension_for: bool | set[int | str] | None = None, dim_names: Any = None
    ) -> ShapeModel:
        """The shape model of the recorded calls, once checked one call has every input."""
        with user_errors("No inputs were captured: " if not self.observations else ""):
            aligned = self.aligned()
        lacking = [aligned.absent_slots(index) for index in range(aligned.n_calls)]
        if all(lacking):
            shown = "; ".join(f"call {i} lacks {', '.join(names)}" for i, names in enumerate(lacking))
            raise ObserverError(
                "At least one call to the observed model must contain all the named arguments, "
                f"to tell the shapes of the inputs the others lack: {shown}. Pass "
                "InputObserver(value_if_missing={name: empty tensor}) for an input some calls lack"
            )
        with user_errors():
            return ShapeModel.from_aligned(aligned, set_batch_dimension_for, dim_names)

    # -- editing --------------------------------------------------------------------------------
    def remove_inputs(self, input_names: Sequence[str | int]) -> int:
        """Forget the given inputs (names or positions) in every recorded call, as if they had
        never been passed; return how many values were removed. Unknown names remove nothing."""
        if not self.observations or self.signature is None:
            raise ObserverError("No input was captured: there is no input to remove")
        with user_errors():
            removed, self.signature = without_inputs(self.observations, self.signature, input_names)
        for key in [k for k in self.value_if_missing if k in input_names or k not in self.signature.parameters]:
            del self.value_if_missing[key]
        return removed

    # -- verification ---------------------------------------------------------------------------
    def check_discrepancies(
        self,
        onnx_model_or_path: Any,
        atol: float = 1e-4,
        rtol: float = 0.1,
        progress_bar: bool = False,
        initializer: Any = None,
        skip_none: bool = True,
    ) -> list[dict[str, Any]]:
        """Run the ONNX model (a path, a ``ModelProto`` or a ``torch.onnx.ONNXProgram``) on every
        recorded call with onnxruntime's CPU provider and compare with the eager outputs.

        One row per call: ``index``, ``SUCCESS``, ``abs``, ``rel``, ``n`` (values compared),
        ``n_inputs``, ``n_none`` (absent inputs), ``n_empty`` (empty input tensors). Outputs that
        are ``None`` are skipped. ``progress_bar`` shows one if tqdm is installed;
        ``initializer`` and ``skip_none`` are accepted for torch.onnx.InputObserver's signature.
        """
        shapes = self._shape_model()
        aligned = shapes.aligned
        with flattening_context():
            calls = [shapes.call_leaves(index) for index in range(aligned.n_calls)]
        expected = []
        for index in aligned.kept:
            outputs = self.observations[index].outputs
            assert outputs is not None  # an observer keeps every call's outputs: it sets no OutputAllowance
            expected.append(outputs)
        discrepancies = verify_calls(
            OnnxRunner(onnx_model_or_path), _progress(calls, progress_bar), expected, Tolerance(atol=atol, rtol=rtol),
        )
        return [
            {**d.as_row(), "n_inputs": len(leaves), **_counts(recorded, leaves)}
            for d, leaves, recorded in zip(discrepancies, calls, aligned.calls)
        ]


def _counts(recorded: list[Any], leaves: list[Any]) -> dict[str, int]:
    """``n_none``: inputs the call lacked; ``n_empty``: empty tensors among its inputs."""
    return {
        "n_none": sum(t is None for t in recorded),
        "n_empty": sum(isinstance(t, torch.Tensor) and t.numel() == 0 for t in leaves),
    }


def _progress(calls: list[Any], progress_bar: bool) -> Sequence[Any]:
    """``calls``, wrapped in a tqdm progress bar when asked and tqdm is installed."""
    if not progress_bar:
        return calls
    try:
        from tqdm import tqdm
    except ImportError:
        return calls
    return tqdm(calls)

