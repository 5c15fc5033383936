"""P3 and P4: the finishing phase of one model, against hand-written code and against itself cached.

One process; a 2-layer tiny Llama (``LlamaForCausalLM``, hidden 64, 4 heads, 2 KV heads, vocab 100)
observed on 3 calls with ``input_ids``, ``attention_mask`` and a ``DynamicCache`` (batch, new tokens
and past length varying independently), inside ``register_flattening_functions()``.

P3: the plugin's engine, ``engine.check.check_model`` on the group built by ``SessionStore().observe`` with
``CheckSettings(export_dir=<fresh dir>, examples=0, use_cache=False)`` (infer shapes, torch.export,
decompositions, ONNX translation, onnx.checker, onnxruntime load, verify the 3 calls), against what
a user would write by hand for the same result: ``torch.onnx.export(model, (), kwargs=...,
dynamic_shapes=<Dim.DYNAMIC per dimension>, dynamo=True)``, ``save``, ``onnxruntime.InferenceSession``
and a run of the 3 recorded calls compared with their eager outputs.  Before measuring, both paths
export another model (a 1-layer tiny Llama) once, so that the one-time warm-up of torch.export /
torch.onnx (lazy imports, op tables, the engine's torchlib registry) is charged to neither side.
Then engine and hand-written runs alternate (E H H E ...), each after a ``gc.collect()``.  Ratio:
median engine CPU time over median hand-written CPU time (wall times and the ratio of minima beside
it).  The torch functions both sides go through are timed inside each run, so the output says
where the difference lies (e.g. how many ``torch.export.export`` traces each side made).

P4: the same engine with ``use_cache=True`` twice on one fresh export directory: the first run
exports and fills the cache, the second finds it.  Ratio: second / first.

    python benchmarks/p3_p4_export.py [--quick] [--reps N] [--mlp]
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from _common import Clock, Samples, emit, log, verdict  # noqa: E402

TARGET_P3 = 1.15
TARGET_P4 = 0.2
# (batch, new tokens, past length): vary independently, so the only relation the engine can find
# is total_seq = past_seq + seq
LLAMA_CALLS = ((2, 3, 5), (3, 4, 9), (4, 2, 6))
MLP_CALLS = (2, 5, 7)


class Case:
    """A model, its recorded calls (fresh inputs for each use), eager references, and the
    hand-written export's dynamic shapes."""

    def __init__(self, kind: str, layers: int = 2, hidden: int = 64):
        import torch

        torch.manual_seed(0)
        self.kind = kind
        if kind == "llama":
            import transformers

            config = transformers.LlamaConfig(
                hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=100,
            )
            self.model = transformers.LlamaForCausalLM(config).eval()
            self.layers, self.head_dim = layers, hidden // 4
            self.calls = LLAMA_CALLS
        else:
            self.model = torch.nn.Sequential(
                torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                torch.nn.Linear(64, 8),
            ).eval()
            self.calls = MLP_CALLS

    def inputs(self, index: int) -> dict[str, Any]:
        """The kwargs of call ``index`` (new tensors each time: the model extends the cache in place)."""
        import torch

        from pytest_exportobs import make_dynamic_cache

        generator = torch.Generator().manual_seed(index)
        if self.kind == "mlp":
            return {"input": torch.randn(self.calls[index], 16, generator=generator)}
        batch, seq, past = self.calls[index]
        pairs = [
            (torch.randn(batch, 2, past, self.head_dim, generator=generator),
             torch.randn(batch, 2, past, self.head_dim, generator=generator))
            for _ in range(self.layers)
        ]
        return {
            "input_ids": torch.randint(0, 100, (batch, seq), generator=generator),
            "attention_mask": torch.ones(batch, past + seq, dtype=torch.int64),
            "past_key_values": make_dynamic_cache(pairs),
        }

    def dynamic_shapes(self) -> dict[str, Any]:
        import torch

        dyn = torch.export.Dim.DYNAMIC
        if self.kind == "mlp":
            return {"input": {0: dyn}}
        return {
            "input_ids": {0: dyn, 1: dyn},
            "attention_mask": {0: dyn, 1: dyn},
            "past_key_values": [{0: dyn, 2: dyn}] * (2 * self.layers),
        }

    def observe(self) -> Any:
        """The engine's input: a group holding the recorded calls (and their eager outputs)."""
        import torch

        from pytest_exportobs import register_flattening_functions
        from pytest_exportobs.observe.store import ObserveOptions, SessionStore

        store = SessionStore()
        with register_flattening_functions(), torch.no_grad():
            with store.observe(self.model, self.kind, ObserveOptions(), "bench::observe") as group:
                for index in range(len(self.calls)):
                    self.model(**self.inputs(index))
        return group

    def references(self) -> list[list[Any]]:
        """The eager outputs of the calls, flattened (the hand-written side's reference; the engine
        recorded the same ones while observing)."""
        import torch
        from torch.utils import _pytree

        from pytest_exportobs import register_flattening_functions

        with register_flattening_functions(), torch.no_grad():
            return [
                [t for t in _pytree.tree_leaves(self.model(**self.inputs(i))) if isinstance(t, torch.Tensor)]
                for i in range(len(self.calls))
            ]


