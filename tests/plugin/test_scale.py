"""Scale: models placed on xdist workers one model per worker at a time, checks run in forked
children at once (``--export-jobs``), and a sharded run gated against one baseline."""

from __future__ import annotations

import json
import re

import pytest

from pytest_exportobs.plugin.xdist import placement

from models import QUICK_CHECK as ARGS
from models import SOURCE as MODELS
from models import junit_cases

pytestmark = pytest.mark.slow  # pytest sessions in subprocesses

CONFTEST = '''
import os
import pytest, torch
from models import MLP, Scorer

@pytest.fixture
def mlp():
    torch.manual_seed(0)
    return MLP().eval()

@pytest.fixture
def encoder():
    torch.manual_seed(0)
    return Scorer().eval()

@pytest.fixture(autouse=True)
def record_worker(request):
    """Write which worker ran each test; skip the test named by $SKIP."""
    if request.node.name == os.environ.get("SKIP"):
        pytest.skip("asked to")
    yield
    with open("workers.txt", "a") as f:
        f.write(f"{request.node.name} {os.environ.get('PYTEST_XDIST_WORKER', 'main')}\\n")
'''

TESTS = '''
import pytest, torch

@pytest.mark.observe_export("mlp", name="classifier")
def test_classifier_batch_2(mlp):
    mlp(torch.randn(2, 8))

@pytest.mark.observe_export("mlp", name="classifier")
def test_classifier_batch_5(mlp):
    mlp(torch.randn(5, 8))

@pytest.mark.observe_export("mlp", name="scorer")
def test_scorer(mlp):
    mlp(torch.randn(3, 8))

@pytest.mark.observe_export("mlp", name="scorer")
@pytest.mark.observe_export("encoder")
def test_scorer_and_encoder(mlp, encoder):
    mlp(torch.randn(4, 8))
    encoder(torch.randn(2, 7, 16))

@pytest.mark.observe_export("encoder")
def test_encoder_long(encoder):
    encoder(torch.randn(3, 11, 16))

def test_watched(mlp, export_observer):
    export_observer.watch(mlp, name="watched")(torch.randn(6, 8))

def test_watched_again(mlp, export_observer):
    export_observer.watch(mlp, name="watched")(torch.randn(7, 8))

@pytest.mark.parametrize("n", range(4))
def test_plain(n):
    assert n >= 0
'''

USER_TESTS = {
    **{f"test_models::{name}": "passed" for name in (
        "test_classifier_batch_2", "test_classifier_batch_5", "test_scorer", "test_scorer_and_encoder",
        "test_encoder_long", "test_watched", "test_watched_again")},
    **{f"test_models::test_plain[{n}]": "passed" for n in range(4)},
}
MODEL_TESTS = {
    "classifier": {"test_classifier_batch_2", "test_classifier_batch_5"},
    "scorer": {"test_scorer", "test_scorer_and_encoder"},
    "encoder": {"test_scorer_and_encoder", "test_encoder_long"},
    "watched": {"test_watched", "test_watched_again"},
}


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(models=MODELS, conftest=CONFTEST, test_models=TESTS)
    return pytester


def run(suite: pytest.Pytester, *args: str) -> tuple[dict[str, str], dict[str, dict]]:
    """Run the suite (fresh artifacts); junit outcomes and the report's model entries."""
    for leftover in ("workers.txt", "report.json"):
        (suite.path / leftover).unlink(missing_ok=True)
    result = suite.runpytest_subprocess(*ARGS, "--junitxml=junit.xml", "--export-report=report.json", *args)
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    models = {m["name"]: m for m in json.loads((suite.path / "report.json").read_text())["models"]}
    return junit_cases(suite.path / "junit.xml"), models


def verdicts_and_dims(models: dict[str, dict]) -> dict[str, tuple[str, dict]]:
    return {name: (m["verdict"], m["graphs"][0]["dims"] if m.get("graphs") else m["dims"])
            for name, m in models.items()}


def workers(suite: pytest.Pytester) -> dict[str, str]:
    return dict(line.split() for line in (suite.path / "workers.txt").read_text().splitlines())


