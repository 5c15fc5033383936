"""Turn one model group into a verdict: infer shapes, plan graphs, check each, summarize.

The shape model is inferred from every recorded call at once (with the dims roles demand);
calls are then planned onto graphs (:mod:`.planning`), each exported and verified by a
:class:`~.graph.GraphCheck`.  A plan whose calls an already exported graph reproduces needs no
export of its own.  The model passes when every graph passes and no call is left unverified.
"""

from __future__ import annotations

import contextlib
import time
import traceback
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from ..core.capture import captured_output
from ..core.configuration import declared_channels
from ..core.paths import model_directory
from ..core.text import error_line
from ..core.trees import flattening_context
from ..core.vocabulary import Kind, Stage, Target, Verdict
from ..observe.binding import UnsupportedInput
from ..observe.store import ModelGroup
from ..observe.structures import structure_difference
from ..shapes.inference import DimPolicy, taken
from ..shapes.model import ShapeModel
from .base.environment import EnvironmentProblem
from .base.result import GraphResult, ModelResult
from .base.settings import CheckSettings
from .context import ModelContext
from .export.digests import module_digest
from .export.learned import LearnedDims
from .export.pipeline import Traced
from .export.tracing_patches import TracingPatches
from .graph import GraphCheck
from .planning import MAX_GRAPHS, GraphPlan, by_choice, can_serve, plan_graphs, split_off
from .settled import is_settled, new_result
from .verify.compare import Tolerance
from .verify.references import ReferenceFailed, references
from .verify.resized import sides

Progress = Callable[[Stage, str], None]  # the stage a check reached, on which graph ("": the model)
T = TypeVar("T")


def check_model(
    group: ModelGroup, settings: CheckSettings, progress: Progress = lambda stage, graph: None
) -> ModelResult:
    """Check one group for each of ``settings.targets``, in turn, from the same calls and
    references, each target after the first taking the programs traced for the first; never
    raises.  The result is the first target's, the others' in its ``other_targets``.  A failure
    of a stage is the model's; an exception the engine did not expect is stage ``engine``, kind
    ``internal``: a bug of the plugin."""
    results = [new_result(group, target) for target in settings.targets]
    first = results[0]
    if is_settled(group, first):
        return first  # every target's, alike (see ModelResult.per_target)
    found, notes = sides(group)
    if not found:
        first.model_notes.extend(notes)
        first.verdict, first.stage = Verdict.SKIPPED, Stage.OBSERVE
        first.reason = ("the model's parameters changed shape after its calls (resize_token_embeddings, an adapter "
                        "added) and no call fits the weights at hand: nothing to check")
        return first
    shared = _Shared()
    for result in results:
        result.model_notes.extend(notes)
        shown = progress if result is first else _labelled(progress, str(result.target))
        _check_sides(found, settings, result, shown, shared)
    first.other_targets = results[1:]
    return first


@dataclass
class _Shared:
    """What one target's check hands the next, one family of calls the next: by the side's group,
    its calls' references, its module's digest as first found and what torch said of its named
    dims; the programs traced, by trace key."""

    references: dict[int, Any] = field(default_factory=dict)
    digests: dict[int, Any] = field(default_factory=dict)
    learned: dict[int, LearnedDims] = field(default_factory=dict)
    traces: dict[str, Traced] = field(default_factory=dict)


def _labelled(progress: Progress, label: str) -> Progress:
    return lambda stage, graph: progress(stage, ", ".join(filter(None, [label, graph])))