def engine(case: Case, group: Any, export_dir: Path, use_cache: bool) -> Any:
    from pytest_exportobs.engine.base.settings import CheckSettings
    from pytest_exportobs.engine.check import check_model

    result = check_model(group, CheckSettings(export_dir=export_dir, examples=0, use_cache=use_cache))
    if result.verdict != "passed":
        raise RuntimeError(f"engine did not pass on {case.kind}: {result.stage} {result.reason}\n{result.traceback}")
    return result


def hand_written(case: Case, references: list[list[Any]], export_dir: Path) -> dict[str, float]:
    """What a user writes for the same answer: export with dynamic shapes, load in onnxruntime,
    run the recorded calls, compare with the eager outputs.  Returns its own stage timings."""
    import numpy as np
    import onnxruntime
    import torch
    from torch.utils import _pytree

    from pytest_exportobs import register_flattening_functions

    path = export_dir / "model.onnx"
    export_dir.mkdir(parents=True, exist_ok=True)
    stages: dict[str, float] = {}
    with register_flattening_functions():
        with Clock() as clock, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                case.model, (), kwargs=case.inputs(0), dynamic_shapes=case.dynamic_shapes(), dynamo=True,
                verbose=False,
            )
            program.save(str(path))
        stages["export+save"] = clock.timing.wall
        with Clock() as clock:
            session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        stages["ort-load"] = clock.timing.wall
        names = [i.name for i in session.get_inputs()]
        with Clock() as clock:
            for index, expected in enumerate(references):
                leaves = [t for t in _pytree.tree_leaves(case.inputs(index)) if isinstance(t, torch.Tensor)]
                got = session.run(None, {n: t.numpy() for n, t in zip(names, leaves)})
                if len(got) != len(expected):
                    raise RuntimeError(f"hand-written: {len(got)} outputs, expected {len(expected)}")
                worst = max(float(np.abs(g - e.numpy()).max()) for g, e in zip(got, expected))
                if worst > 1e-3:
                    raise RuntimeError(f"hand-written: call {index} differs by {worst}")
        stages["run+compare"] = clock.timing.wall
    return stages


