"""The plugin in real pytest sessions (subprocesses): outcomes, junitxml, xdist, zero cost when off."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from models import LOADED_WITHOUT_CHECK, MLP_CONFTEST, QUICK_CHECK, junit_cases
from models import SOURCE as MODELS

pytestmark = pytest.mark.slow  # pytest sessions in subprocesses


TEST_MARKED = '''
import pytest, torch

@pytest.mark.observe_export("mlp")
def test_batch_2(mlp):
    assert mlp(torch.randn(2, 8)).shape == (2, 4)

@pytest.mark.observe_export("mlp")
def test_batch_5(mlp):
    assert mlp(torch.randn(5, 8)).shape == (5, 4)

@pytest.mark.observe_export("mlp", name="mlp-failing-test")
def test_fails_after_observing(mlp):
    mlp(torch.randn(3, 8))
    mlp(torch.randn(6, 8))
    assert False, "a user test failure"

@pytest.mark.observe_export("mlp", name="never-called")
def test_never_calls(mlp):
    pass
'''

TEST_WATCH = '''
import torch
from models import Branchy

def test_watch(export_observer):
    model = export_observer.watch(Branchy())  # grouped by the class's qualified name
    model(torch.randn(3, 4))
    model(torch.randn(6, 4))
'''


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(models=MODELS, conftest=MLP_CONFTEST, test_marked=TEST_MARKED, test_watch=TEST_WATCH)
    return pytester


EXPECTED_CASES = {
    "test_marked::test_batch_2": "passed",
    "test_marked::test_batch_5": "passed",
    "test_marked::test_fails_after_observing": "failure",
    "test_marked::test_never_calls": "passed",
    "test_watch::test_watch": "passed",
    "exportobs::mlp": "passed",
    "exportobs::mlp-failing-test": "passed",
    "exportobs::never-called": "skipped",
    "exportobs::Branchy": "failure",
}


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_one_outcome_per_model(suite: pytest.Pytester, workers: list[str]) -> None:
    result = suite.runpytest_subprocess(
        "--export-check", "--export-examples=2", "--junitxml=junit.xml", "-rA", "-p", "no:cacheprovider", *workers
    )
    result.assert_outcomes(passed=6, failed=2, skipped=1)
    assert result.ret == 1
    assert junit_cases(suite.path / "junit.xml") == EXPECTED_CASES
    result.stdout.fnmatch_lines([
        "exportobs gate: 1 failure (Branchy: failed at torch.export)",
        "PASSED exportobs::mlp",
        "SKIPPED *never-called*no call of the model was observed*",
        "FAILED exportobs::Branchy - failed at torch.export: *(at models.py:*: if x.sum() > 0:)",
    ])
    result.stdout.re_match_lines([r"mlp\s+passed\s+variations\s+2\s+\S+\s+\S+s\s+x\{0:batch\}"])


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_a_rerun_on_the_export_cache_gives_the_first_runs_verdicts_without_exporting(
    suite: pytest.Pytester, workers: list[str],
) -> None:
    """The same suite twice on one export directory: the same outcomes and dims, every graph
    from the cache, the variations each graph passed not explored again, the failing export
    reported as it failed without tracing."""
    args = ("--export-check", "--export-examples=3", "--junitxml=junit.xml", "--export-report=report.json",
            "-p", "no:cacheprovider", *workers)
    reports = []
    for _ in range(2):
        suite.runpytest_subprocess(*args).assert_outcomes(passed=6, failed=2, skipped=1)
        assert junit_cases(suite.path / "junit.xml") == EXPECTED_CASES
        reports.append({m["name"]: m for m in json.loads((suite.path / "report.json").read_text())["models"]})
    first, rerun = reports
    for name in ("mlp", "mlp-failing-test"):
        assert (first[name]["dims"], rerun[name]["dims"]) == ({"x": {"0": "batch"}}, {"x": {"0": "batch"}})
        (graph,) = rerun[name]["graphs"]
        assert graph["cache_hit"] and not {"torch.export", "decompose", "variations"} & graph["timings"].keys()
        assert graph["variations"] == first[name]["graphs"][0]["variations"]
        assert any(note.startswith("variations: as explored on an earlier check") for note in graph["notes"])
        assert any(note.startswith("verified as on an earlier check") for note in graph["notes"])
        assert graph["discrepancies"] == first[name]["graphs"][0]["discrepancies"]
    assert rerun["Branchy"]["reason"] == first["Branchy"]["reason"]
    (failed,) = rerun["Branchy"]["graphs"]
    assert (failed["verdict"], failed["stage"], failed["cache_hit"]) == ("failed", "torch.export", True)
    assert "torch.export" not in failed["timings"] and failed["notes"][-1].startswith(
        "export cache hit: this trace failed at torch.export on an earlier check")


CONFIGURED_AS_DIFFUSERS = '''
import collections, pytest, torch
from torch import nn


class FrozenDict(collections.OrderedDict):
    """diffusers' configuration: a mapping, with the entries left at their defaults listed in a
    set's order (another order in a process with another hash seed)."""