def _check_sides(found: list[Any], settings: CheckSettings, result: ModelResult, progress: Progress,
                 shared: _Shared) -> None:
    """Check each side of the model (see :func:`~.verify.resized.sides`) for ``result.target``."""
    try:
        graphs: list[GraphResult] = []
        unverified: list[str] = []
        unchecked: list[int] = []
        for side in found:
            if _ended(graphs, settings):
                unchecked += side.calls
                continue
            check = _ModelCheck(side.group, settings, result, progress, shared, len(graphs))
            side_graphs, left_over = check.run()
            for graph in side_graphs:
                graph.renumber(side.calls)
                graph.name = ", ".join(filter(None, [side.label, graph.name]))
            graphs += side_graphs
            unchecked += [side.calls[c] for c in check.unchecked]
            unverified += [f"{side.label}: {left_over}" if side.label else left_over] if left_over else []
        if unchecked:
            result.model_notes.append(
                f"calls {sorted(unchecked)} not checked: the check ended at the first failing graph, whose failure "
                "is the model's verdict (--export-every-graph checks them)")
        result.conclude(graphs, "; ".join(unverified))
        if result.verdict == Verdict.PASSED:
            result.output = ""
    except ModelProblem as e:
        result.verdict, result.stage, result.kind, result.reason = Verdict.FAILED, e.stage, e.kind, str(e)
    except EnvironmentProblem as e:  # the machine's: a session problem, no verdict
        result.verdict, result.stage, result.kind, result.reason = Verdict.FAILED, e.stage, Kind.ENVIRONMENT, str(e)
    except Exception as e:
        result.verdict, result.stage, result.kind = Verdict.FAILED, Stage.ENGINE, Kind.INTERNAL
        result.reason = f"internal error of pytest-exportobs, not of the model (please report it): {error_line(e)}"
        result.traceback = "".join(traceback.format_exception(e))


def _ended(graphs: list[GraphResult], settings: CheckSettings) -> bool:
    """Whether a model's check ends here: a graph failed (its failure is the model's verdict, see
    :meth:`~.base.result.ModelResult.conclude`) and ``every_graph`` is off."""
    return not settings.every_graph and any(not g.passed and g.verdict != Verdict.SKIPPED for g in graphs)


class ModelProblem(Exception):
    """What the model gives the engine cannot be checked: the ``stage`` and ``kind`` it fails with."""

    def __init__(self, stage: Stage, kind: Kind, message: str):
        super().__init__(message)
        self.stage, self.kind = stage, kind