def test_placement_groups_the_tests_of_a_marked_model(suite: pytest.Pytester) -> None:
    items = suite.getitems(suite.path / "test_models.py")
    groups = {item.name: group for item, group in ((i, placement(items).get(i.nodeid)) for i in items)}
    assert groups == {
        "test_classifier_batch_2": "exportobs:classifier", "test_classifier_batch_5": "exportobs:classifier",
        # the encoder shares a test with the scorer: one group, named after the first of them
        "test_scorer": "exportobs:encoder", "test_scorer_and_encoder": "exportobs:encoder",
        "test_encoder_long": "exportobs:encoder",
        # watch() names its model at run time: spread as --dist load spreads it, observations pooled
        "test_watched": None, "test_watched_again": None, **{f"test_plain[{n}]": None for n in range(4)},
    }


def test_xdist_places_each_model_on_one_worker_and_spreads_the_models(suite: pytest.Pytester) -> None:
    serial_cases, serial = run(suite)
    cases, models = run(suite, "-n", "2")
    expected = {**USER_TESTS, **{f"exportobs::{name}": "passed" for name in MODEL_TESTS}}
    assert serial_cases == cases == expected
    assert verdicts_and_dims(models) == verdicts_and_dims(serial)
    assert verdicts_and_dims(models)["classifier"] == ("passed", {"x": {"0": "batch"}})
    assert {name: m["n_observations"] for name, m in models.items()} == {
        name: m["n_observations"] for name, m in serial.items()}
    ran_on = workers(suite)
    for name, tests in MODEL_TESTS.items():
        if name != "watched":
            assert len({ran_on[t] for t in tests}) == 1, (name, ran_on)
    assert {ran_on[t] for tests in MODEL_TESTS.values() for t in tests} == {"gw0", "gw1"}


def test_export_jobs_checks_models_at_once_with_the_same_results(suite: pytest.Pytester) -> None:
    _, one = run(suite, "--export-jobs=1")
    result = suite.runpytest_subprocess(*ARGS, "--export-report=report.json", "--export-jobs=2")
    assert result.ret == pytest.ExitCode.OK
    two = {m["name"]: m for m in json.loads((suite.path / "report.json").read_text())["models"]}
    assert verdicts_and_dims(two) == verdicts_and_dims(one)
    ended = [line for line in result.stdout.lines if re.fullmatch(r"exportobs \[\d/4\] \S+: passed in [\d.]+s", line)]
    assert sorted(line.split()[2] for line in ended) == ["classifier:", "encoder:", "scorer:", "watched:"]
    exports = [line for line in result.stdout.lines
               if re.fullmatch(r"exportobs \[\d/4\] \S+: export \([\d.]+s\)", line)]
    assert len(exports) == 4


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_export_jobs_must_be_positive_or_auto(suite: pytest.Pytester, value: str) -> None:
    result = suite.runpytest_subprocess(*ARGS, f"--export-jobs={value}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: export_jobs must be a positive integer or auto, got '{value}'"])