class CountingProcessor(nn.Module):
    """Counts its calls in a public attribute, as the processors of diffusers' tests do."""

    def __init__(self):
        super().__init__()
        self.counter = 0

    def forward(self, hidden):
        self.counter += 1
        return hidden * 2


class Denoiser(nn.Module):
    def __init__(self, channels=4, act_fn="silu", norm_groups=2):
        super().__init__()
        given = {"channels": channels}
        defaults = {"act_fn": act_fn, "norm_groups": norm_groups, "dropout": 0.0, "layers": 1}
        self.config = FrozenDict(**given, **defaults, _use_default_values=list(set(defaults)))
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.processor = CountingProcessor()
        self.norm = nn.GroupNorm(norm_groups, channels)

    def forward(self, sample):
        return self.norm(self.processor(self.conv(sample)))


@pytest.fixture
def denoiser():
    return Denoiser().eval()


@pytest.mark.observe_export("denoiser")
@pytest.mark.parametrize("side", [8, 12])
def test_keeps_the_latent_shape(denoiser, side):
    assert denoiser(torch.randn(2, 4, side, side)).shape == (2, 4, side, side)
'''


def test_a_rerun_in_a_process_with_another_hash_seed_takes_a_diffusers_style_model_from_the_cache(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The export cache's keys read a model's configuration, written the same in every process
    whatever order a set gave its lists, and its attributes as the tests left them, not as the
    check's own calls (fewer on a rerun, which probes nothing) left a processor's call counter:
    a rerun exports nothing again."""
    pytester.makepyfile(test_denoiser=CONFIGURED_AS_DIFFUSERS)
    reports = []
    for seed in ("1", "2"):
        monkeypatch.setenv("PYTHONHASHSEED", seed)
        result = pytester.runpytest_subprocess("--export-check", "--export-examples=0", "--export-report=report.json",
                                               "-p", "no:cacheprovider")
        result.assert_outcomes(passed=3)
        (model,) = json.loads((pytester.path / "report.json").read_text())["models"]
        reports.append(model)
    first, rerun = reports
    assert first["dims"] == rerun["dims"] == {"sample": {"0": "batch", "2": "height", "3": "width"}}
    (graph,) = rerun["graphs"]
    assert graph["cache_hit"] and "torch.export" not in graph["timings"]


def test_exit_code_zero_when_every_model_passes(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(models=MODELS, conftest=MLP_CONFTEST)
    pytester.makepyfile(test_ok=TEST_MARKED.split("@pytest.mark.observe_export(\"mlp\", name=\"mlp-failing-test\")")[0])
    result = pytester.runpytest_subprocess("--export-check", "--export-examples=0", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3)
    assert result.ret == 0


def test_progress_lines_and_summary_table(suite: pytest.Pytester) -> None:
    result = suite.runpytest_subprocess("--export-check", "--export-examples=0", "-k", "batch",
                                        "-p", "no:cacheprovider")
    result.stdout.fnmatch_lines([
        "exportobs [[]1/1[]] mlp: infer (*s)",
        "exportobs [[]1/1[]] mlp: export (*s)",
        "exportobs [[]1/1[]] mlp: passed in *s",
        "model*verdict*stage*obs*max|Δ|*time*dynamic dims",
    ])


ZERO_COST_CONFTEST = MLP_CONFTEST + '''
import json, sys