class _ModelCheck:
    """The check of one model, filling ``result``."""

    def __init__(self, group: ModelGroup, settings: CheckSettings, result: ModelResult, progress: Progress,
                 shared: _Shared, first_graph: int = 0):
        self.group, self.settings, self.result, self.progress = group, settings, result, progress
        self.shared = shared
        self.first_graph = first_graph  # the number of this check's first graph among the model's
        self.options = group.options
        self.patches = TracingPatches()
        self.unchecked: list[int] = []  # the group's calls past the first failing graph (see _ended)

    def run(self) -> tuple[list[GraphResult], str]:
        """The graphs of the model (their calls numbered as the group's) and the calls no graph
        ran, said in a line ("" when none)."""
        try:
            self.patches = TracingPatches.resolved((*self.settings.patches, *self.options.patches))
        except ValueError as e:  # a patch the user named that cannot be imported
            raise ModelProblem(Stage.INFER, Kind.ERROR, f"ValueError: {e}") from e
        graphs: list[GraphCheck] = []
        unverified: list[str] = []
        with flattening_context(), _eval_no_grad(self.group.module):
            observations = list(self.group.recorder.observations)
            self._take_digest()
            found = self._references(observations)
            self.result.model_notes.extend(found.left_out.values())
            kept = [[i for i in family if i not in found.left_out] for family in self.group.recorder.families()]
            families = [family for family in kept if family]
            for family in families:
                if _ended([g.result for g in graphs], self.settings):
                    self.unchecked += family
                    continue
                joint = self._infer(family)
                context = self._context(family, observations, found)
                checks, left = self._check_graphs(joint, context, self.first_graph + len(graphs))
                if family is not families[0]:
                    _name_structure(checks, self._difference(families[0][0], family[0]))
                graphs.extend(checks)
                if left:
                    shown = ", ".join(sorted(joint.aligned.present_slots(left[0])))
                    unverified.append(f"calls {[family[i] for i in left]} (they pass {shown})")
        if len(families) > 1:
            self.result.model_notes.append(
                f"{len(families)} input structures (ranks, dtypes or cache classes differ), "
                f"each with its own graphs: calls {' | '.join(_spans(f) for f in families)}")
        left_over = (f"{'; '.join(unverified)} run on no exported graph "
                     f"(at most {MAX_GRAPHS} graphs per input structure)") if unverified else ""
        return [g.result for g in graphs], left_over

    def _difference(self, first: int, other: int) -> str:
        """What sets recorded call ``other``'s input structure apart from call ``first``'s."""
        recorder = self.group.recorder
        assert recorder.signature is not None  # the calls compared were recorded
        first_call, other_call = [(o.args, o.kwargs) for o in (recorder.observations[i] for i in (first, other))]
        return structure_difference(first_call, other_call, recorder.signature)

    def _infer(self, family: list[int]) -> ShapeModel:
        self.progress(Stage.INFER, "")
        begin = time.perf_counter()
        options = self.options
        try:
            aligned = self.group.recorder.aligned(mixed_constants=True, calls=family)
            policy = DimPolicy(
                roles=(options.dims or self.settings.dims) == "roles",
                dynamic=frozenset(options.dynamic),
                # the session's pins, but the axes the model's own marker declares dynamic
                static=frozenset(options.static) | (taken(aligned, self.settings.static) - frozenset(options.dynamic)),
                channels=declared_channels(self.group.module),
            )
            joint = ShapeModel.from_aligned(aligned, options.set_batch_dimension_for, options.dim_names, policy)
        except UnsupportedInput as e:
            raise ModelProblem(Stage.INFER, Kind.UNSUPPORTED_INPUT, str(e)) from e
        except (TypeError, ValueError) as e:  # calls that disagree, bad marker options
            raise ModelProblem(Stage.INFER, Kind.ERROR, str(e)) from e
        timings = self.result.model_timings
        timings[Stage.INFER] = timings.get(Stage.INFER, 0.0) + time.perf_counter() - begin
        if not self.result.inferred:  # the largest family's
            summary = joint.to_json()
            self.result.inferred = {k: summary[k] for k in ("dims", "relations", "bounds")}
        self.result.model_notes.extend(n for n in joint.notes if n not in self.result.model_notes)
        return joint

    def _take_digest(self) -> None:
        """The module's digest as the tests left it, before the check's own calls (the export
        cache's keys read it; one the module cannot give is read again at each key, and fails there)."""
        if id(self.group) not in self.shared.digests and self.settings.use_cache:
            try:
                self.shared.digests[id(self.group)] = module_digest(self.group.module)
            except Exception:
                self.shared.digests[id(self.group)] = None

    def _references(self, observations: list[Any]) -> Any:
        found = self.shared.references.get(id(self.group))
        if found is None:
            try:
                found = self._quiet(lambda: references(self.group, observations))
            except ReferenceFailed as e:  # the model's own call raised
                raise ModelProblem(Stage.VERIFY, Kind.UNVERIFIED, str(e)) from e
            self.shared.references[id(self.group)] = found
        self.result.reference = found.origin
        if not any(isinstance(t, torch.Tensor) for outputs in found.outputs for t in outputs):
            raise ModelProblem(
                Stage.INFER, Kind.UNSUPPORTED_OUTPUT,
                "the model returns no tensor (None or constants only): nothing to export",
            )
        return found

    def _context(self, family: list[int], observations: list[Any], found: Any) -> ModelContext:
        """What the graphs of one family share (calls indexed as in the family)."""
        options, settings = self.options, self.settings
        tolerance = Tolerance(_first(options.atol, settings.atol), _first(options.rtol, settings.rtol))
        self.result.atol, self.result.rtol = tolerance.atol, tolerance.rtol
        return ModelContext(
            group=self.group, settings=self.settings, target=Target(self.result.target), traces=self.shared.traces,
            tolerance=tolerance,
            examples=_first(self.options.examples, self.settings.examples),
            patches=self.patches,
            model_dir=model_directory(self.settings.export_dir, self.group.name),
            observations=[observations[i] for i in family], references=[found.outputs[i] for i in family],
            quiet=self._quiet, progress=self.progress, ids=list(family),
            module_digest=self.shared.digests.get(id(self.group)),
            learned=self.shared.learned.setdefault(id(self.group), LearnedDims()),
        )

    def _check_graphs(
        self, joint: ShapeModel, context: ModelContext, first_graph: int = 0
    ) -> tuple[list[GraphCheck], list[int]]:
        """Export and verify graph after graph; plans an exported graph serves need none.
        Returns the checks (their calls numbered as the model's) and the calls left unverified."""
        queue = deque(plan_graphs(joint.aligned))
        done: list[GraphCheck] = []
        unverified: list[int] = []
        while queue:
            plan = queue.popleft()
            if any(_serves(check, joint, plan) for check in done):
                continue
            if len(done) >= MAX_GRAPHS:
                unverified.extend(plan.calls)
                continue
            number = first_graph + len(done)
            directory = context.model_dir / (f"graph{number}" if number else "")
            check = GraphCheck(context, plan, plan.shapes(joint), directory)
            check.run()
            if check.choice:
                queue.extendleft(reversed(by_choice(joint, plan, check.choice, check.why)))
                continue
            done.append(check)
            for split in split_off(joint.aligned, plan, check.split):
                missing = ", ".join(sorted(plan.slots - split.slots))  # none: outside a restriction
                split.name = ", ".join(filter(None, [plan.name, f"without {missing}" if missing else check.apart]))
                check.result.name = check.result.name or (f"with {missing}" if missing else "")
                queue.append(split)
            if _ended([check.result], self.settings):
                self.unchecked += [context.ids[c] for plan in queue for c in plan.calls]
                break
        for check in done:
            check.result.renumber(context.ids)
        return done, unverified

    def _quiet(self, call: Callable[[], T]) -> T:
        """Run ``call`` with its output (torch's graph dumps, C++ and logging warnings) and its Python
        warnings kept in the result: torch warns about its own internals during export, and a user
        suite running with ``-W error`` must not turn those into export failures."""
        output: list[str] = []
        try:
            with warnings.catch_warnings(record=True) as caught, captured_output() as output:
                warnings.simplefilter("always")
                return call()
        finally:
            self.result.output += "".join(output)
            self.result.output += "".join(f"{w.category.__name__}: {w.message}\n" for w in caught)


def _serves(check: GraphCheck, joint: ShapeModel, plan: GraphPlan) -> bool:
    """Whether an exported graph runs every call of ``plan`` and reproduces it (projected with
    the graph's own calls, which hold a value of every argument the graph takes)."""
    if not all(can_serve(joint.aligned, check.plan.slots, i) for i in plan.calls):
        return False
    return check.serves(joint.project([*check.plan.calls, *plan.calls], check.plan.slots, strict=False), plan.calls)


def _name_structure(checks: list[GraphCheck], difference: str) -> None:
    """Prefix the graphs of a family with what sets its structure apart (``attention_mask bool``)."""
    for check in checks:
        check.result.name = ", ".join(filter(None, [difference, check.result.name]))


def _spans(indices: list[int]) -> str:
    return ", ".join(map(str, indices)) if len(indices) < 6 else f"{len(indices)} calls from {indices[0]}"


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


@contextlib.contextmanager
def _eval_no_grad(module: torch.nn.Module) -> Iterator[None]:
    training = module.training
    module.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        module.train(training)
