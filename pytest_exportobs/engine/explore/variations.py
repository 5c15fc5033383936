"""Explore input shapes the test suite never used, with hypothesis, and shrink a failure.

Each free dimension variable of the :class:`~..shapes.model.ShapeModel` gets a size drawn around its
observed bounds (:mod:`.ranges`; derived variables follow their relation, equal dimensions are one variable);
:func:`~..shapes.synthesis.build_leaves` turns the sizes into valid inputs.  An example is *invalid* when
the eager model itself raises on it, *failed* when the exported model raises or disagrees with
eager beyond the verify stage's tolerances.  Labels lined up with a padding mask ignore its padded
positions, unless eager rejects the ignore index (then the example runs with the plain labels).
When eager rejects the synthesized inputs of an example that sizes batches only, the example
runs with a recorded call's rows repeated to those sizes (synthesized token ids lack what ties
them to other inputs, as a multimodal model's image tokens to its pixel values).
Sizes are drawn as offsets from the sizes the graph was traced at, so that hypothesis shrinks a
failure to the sizes nearest them: a size that plays no part in the failure goes back to its
traced value, and the sizes left apart from it are the ones the graph cannot serve.  When none
of its examples fails, the largest one (every free size at its high) runs too: a graph that
serves only the sizes it was traced at fails there whatever hypothesis drew.

Randomness: with ``seed`` or under ``CI=true`` the examples are derandomized (same examples
every run; hypothesis then disables its database, as it does for ``@seed`` and
``derandomize``).  Otherwise failures are saved in a directory database under a key derived
from the model's inputs and replayed first on the next run.  The tensors of an example are a
function of its sizes only, so a replayed example is the very same inputs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from random import Random
from typing import TYPE_CHECKING, Any

import sympy
import torch

from ...compat.hypothesis_private import collect_local_constants
from ...core.trees import detached_clone
from ...shapes.model import ShapeModel
from ...shapes.synthesis import (
    Recipe,
    build_leaves,
    complete_sizes,
    export_sizes,
    free_variables,
    ignore_padded_labels,
    recipes,
    rows_repeated,
)
from ..base.eager import ModelRaised
from ..export.domain import satisfied
from ..verify.arbiter import Float64Model
from ..verify.compare import Discrepancy, OutputLayout, Tolerance, run_and_compare
from .alike import failing_alike
from .ranges import size_ranges

if TYPE_CHECKING:
    import hypothesis

DATABASE_PREFIX = b"pytest-exportobs.variations."

Sizes = dict[str, int]
Leaves = list[Any]


@dataclass
class VariationOutcome:
    """What the exploration tried and the smallest failing example, if any.

    ``tried`` counts distinct examples run (generation and shrinking), ``valid`` those eager
    accepts, ``invalid`` those eager rejects, ``failed`` the valid ones the exported model got
    wrong, ``rounded`` the valid ones it got right where eager rounds (the model in float64
    decided).  ``examples`` lists the free sizes tried, in order; ``alike``, the other guessed
    sides failing as the smallest failing example does (see :mod:`.alike`).
    """

    tried: int = 0
    valid: int = 0
    invalid: int = 0
    failed: int = 0
    rounded: int = 0
    failing_sizes: Sizes | None = None
    max_abs: float | None = None
    detail: str = ""
    failing_leaves: Leaves | None = None
    examples: list[Sizes] = field(default_factory=list)
    alike: Sizes = field(default_factory=dict)  # guessed sides failing alike, each moved alone (see .alike)

    def to_json(self) -> dict[str, Any]:
        """JSON-native summary, without the failing leaves."""
        summary = asdict(self)
        del summary["failing_leaves"]
        return summary

    def notes(self) -> list[str]:
        """What the exploration tells besides its failure: examples where eager rounds, examples
        eager rejects."""
        notes = []
        if self.rounded:
            notes.append(f"variations: {self.rounded} examples differ from eager beyond tolerance where eager rounds "
                         "as much (the graph is within tolerance of the model in float64 widened by eager's distance "
                         "from it)")
        if self.tried and not self.valid:
            notes.append(f"variations: eager rejected all {self.tried} generated examples: the model relates sizes "
                         "that the shape model keeps independent (e.g. mask = seq + a constant past)")
        return notes

    @classmethod
    def from_json(cls, summary: dict[str, Any] | None) -> VariationOutcome | None:
        """The outcome :meth:`to_json` summarized; ``None`` for no summary or one of other fields."""
        try:
            return None if summary is None else cls(**summary)
        except TypeError:
            return None


def explore(
    eager: Callable[[Leaves], list[torch.Tensor | None]],
    run: Callable[[Sequence[Any]], Sequence[Any]],
    shapes: ShapeModel,
    tolerance: Tolerance,
    examples: int,
    seed: int | None,
    database_dir: Path,
    recorded_only: bool = False,
    outputs: OutputLayout | None = None,
    pad_token_id: int | None = None,
    asserted: Sequence[Any] = (),
    storage_dir: Path | None = None,
    float64: Float64Model | None = None,
    ceilings: Mapping[str, int] | None = None,
    output_elements: sympy.Basic | None = None,
) -> VariationOutcome:
    """Run ``examples`` generated examples through ``eager`` and ``run`` and compare them, then,
    unless one failed, the largest (every free size at the high of its range, whatever
    hypothesis drew), and after a failure the other guessed sides (:mod:`.alike`); never raises
    for a model problem (an exception of ``run`` fails its example).
    ``recorded_only``: see :func:`size_ranges`; ``pad_token_id``: see :func:`~..shapes.synthesis.recipes`;
    ``asserted``: conditions on the sizes the export asserts at run time (an example breaking one
    is invalid: outside the domain of the export, whatever eager makes of it); ``storage_dir``:
    hypothesis' own storage (the constants it reads from the sources of the local modules, cached
    by their hash), ``database_dir`` unless given: one for a session spares each check reading
    every local module again; ``float64``: the model in float64, which judges a mismatch (see
    :mod:`..verify.arbiter`); ``ceilings``, ``output_elements``: see :func:`size_ranges`."""
    from hypothesis import find, strategies
    from hypothesis.errors import NoSuchExample, Unsatisfiable

    ranges = size_ranges(shapes, recorded_only=recorded_only, ceilings=ceilings, output_elements=output_elements)
    trials = _Trials(eager, run, shapes, tolerance, recipes(shapes, pad_token_id), outputs, list(asserted), float64)
    if not ranges or examples <= 0:
        return trials.outcome(None)
    traced = export_sizes(shapes)
    strategy = strategies.fixed_dictionaries(
        {name: _near(traced.get(name, low), low, high) for name, (low, high) in ranges.items()}
    )
    try:
        with _hypothesis_home(storage_dir or database_dir):
            minimal = find(
                strategy, trials.fails, settings=_settings(examples, seed, database_dir / "examples"),
                random=None if seed is None else Random(seed), database_key=_database_key(shapes),
            )
    except (NoSuchExample, Unsatisfiable):  # every valid example passed, or none was valid
        minimal = None
    largest = {name: high for name, (_, high) in ranges.items()}
    if minimal is None and (verdict := trials.verdict(largest)) is not None and not verdict.ok:
        minimal = largest  # hypothesis' draws missed it: a graph that serves only small sizes
    alike = failing_alike(trials.verdict, shapes, ranges, traced, minimal) if minimal is not None else {}
    return replace(trials.outcome(minimal), alike=alike)


def prepare_variations(storage_dir: Path) -> None:
    """Read what hypothesis draws some examples from (the local modules' constants) once, with
    ``storage_dir`` as its storage: before forked checks, which inherit it instead of each
    reading every local module again."""
    with _hypothesis_home(storage_dir):
        collect_local_constants()


@contextlib.contextmanager
def _hypothesis_home(directory: Path) -> Iterator[None]:
    """Keep what hypothesis stores on its own (its constants cache) in the export directory."""
    from hypothesis import configuration

    previous = configuration.storage_directory(intent_to_write=False).home_directory
    configuration.set_hypothesis_home_dir(directory)
    try:
        yield
    finally:
        configuration.set_hypothesis_home_dir(previous)


MAX_INVALID = 30  # eager rejections after which no more example is run


@dataclass(repr=False)  # hypothesis describes its condition with repr(): keep the tensors out
class _Trials:
    """Runs each example once (by its sizes) and remembers the order and the verdicts."""

    eager: Callable[[Leaves], list[torch.Tensor | None]]
    run: Callable[[Sequence[Any]], Sequence[Any]]
    shapes: ShapeModel
    tolerance: Tolerance
    leaf_recipes: list[Recipe]
    outputs: OutputLayout | None = None
    asserted: list[Any] = field(default_factory=list)  # see explore()
    float64: Float64Model | None = None  # see explore()
    examples: list[Sizes] = field(default_factory=list)
    verdicts: list[Discrepancy | None] = field(default_factory=list)  # None: invalid
    ran: list[int] = field(default_factory=list)  # per example, which of its candidates eager took

    def fails(self, free: Sizes) -> bool:
        """hypothesis' condition: ``True`` when the exported model is wrong on this example."""
        from hypothesis import assume

        free = {name: free[name] for name in free_variables(self.shapes)}  # hypothesis draws in any order
        if free not in self.examples and self.verdicts.count(None) >= MAX_INVALID:
            assume(False)  # eager keeps rejecting the sizes drawn: stop paying for eager runs
        verdict = self.verdict(free)
        assume(verdict is not None)
        assert verdict is not None  # assume() ended the example otherwise
        return not verdict.ok

    def verdict(self, free: Sizes) -> Discrepancy | None:
        """The example's comparison, run once (``None``: eager rejects it)."""
        free = {name: free[name] for name in free_variables(self.shapes)}
        if free not in self.examples:
            verdict, ran = self._verdict(free)  # an engine error leaves no half-recorded example
            self.examples.append(free)
            self.verdicts.append(verdict)
            self.ran.append(ran)
        return self.verdicts[self.examples.index(free)]

    def leaves(self, free: Sizes) -> Leaves:
        """The inputs of a valid example as it ran: a function of its sizes only (and of which
        candidate eager took)."""
        return self._candidates(free)[self.ran[self.examples.index(free)]]

    def _candidates(self, free: Sizes) -> list[Leaves]:
        """An example's inputs to try in turn: synthesized with labels ignoring padded positions,
        synthesized, a recorded call's rows repeated (when the example sizes batches only)."""
        sizes = complete_sizes(self.shapes, free)
        generator = torch.Generator().manual_seed(zlib.crc32(json.dumps(sizes, sort_keys=True).encode()))
        plain = build_leaves(self.shapes, sizes, generator, self.leaf_recipes)
        candidates = (ignore_padded_labels(self.shapes, plain, self.leaf_recipes), plain,
                      rows_repeated(self.shapes, self.shapes.aligned.complete_call(), free))
        return [leaves for leaves in candidates if leaves is not None]

    def _verdict(self, free: Sizes) -> tuple[Discrepancy | None, int]:
        """The comparison on the first candidate eager takes, and which one it was (``None, -1``:
        eager rejects them all)."""
        sizes = complete_sizes(self.shapes, free)
        if min(sizes.values()) < 0 or not satisfied(self.asserted, sizes):
            return None, -1  # a relation with a negative constant, or sizes outside the export's domain
        for index, leaves in enumerate(self._candidates(free)):
            try:
                expected = self.eager(detached_clone(leaves))
            except ModelRaised:  # eager rejects these inputs: not the export's fault
                continue
            return run_and_compare(self.run, leaves, expected, self.tolerance, outputs=self.outputs,
                                   float64=self.float64), index
        return None, -1

    def outcome(self, minimal: Sizes | None) -> VariationOutcome:
        invalid = sum(v is None for v in self.verdicts)
        outcome = VariationOutcome(
            tried=len(self.examples), valid=len(self.examples) - invalid, invalid=invalid,
            failed=sum(v is not None and not v.ok for v in self.verdicts), examples=self.examples,
            rounded=sum(v is not None and v.float64 is not None for v in self.verdicts),
        )
        if minimal is not None:
            index = self.examples.index(minimal)
            worst = self.verdicts[index]
            assert worst is not None
            outcome.failing_sizes = self.examples[index]
            outcome.failing_leaves = self.leaves(outcome.failing_sizes)
            outcome.max_abs = worst.max_abs if math.isfinite(worst.max_abs) else None
            outcome.detail = worst.detail or worst.kind or ""
        return outcome


def _near(anchor: int, low: int, high: int) -> hypothesis.strategies.SearchStrategy[int]:
    """Sizes in ``[low, high]`` drawn as offsets from ``anchor`` (the size the graph was traced
    at): hypothesis shrinks an offset towards 0, so a failure shrinks to the sizes nearest the
    traced ones, a size that plays no part in it back to its traced value."""
    from hypothesis import strategies

    anchor = min(max(anchor, low), high)
    return strategies.integers(low - anchor, high - anchor).map(lambda offset: anchor + offset)


def _settings(examples: int, seed: int | None, database_dir: Path) -> hypothesis.settings:
    """hypothesis settings: no deadline, no targeting or explaining (bounded time); a directory
    database unless derandomized (a seed, or ``CI=true``)."""
    from hypothesis import Phase, Verbosity, settings
    from hypothesis.database import DirectoryBasedExampleDatabase

    in_ci = os.environ.get("CI", "").strip().lower() in ("true", "1")
    deterministic = seed is not None or in_ci
    return settings(
        max_examples=examples, deadline=None, derandomize=in_ci and seed is None,
        database=None if deterministic else DirectoryBasedExampleDatabase(str(database_dir)),
        phases=(Phase.reuse, Phase.generate, Phase.shrink), verbosity=Verbosity.quiet, print_blob=False,
    )


def _database_key(shapes: ShapeModel) -> bytes:
    """A key stable for one model's inputs: leaf names, dtypes, static sizes, variable names
    and relations (not the observed bounds, so that a saved failure survives new observations)."""
    template = shapes.call_leaves(shapes.aligned.complete_call())
    leaves = [
        [name, str(value.dtype), [axes.get(d, s) for d, s in enumerate(value.shape)]]
        if isinstance(value, torch.Tensor) else [name, type(value).__name__]
        for name, value, axes in zip(shapes.aligned.leaf_names, template, shapes.leaf_axes())
    ]
    description = json.dumps({"leaves": leaves, "relations": [str(d) for d in shapes.derivations]})
    return DATABASE_PREFIX + hashlib.sha256(description.encode()).hexdigest().encode()