def pytest_sessionfinish(session):
    loaded = sorted(m for m in sys.modules if m.startswith("pytest_exportobs"))
    with open("loaded.json", "w") as f:
        json.dump(loaded, f)
'''

TEST_FORWARD_UNTOUCHED = '''
import pytest, torch

@pytest.mark.observe_export("mlp")
def test_forward_is_original(mlp):
    assert "forward" not in vars(mlp)
    mlp(torch.randn(2, 8))

def test_watch_is_identity(export_observer, mlp):
    assert export_observer.watch(mlp) is mlp
    assert "forward" not in vars(mlp)
'''


def test_nothing_happens_without_the_flag(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(models=MODELS, conftest=ZERO_COST_CONFTEST, test_untouched=TEST_FORWARD_UNTOUCHED)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    assert json.loads((pytester.path / "loaded.json").read_text()) == LOADED_WITHOUT_CHECK
    assert not (pytester.path / ".exportobs").exists()


def test_loading_the_plugin_imports_no_heavy_module() -> None:
    code = (
        "import sys, pytest_exportobs.plugin;"
        "heavy = {'torch', 'onnx', 'onnxruntime', 'onnxscript', 'transformers', 'hypothesis'};"
        "print(sorted(heavy & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_collect_only_exports_nothing(suite: pytest.Pytester) -> None:
    result = suite.runpytest_subprocess("--export-check", "--collect-only", "-p", "no:cacheprovider")
    assert result.ret == 0
    assert "exportobs" not in result.stdout.str().replace("exportobs-", "")
    assert not (suite.path / ".exportobs").exists()


def test_marker_errors_fail_the_test_clearly(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(models=MODELS, conftest=MLP_CONFTEST, test_errors='''
import pytest

@pytest.fixture
def not_a_module():
    return 42

@pytest.mark.observe_export("mlp")
def test_fixture_not_used():
    pass

@pytest.mark.observe_export("not_a_module")
def test_not_a_module(not_a_module):
    pass

@pytest.mark.observe_export("mlp", colour="red")
def test_unknown_option(mlp):
    pass
''')
    result = pytester.runpytest_subprocess("--export-check", "--strict-markers", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=3)
    result.stdout.fnmatch_lines([
        "*the test does not use a fixture named 'mlp'*",
        "*'not_a_module' is a int, not a torch.nn.Module*",
        "*unknown argument(s)*colour*",
    ])


def test_marker_is_registered(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--markers", "-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(["@pytest.mark.observe_export(*fixture_names, name=None*"])


CRASHING_CONFTEST = MLP_CONFTEST + '''
import contextlib, os, signal

@contextlib.contextmanager
def crash():
    os.kill(os.getpid(), signal.SIGSEGV)  # a native crash in the middle of an export
    yield
'''

TEST_CRASHING = '''
import pytest, torch

@pytest.mark.observe_export("mlp")
def test_fine(mlp):
    mlp(torch.randn(2, 8))
    mlp(torch.randn(3, 8))

@pytest.mark.observe_export("mlp", name="crashing", patches="conftest.crash")
def test_crashing(mlp):
    mlp(torch.randn(2, 8))
'''


def test_isolate_turns_a_native_crash_into_one_failed_model(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(models=MODELS, conftest=CRASHING_CONFTEST, test_crash=TEST_CRASHING)
    result = pytester.runpytest_subprocess("--export-check", "--export-isolate", "--export-examples=0",
                                           "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(
        ["FAILED exportobs::crashing - failed at isolate: the isolated check process died (signal SIGSEGV)"])


def test_a_worker_dying_while_checking_makes_its_models_incomplete(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(models=MODELS, conftest=CRASHING_CONFTEST, test_crash=TEST_CRASHING)
    result = pytester.runpytest_subprocess("--export-check", "--export-examples=0", "-n", "2", "-p", "no:cacheprovider",
                                           "-rA")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    # the two models were dealt to the two workers: only the crashing one's worker died, after
    # pooling its observations: the model it was checking is incomplete, the other keeps its verdict
    result.stdout.fnmatch_lines([
        "*exportobs gate: 1 failure (crashing: incomplete at observe)*",
        "PASSED exportobs::mlp",
        "FAILED exportobs::crashing - incomplete at observe: worker gw? crashed while checking it (a native "
        "crash: --export-isolate makes it the model's failure)",
    ])


DECODER_SUITE = '''
import pytest, torch