def test_shards_reports_merge_into_the_report_and_baseline_of_one_run(
    suite: pytest.Pytester, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two CI shards split the tests (the scorer and the encoder share a test: both shards observe
    them); their reports merge into what one run reports, gated against the full run's baseline."""
    from pytest_exportobs.gate.merge import main as merge

    _, whole = run(suite, "--export-baseline=whole.json", "--export-baseline-update")
    shards = {0: "classifier or scorer_and_encoder", 1: "not classifier"}
    for shard, selection in shards.items():
        result = suite.runpytest_subprocess(*ARGS, "-k", selection, f"--export-report=shard-{shard}.json")
        assert result.ret == pytest.ExitCode.OK
    path = suite.path
    capsys.readouterr()  # the sessions' output
    assert merge([str(path / "shard-0.json"), str(path / "shard-1.json"), "--report", str(path / "merged.json"),
                  "--baseline", str(path / "whole.json")]) == 0
    assert capsys.readouterr().out == (
        "exportobs merge: 2 reports, 4 models; exportobs gate: ok (4 passed, 0 regressions)\n")
    merged = {m["name"]: m for m in json.loads((path / "merged.json").read_text())["models"]}
    assert verdicts_and_dims(merged) == verdicts_and_dims(whole)
    assert {name: sorted(m["sources"]) for name, m in merged.items()} == {
        name: sorted(m["sources"]) for name, m in whole.items()}
    one_shard = [str(path / "shard-1.json"), "--report", str(path / "one.json"), "--baseline", str(path / "whole.json")]
    assert merge(one_shard) == 0  # a shard alone misses the classifier
    assert capsys.readouterr().out == (
        "exportobs merge: 1 report, 3 models; exportobs gate: ok (3 passed, 1 missing, 0 regressions)\n")
    assert merge([*one_shard, "--strict"]) == 1


@pytest.mark.parametrize("xdist", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_a_shard_gates_its_models_against_the_whole_baseline(suite: pytest.Pytester, xdist: list[str]) -> None:
    suite.runpytest_subprocess(*ARGS, "--export-baseline=baseline.json", "--export-baseline-update").assert_outcomes(
        passed=15)
    entries = json.loads((suite.path / "baseline.json").read_text())["models"]
    assert entries["scorer"]["tests"] == ["test_models.py::test_scorer", "test_models.py::test_scorer_and_encoder"]
    shard = suite.runpytest_subprocess(*ARGS, *xdist, "--export-baseline=baseline.json", "--export-strict",
                                       "-k", "classifier or plain", "--junitxml=junit.xml")
    assert shard.ret == pytest.ExitCode.OK
    shard.stdout.fnmatch_lines(["exportobs gate: ok (1 passed, 0 regressions); 3 baseline models not collected here"])
    assert {k: v for k, v in junit_cases(suite.path / "junit.xml").items() if k.startswith("exportobs::")} == {
        "exportobs::classifier": "passed"}
    # the encoder's test is collected but skipped: the encoder is missing, not left out


def test_a_model_whose_collected_tests_did_not_observe_it_is_missing(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    suite.runpytest_subprocess(*ARGS, "--export-baseline=baseline.json", "--export-baseline-update").assert_outcomes(
        passed=15)
    monkeypatch.setenv("SKIP", "test_encoder_long")
    result = suite.runpytest_subprocess(*ARGS, "--export-baseline=baseline.json", "-k", "encoder_long", "-rA")
    result.stdout.fnmatch_lines([
        "exportobs gate: ok (0 passed, 1 missing, 0 regressions); 3 baseline models not collected here",
        "SKIPPED [[]1[]] exportobs: encoder: in the baseline but not observed",
    ])


EXIT_RECORDER = """
import atexit, gc

@atexit.register  # at conftest import, before the plugin's own: runs after it
def record_frozen_objects():
    with open("frozen.txt", "a") as f:
        f.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')} {gc.get_freeze_count()}\\n")
"""


@pytest.mark.parametrize("xdist", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_every_process_of_a_checking_session_exits_with_its_heap_frozen(
    suite: pytest.Pytester, xdist: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The interpreter's collections at exit then skip the objects torch and the exports left."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # this suite's own worker, if any: not the session's
    suite.makeconftest(CONFTEST + EXIT_RECORDER)
    frozen = suite.path / "frozen.txt"
    suite.runpytest_subprocess("-p", "no:cacheprovider", *xdist).assert_outcomes(passed=11)  # check off
    processes = {"main"} | ({"gw0", "gw1"} if xdist else set())
    counts = dict(line.split() for line in frozen.read_text().splitlines())
    assert counts == dict.fromkeys(processes, "0")
    frozen.unlink()
    run(suite, *xdist)
    counts = dict(line.split() for line in frozen.read_text().splitlines())
    assert counts.keys() == processes
    assert all(int(count) > 100_000 for count in counts.values()), counts  # torch alone holds more


# Workers on other hosts do not see the directory the controller names: the hook below names
# one that is not there for the workers in $REMOTE ("all": every worker, replacements too).
REMOTE_HOSTS = '''

@pytest.hookimpl(trylast=True)  # after the plugin named its directory
def pytest_configure_node(node):
    remote = os.environ.get("REMOTE", "")
    if remote == "all" or node.gateway.id in remote.split(","):
        node.workerinput["exportobs_pool"] = "/nonexistent/exportobs-pool"
'''


def counts(models: dict[str, dict]) -> dict[str, tuple[int, int]]:
    return {name: (m["n_observations"], m["n_calls"]) for name, m in models.items()}


TAGGER = '''
import torch

class Tagger(torch.nn.Module):
    """A token classifier: the suite builds it at two widths."""

    def __init__(self, hidden):
        super().__init__()
        self.embed = torch.nn.Embedding(50, hidden)
        self.head = torch.nn.Linear(hidden, 3)

    def forward(self, input_ids, attention_mask=None):
        hidden = self.embed(input_ids)
        if attention_mask is not None:
            hidden = hidden * attention_mask.unsqueeze(-1)
        return self.head(hidden)
'''

# No marker, no watch(): --export-observe finds the models.  Tests come in pairs of one width
# (narrow 0-1, wide 0-1, narrow 2-3...): xdist deals its first units round-robin, two per worker,
# so each worker runs both widths whatever the machine's load.
TAGGER_TESTS = '''
import os, time
import pytest, torch
from tagger import Tagger

@pytest.fixture(scope="module")
def narrow():
    return Tagger(8).eval()

@pytest.fixture(scope="module")
def wide():
    return Tagger(16).eval()

CALLS = [(2, 5), (3, 7), (1, 9), (4, 6), (2, 11), (5, 4)]

def record(name):
    time.sleep(0.3)
    with open("workers.txt", "a") as f:
        f.write(f"{name} {os.environ.get('PYTEST_XDIST_WORKER', 'main')}\\n")

def make_test(fixture, batch, seq):
    def test(request):
        model = request.getfixturevalue(fixture)
        ids = torch.randint(0, 50, (batch, seq))
        mask = torch.ones(batch, seq)
        model(ids, attention_mask=mask)
        assert model(ids, attention_mask=mask).shape == (batch, seq, 3)
        record(request.node.name)
    return test

for first in range(0, len(CALLS), 2):
    for fixture in ("narrow", "wide"):
        for i in (first, first + 1):
            globals()[f"test_{fixture}_{i}"] = make_test(fixture, *CALLS[i])
'''


def test_auto_observed_tests_spread_over_the_workers_and_each_model_is_checked_once_on_every_call(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(tagger=TAGGER, test_tagger=TAGGER_TESTS)
    pytester.syspathinsert()
    observe = ("--export-observe", "tagger.Tagger")
    serial_cases, serial = run(pytester, *observe)
    cases, models = run(pytester, *observe, "-n", "2")
    assert cases == serial_cases
    assert {k: v for k, v in cases.items() if k.startswith("exportobs::")} == {
        f"exportobs::{name}": "passed" for name in serial}
    assert len(serial) == 2 and all(name.startswith("Tagger[Tagger-") for name in serial)
    assert verdicts_and_dims(models) == verdicts_and_dims(serial)
    for model in [*serial.values(), *models.values()]:  # every worker's calls reached the check: both dims vary
        assert (model["n_observations"], model["n_calls"]) == (6, 12)  # each test calls twice alike
        assert model["graphs"][0]["dims"]["input_ids"] == {"0": "batch", "1": "seq"}, model
    ran_on = workers(pytester)
    for width in ("narrow", "wide"):
        assert {ran_on[f"test_{width}_{i}"] for i in range(6)} == {"gw0", "gw1"}


@pytest.mark.parametrize("remote", ["", "all"], ids=["local", "remote"])
def test_a_worker_killed_by_an_unrelated_test_loses_no_observation(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, remote: str
) -> None:
    """The worker saved its calls after each test (a remote one: sent them with its reports): the
    replacement and the other worker (or the controller) check every model on every call, as a
    serial run without the killing test does, and nothing hangs."""
    killer = "\n\ndef test_kills_its_worker():\n    record('test_kills_its_worker')\n    os._exit(3)\n"
    pytester.makepyfile(tagger=TAGGER, test_tagger=TAGGER_TESTS + killer)
    pytester.makeconftest("import os\nimport pytest\n" + REMOTE_HOSTS)
    pytester.syspathinsert()
    observe = ("--export-observe", "tagger.Tagger")
    _, serial = run(pytester, *observe, "-k", "not kills")
    monkeypatch.setenv("REMOTE", remote)
    result = pytester.runpytest_subprocess(*ARGS, *observe, "-n", "2", "--junitxml=junit.xml",
                                           "--export-report=report.json", timeout=300)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    cases = junit_cases(pytester.path / "junit.xml")
    assert {k for k, v in cases.items() if v != "passed"} == {"test_tagger::test_kills_its_worker"}
    models = {m["name"]: m for m in json.loads((pytester.path / "report.json").read_text())["models"]}
    assert verdicts_and_dims(models) == verdicts_and_dims(serial)
    assert counts(models) == {n: (6, 12) for n in serial}
    ran_on = workers(pytester)
    crashed = ran_on["test_kills_its_worker"]
    assert any(ran_on[t] == crashed for t in ran_on if t.startswith("test_narrow")), ran_on  # it had observed


@pytest.mark.parametrize("remote, dist", [("gw1", "load"), ("all", "worksteal")])
def test_workers_on_other_hosts_pool_through_xdist_and_the_models_are_checked_as_in_a_serial_run(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, remote: str, dist: str
) -> None:
    """One remote worker: the local one claims every model and absorbs what the remote one sent.
    Every worker remote: the controller checks the models itself.  (Without a worker that sees
    the directory, no placement is written: ``--dist load`` would keep a module's tests on one
    worker; ``worksteal`` spreads them.)"""
    suite.makeconftest(CONFTEST + REMOTE_HOSTS)
    serial_cases, serial = run(suite)
    monkeypatch.setenv("REMOTE", remote)
    cases, models = run(suite, "-n", "2", "--dist", dist)
    assert cases == serial_cases == {**USER_TESTS, **{f"exportobs::{name}": "passed" for name in MODEL_TESTS}}
    assert verdicts_and_dims(models) == verdicts_and_dims(serial)
    assert counts(models) == counts(serial)
    assert counts(models)["watched"] == (2, 2)  # one call on each worker
    assert set(workers(suite).values()) == {"gw0", "gw1"}
    assert "exportobs_relay" not in (suite.path / "junit.xml").read_text()  # taken off the reports


def test_a_socket_worker_on_another_host_sends_its_observations_through_xdist(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A worker started by execnet's socket server (its own directory, the suite copied there by
    ``--rsyncdir``) and a local one, each in a directory of its own."""
    import select
    import socket
    import subprocess
    import sys

    import execnet.script.socketserver as server

    suite.makeconftest(CONFTEST + REMOTE_HOSTS)
    _, serial = run(suite)
    hosts = tmp_path_factory.mktemp("hosts")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with subprocess.Popen([sys.executable, "-u", server.__file__, f"127.0.0.1:{port}"], cwd=hosts,
                          stdout=subprocess.PIPE, text=True) as listener:  # -u: its first line arrives
        try:
            assert listener.stdout is not None
            assert select.select([listener.stdout], [], [], 60)[0], "the socket server printed nothing in 60 s"
            assert "Entering Accept loop" in listener.stdout.readline()
            monkeypatch.setenv("REMOTE", "gw0")
            cases, models = run(suite, "--tx", f"socket=127.0.0.1:{port}//chdir={hosts / 'socket'}",
                                "--tx", f"popen//chdir={hosts / 'popen'}", "--dist", "load",
                                "--rsyncdir", str(suite.path), "-W", "ignore::DeprecationWarning", str(suite.path))
        finally:
            listener.kill()
    assert verdicts_and_dims(models) == verdicts_and_dims(serial)
    assert counts(models) == counts(serial)
    assert {case.rpartition("::")[2]: outcome for case, outcome in cases.items()} == {
        case.rpartition("::")[2]: outcome for case, outcome in {
            **USER_TESTS, **{f"exportobs::{name}": "passed" for name in MODEL_TESTS}}.items()}