class StageTimer:
    """Wall time and call count of the torch / torch.onnx functions both sides go through
    (``torch.export.export``, the decompositions, the ONNX translation, the ONNX optimizer, the
    torchlib registry).  Both sides look them up at call time, so wrapping the attributes sees
    every call; the wrappers cost microseconds."""

    TARGETS = (
        ("torch.export", "torch.export", "export"),
        ("decompose", "torch.onnx._internal.exporter._core", "_prepare_exported_program_for_export"),
        ("translate", "torch.onnx._internal.exporter._core", "_exported_program_to_onnx_program"),
        ("optimize", "torch.onnx._internal.exporter._onnx_program", "ONNXProgram.optimize"),
        ("registry", "torch.onnx._internal.exporter._registration", "ONNXRegistry.from_torchlib"),
    )

    def __enter__(self) -> StageTimer:
        import importlib
        import time

        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._restore: list[tuple[Any, str, Any]] = []
        for label, module_name, path in self.TARGETS:
            owner: Any = importlib.import_module(module_name)
            *parents, attribute = path.split(".")
            for parent in parents:
                owner = getattr(owner, parent)
            raw = owner.__dict__[attribute] if isinstance(owner, type) else getattr(owner, attribute)
            function = raw.__func__ if isinstance(raw, classmethod) else raw

            def timed(*args: Any, _f: Any = function, _label: str = label, **kwargs: Any) -> Any:
                begin = time.perf_counter()
                try:
                    return _f(*args, **kwargs)
                finally:
                    self.seconds[_label] = self.seconds.get(_label, 0.0) + time.perf_counter() - begin
                    self.calls[_label] = self.calls.get(_label, 0) + 1

            setattr(owner, attribute, classmethod(timed) if isinstance(raw, classmethod) else timed)
            self._restore.append((owner, attribute, raw))
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, attribute, raw in reversed(self._restore):
            setattr(owner, attribute, raw)

    @staticmethod
    def median(runs: list[StageTimer], label: str) -> float:
        import statistics

        return statistics.median(run.seconds.get(label, 0.0) for run in runs)

    @classmethod
    def summary(cls, runs: list[StageTimer]) -> str:
        """Median seconds per function over ``runs`` (and the calls per run when more than one)."""
        import statistics

        parts = []
        for label, _, _ in cls.TARGETS:
            seconds = [run.seconds.get(label, 0.0) for run in runs]
            calls = max(run.calls.get(label, 0) for run in runs)
            if calls:
                parts.append(f"{label} {statistics.median(seconds):.2f}s" + (f" ({calls} calls)" if calls > 1 else ""))
        return ", ".join(parts)