class CachedDecoder(torch.nn.Module):
    """A decoder step whose ``past`` (batch, past_seq, 4) is absent at prefill."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x, past=None):
        if past is None:
            past = x.new_zeros((x.shape[0], 0, x.shape[2]))
        return self.proj(torch.cat([past, x], dim=1)).sum(dim=1)

@pytest.fixture
def decoder():
    torch.manual_seed(0)
    return CachedDecoder()

@pytest.mark.observe_export("decoder")
def test_prefill(decoder):
    assert decoder(torch.randn(2, 5, 4)).shape == (2, 4)

@pytest.mark.observe_export("decoder")
def test_decode(decoder):
    assert decoder(torch.randn(1, 1, 4), past=torch.randn(1, 5, 4)).shape == (1, 4)
    assert decoder(torch.randn(3, 1, 4), past=torch.randn(3, 6, 4)).shape == (3, 4)
'''


def junit_properties(path, name: str) -> list[tuple[str, str]]:
    import xml.etree.ElementTree as ET

    case = next(c for c in ET.parse(path).getroot().iter("testcase") if c.get("name") == name)
    return [(p.get("name"), p.get("value")) for p in case.iter("property")]


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_each_graph_of_a_model_is_shown_recorded_and_gated(pytester: pytest.Pytester, workers: list[str]) -> None:
    pytester.makepyfile(test_decoder=DECODER_SUITE)
    recorded = pytester.runpytest_subprocess(
        *QUICK_CHECK, *workers, "--junitxml=junit.xml", "--export-baseline=baseline.json", "--export-baseline-update")
    recorded.assert_outcomes(passed=3)
    with_past, without_past = "x{0:batch,1:seq} past{0:batch,1:past_dim1}", "x{0:batch,1:seq}"
    recorded.stdout.fnmatch_lines([
        f"decoder           passed  *  3    *  {with_past}",
        f"  [[]with past[]]     passed  *  2    *  {with_past}",
        f"  [[]without past[]]  passed  *  1    *  {without_past}",
    ])
    assert junit_properties(pytester.path / "junit.xml", "decoder") == [
        ("exportobs_target", "torch"), ("exportobs_stage", "verify"),
        ("exportobs_graph", f"[with past] passed, calls 1 2, {with_past}"),
        ("exportobs_graph", f"[without past] passed, calls 0, {without_past}"),
    ]
    baseline = json.loads((pytester.path / "baseline.json").read_text())
    assert baseline["models"]["decoder"]["graph_dims"] == {
        "with past": {"x": {"0": "batch", "1": "seq"}, "past": {"0": "batch", "1": "past_dim1"}},
        "without past": {"x": {"0": "batch", "1": "seq"}},
    }
    # as if a dim of one graph had been dynamic when the baseline was recorded
    baseline["models"]["decoder"]["graph_dims"]["without past"]["x"]["2"] = "features"
    (pytester.path / "baseline.json").write_text(json.dumps(baseline))
    gated = pytester.runpytest_subprocess(*QUICK_CHECK, *workers, "--export-baseline=baseline.json")
    gated.stdout.fnmatch_lines(
        ["exportobs gate: 1 regression (decoder: [[]without past[]] dim x.2 (features) became static)"])
    assert gated.ret == pytest.ExitCode.TESTS_FAILED


TEST_RESIDUAL = '''
import pytest, torch


class Residual(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(24))

    def forward(self, x):
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return x.sum(-1)


@pytest.fixture(scope="module")
def residual():
    torch.manual_seed(0)
    return Residual().eval()


@pytest.mark.observe_export("residual", atol=1e-6, rtol=1e-6)
@pytest.mark.parametrize("batch", [3, 4])
def test_scores(residual, batch):
    torch.manual_seed(batch)
    assert residual(torch.randn(batch, 64)).shape == (batch,)
'''

# a translation of tanh 5e-7 off (within 1e-6 at every node): its errors add up over 24 layers
BIASED_TANH = '''
import torch
from onnxscript import opset18 as op

from pytest_exportobs.engine.export import pipeline


def biased_tanh(x):
    return op.Add(op.Tanh(x), op.CastLike(op.Constant(value_float=5e-7), x))


pipeline.custom_translations = lambda: {torch.ops.aten.tanh.default: biased_tanh}
'''


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_a_mismatch_that_only_accumulates_says_so(pytester: pytest.Pytester, workers: list[str]) -> None:
    """An error within 1e-6 at every node, adding up to more at the output, the graph further from
    float64 than eager: the failure names no node, and the report keeps the nodes of the largest
    errors."""
    pytester.makepyfile(test_residual=TEST_RESIDUAL)
    pytester.makeconftest(BIASED_TANH)
    result = pytester.runpytest_subprocess("--export-check", "--export-examples=0", "-p", "no:cacheprovider",
                                           *workers, "--junitxml=junit.xml", "--export-report=r.json")
    result.assert_outcomes(passed=2, failed=1)
    assert junit_cases(pytester.path / "junit.xml")["exportobs::residual"] == "failure"
    result.stdout.fnmatch_lines([
        "failed at verify: call * from test_residual.py::test_scores*: *the mismatch accumulates: each of the * "
        "values compared is within tolerance on torch's own inputs (a reduction in float32; the largest error "
        "introduced: *"])
    (model,) = json.loads((pytester.path / "r.json").read_text())["models"]
    assert model["localization"]["first"] is None and model["localization"]["compared"] >= 48
    assert {node["torch_op"] for node in model["localization"]["largest"]} <= {
        "aten.linear.default", "aten.tanh.default", "aten.add.Tensor", "aten.sum.dim_IntList"}
    assert "| within |" in (pytester.path / "r.md").read_text()


TEST_TRAINING = '''
import weakref

import pytest
import torch

TRAINED = {}


def step(model):
    model(torch.randn(3, 4)).sum().backward()


@pytest.fixture(scope="module")
def shared():
    return torch.nn.Linear(4, 2)


def test_trains_its_own_model(export_observer):
    model = export_observer.watch(torch.nn.Linear(4, 2), name="own")
    step(model)
    TRAINED["own"] = weakref.ref(model)


def test_trains_the_shared_model(export_observer, shared):
    step(export_observer.watch(shared, name="shared"))


def test_the_kept_model_is_packed_away_and_the_shared_one_keeps_its_gradients(shared):
    assert TRAINED["own"]() is None, "packed: the model and its gradients are freed"
    assert shared.weight.grad is not None  # a fixture still holds it: untouched
'''


@pytest.mark.parametrize("workers", [[], ["-n", "2", "--dist", "loadfile"]], ids=["serial", "xdist"])
def test_a_kept_model_is_packed_away_once_no_test_can_reach_it(
    pytester: pytest.Pytester, workers: list[str]
) -> None:
    """A training test's model and gradients would stay in memory with the model the store keeps
    until the session ends (the suite alone frees both after the test): packed, they are freed,
    and the model still passes; a model a fixture still holds keeps its gradients."""
    pytester.makepyfile(test_training=TEST_TRAINING)
    result = pytester.runpytest_subprocess(*QUICK_CHECK, "--junitxml=junit.xml", *workers)
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    assert junit_cases(pytester.path / "junit.xml") == {
        "test_training::test_trains_its_own_model": "passed",
        "test_training::test_trains_the_shared_model": "passed",
        "test_training::test_the_kept_model_is_packed_away_and_the_shared_one_keeps_its_gradients": "passed",
        "exportobs::own": "passed", "exportobs::shared": "passed",
    }


CHECKED_ON_REQUEST = '''
import pytest, torch
from models import CheckedOnRequest


@pytest.fixture
def model():
    torch.manual_seed(0)
    return CheckedOnRequest().eval()


@pytest.mark.observe_export("model")
def test_checked(model):
    assert model(torch.ones(2, 4), checked=True).shape == (2, 4)
    assert model(torch.ones(3, 4), checked=True).shape == (3, 4)


@pytest.mark.observe_export("model")
def test_plain(model):
    assert model(torch.randn(5, 4)).shape == (5, 4)
'''


@pytest.mark.parametrize("asked", [[], ["-n", "2"], ["--export-every-graph"], ["ini"]],
                         ids=["default", "xdist", "option", "ini"])
def test_a_models_check_ends_at_its_first_failing_graph_with_the_same_verdict(
    pytester: pytest.Pytester, asked: list[str]
) -> None:
    pytester.makepyfile(models=MODELS, test_checked=CHECKED_ON_REQUEST)
    every_graph = asked in (["--export-every-graph"], ["ini"])
    if asked == ["ini"]:
        pytester.makeini("[pytest]\nexport_every_graph = true\n")
    result = pytester.runpytest_subprocess("--export-check", "--export-examples=0", "--junitxml=junit.xml",
                                           "--export-report=report.json", "-p", "no:cacheprovider",
                                           *(a for a in asked if a != "ini"))
    result.assert_outcomes(passed=2, failed=1)
    assert junit_cases(pytester.path / "junit.xml")["exportobs::model"] == "failure"
    (model,) = json.loads((pytester.path / "report.json").read_text())["models"]
    assert (model["verdict"], model["stage"], model["kind"]) == ("failed", "torch.export", "error")
    assert model["reason"].startswith("[checked=True] GuardOnDataDependentSymNode")
    graphs = [(g["name"], g["calls"], g["verdict"]) for g in model["graphs"]]
    unchecked = ("calls [2] not checked: the check ended at the first failing graph, whose failure is the model's "
                 "verdict (--export-every-graph checks them)")
    if every_graph:
        assert graphs == [("checked=True", [0, 1], "failed"), ("checked default", [2], "passed")]
        assert unchecked not in model["model_notes"]
    else:
        assert graphs == [("checked=True", [0, 1], "failed")]
        assert unchecked in model["model_notes"]


TIMED_EXPORTS = '''
"""Times each torch.export.export call, as a profiler would: a wrapper that says nothing of the
function's options, installed before the plugin is imported (``-p timed_exports``)."""
import json, time, torch