def fmt_stages(stages: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2f}s" for k, v in stages.items() if v >= 0.005) or "each < 0.005s"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one run per side")
    parser.add_argument("--reps", type=int, default=None, help="runs per side (interleaved)")
    parser.add_argument("--mlp", action="store_true", help="an MLP instead of the tiny Llama")
    parser.add_argument("--only", choices=("p3", "p4"), default=None)
    parser.add_argument("--json", action="store_true", help="also print a machine-readable result line")
    args = parser.parse_args(argv)
    reps = args.reps or (1 if args.quick else 4)

    import torch

    torch.set_num_threads(1)  # export is single-threaded Python; keeps CPU time free of idle spinning
    kind = "mlp" if args.mlp else "llama"
    label = "mlp" if args.mlp else "tiny llama, DynamicCache"
    tmp = Path(tempfile.mkdtemp(prefix="exportobs-p34-"))
    lines: list[str] = []
    result: dict[str, Any] = {"id": "P3+P4", "model": kind}
    try:
        log("P3: warm-up: both paths export another model (1-layer Llama / other MLP)")
        warm = Case(kind, layers=1, hidden=32) if kind == "llama" else Case("mlp")
        with Clock() as clock:
            engine(warm, warm.observe(), tmp / "warm-engine", use_cache=False)
            hand_written(warm, warm.references(), tmp / "warm-hand")
        log(f"P3: warm-up took {clock.timing.wall:.1f}s")

        case = Case(kind)
        group = case.observe()
        references = case.references()
        if args.only != "p4":
            engine_samples, hand_samples = Samples("engine"), Samples("hand-written")
            engine_stages: dict[str, float] = {}
            hand_stages: dict[str, float] = {}
            trace_counts: dict[str, int] = {}
            breakdown: dict[str, list[StageTimer]] = {}
            for rep in range(reps):
                order = ("engine", "hand") if rep % 2 == 0 else ("hand", "engine")
                for side in order:
                    gc.collect()  # neither side pays for the other's garbage
                    with StageTimer() as traces, Clock() as clock:
                        if side == "engine":
                            outcome = engine(case, group, tmp / f"engine-{rep}", use_cache=False)
                        else:
                            stages = hand_written(case, references, tmp / f"hand-{rep}")
                    log(f"P3: {side} {clock.timing.wall:.1f}s wall, {clock.timing.cpu:.1f}s cpu")
                    trace_counts[side] = traces.calls.get("torch.export", 0)
                    breakdown.setdefault(side, []).append(traces)
                    if side == "engine":
                        engine_samples.add(clock.timing)
                        engine_stages = dict(outcome.timings)
                        dims, relations, notes = outcome.dims, outcome.relations, outcome.notes
                    else:
                        hand_samples.add(clock.timing)
                        hand_stages = stages
            ratio = engine_samples.median() / hand_samples.median()
            wall_ratio = engine_samples.median("wall") / hand_samples.median("wall")
            min_ratio = engine_samples.minimum() / hand_samples.minimum()
            # the differences that do not depend on noise: the traces each side makes, and the torchlib
            # registry torch.onnx.export rebuilds on every call (the engine builds it once per process)
            extra_trace = StageTimer.median(breakdown["engine"], "torch.export") - StageTimer.median(
                breakdown["hand"], "torch.export")
            registry = StageTimer.median(breakdown["hand"], "registry") - StageTimer.median(
                breakdown["engine"], "registry")
            structural = (hand_samples.median("wall") + extra_trace - registry) / hand_samples.median("wall")
            lines += [
                f"P3 engine vs hand-written export+ORT ({label}) ratio={ratio:.3f}  "
                f"{verdict(ratio, TARGET_P3)}",
                f"    cpu {engine_samples.median():.2f}s vs {hand_samples.median():.2f}s; wall "
                f"{engine_samples.median('wall'):.2f}s vs {hand_samples.median('wall'):.2f}s "
                f"(wall ratio={wall_ratio:.3f}); medians of {reps} interleaved runs each, after a warm-up; "
                f"ratio of minima {min_ratio:.3f}",
                "    runs (cpu s): engine " + " ".join(f"{t.cpu:.2f}" for t in engine_samples.values)
                + ", hand-written " + " ".join(f"{t.cpu:.2f}" for t in hand_samples.values),
                f"    engine stages (last run, wall): {fmt_stages(engine_stages)}",
                f"    hand-written stages (last run, wall): {fmt_stages(hand_stages)}",
                f"    torch functions inside (medians, wall): engine: {StageTimer.summary(breakdown['engine'])}",
                f"                                      hand-written: {StageTimer.summary(breakdown['hand'])}",
                f"    structural estimate: engine torch.export {extra_trace:+.2f}s, torchlib registry "
                f"{-registry:+.2f}s, other stages equal -> ratio~{structural:.3f}",
                f"    engine notes: {'; '.join(notes) or 'none'}",
                f"    engine inferred dims {sorted({d for v in dims.values() for d in v.values()})}, "
                f"relations {relations}",
            ]
            result.update(p3_ratio=ratio, p3_wall_ratio=wall_ratio, p3_min_ratio=min_ratio,
                          p3_structural_ratio=structural,
                          engine=engine_samples.to_json(),
                          hand=hand_samples.to_json(), engine_stages=engine_stages, hand_stages=hand_stages,
                          trace_counts=trace_counts,
                          breakdown={k: StageTimer.summary(v) for k, v in breakdown.items()})

        if args.only != "p3":
            cache_dir = tmp / "cached"
            runs = []
            for attempt in ("first", "second"):
                gc.collect()
                with Clock() as clock:
                    outcome = engine(case, group, cache_dir, use_cache=True)
                runs.append((clock.timing, outcome))
                log(f"P4: {attempt} {clock.timing.wall:.2f}s wall, {clock.timing.cpu:.2f}s cpu, "
                    f"cache_hit={outcome.cache_hit}")
            (first, first_outcome), (second, second_outcome) = runs
            if first_outcome.cache_hit or not second_outcome.cache_hit:
                raise RuntimeError(f"P4: unexpected cache behaviour: first hit={first_outcome.cache_hit}, "
                                   f"second hit={second_outcome.cache_hit}")
            ratio4 = second.cpu / first.cpu
            lines += [
                f"P4 cached second run vs first ({label}, use_cache=True) ratio={ratio4:.3f}  "
                f"{verdict(ratio4, TARGET_P4)}",
                f"    cpu {second.cpu:.2f}s vs {first.cpu:.2f}s; wall {second.wall:.2f}s vs {first.wall:.2f}s "
                f"(wall ratio={second.wall / first.wall:.3f})",
                f"    second run stages (wall): {fmt_stages(second_outcome.timings)}",
            ]
            result.update(p4_ratio=ratio4, p4_wall_ratio=second.wall / first.wall,
                          p4_first={"wall": first.wall, "cpu": first.cpu},
                          p4_second={"wall": second.wall, "cpu": second.cpu},
                          p4_second_stages=dict(second_outcome.timings))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result["lines"] = lines
    emit(result, args.json)
    return result


if __name__ == "__main__":
    main()