_export = torch.export.export


def timed(*args, **kwargs):
    begin = time.perf_counter()
    try:
        program = _export(*args, **kwargs)
    except Exception as error:
        outcome = type(error).__name__
        raise
    else:
        outcome = "taken"
        return program
    finally:
        with open("exports.jsonl", "a") as log:
            record = {"outcome": outcome, "options": sorted(kwargs), "seconds": time.perf_counter() - begin}
            log.write(json.dumps(record) + "\\n")


torch.export.export = timed
'''

TEST_PADDED = '''
import pytest, torch
from models import PaddedPatches

@pytest.fixture
def patches():
    return PaddedPatches().eval()

@pytest.mark.observe_export("patches")
def test_patches(patches):
    with torch.no_grad():
        assert patches(torch.randn(2, 3, 16, 12)).shape == (2, 4, 48)
        assert patches(torch.randn(3, 3, 24, 20)).shape == (3, 4, 120)
'''


def test_a_wrapped_torch_export_traces_as_torch_onnx_export_does(pytester: pytest.Pytester) -> None:
    """A profiler wrapping ``torch.export.export`` in a ``(*args, **kwargs)`` function before the
    plugin is imported: the guards that may wait are still runtime asserts (the padded sides are
    asserted even, not rejected), every trace is taken at once, the verdict as without it."""
    pytester.makepyfile(models=MODELS, timed_exports=TIMED_EXPORTS, test_padded=TEST_PADDED)
    reports = {}
    for name, profiled in (("plain", []), ("profiled", ["-p", "timed_exports"])):
        result = pytester.runpytest_subprocess(*profiled, "--export-check", "--export-examples=0", "-p",
                                               "no:cacheprovider", f"--export-report={name}.json",
                                               f"--export-dir={name}")
        result.assert_outcomes(passed=2)
        reports[name] = json.loads((pytester.path / f"{name}.json").read_text())["models"]
    exports = [json.loads(line) for line in (pytester.path / "exports.jsonl").read_text().splitlines()]
    assert [export["outcome"] for export in exports] == ["taken"] * len(exports) and exports
    assert all("prefer_deferred_runtime_asserts_over_guards" in export["options"] for export in exports)
    [plain], [profiled] = reports["plain"], reports["profiled"]
    assert (profiled["verdict"], profiled["dims"], profiled["relations"]) == (
        plain["verdict"], plain["dims"], plain["relations"]) == (
        "passed", {"images": {"0": "batch", "2": "height", "3": "width"}},
        ["width = 2*width_half", "height = 2*height_half"])
