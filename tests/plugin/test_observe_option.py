"""``--export-observe CLASS``: every called instance of a class observed, outermost calls only, with no
test edited; the rule in process, then real sessions (serial, xdist, ini, exclusions, usage errors)."""

from __future__ import annotations

import json
import threading
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import pytest

from models import LOADED_WITHOUT_CHECK, QUICK_CHECK, junit_cases

pytestmark = pytest.mark.slow  # pytest sessions in subprocesses

torch = pytest.importorskip("torch")

from pytest_exportobs.observe.autoobserve import (  # noqa: E402
    AutoObserve,
    most_general,
    patched_classes,
    resolve_classes,
)

MYPKG = '''
import torch

class Base(torch.nn.Module):
    """The user's base class of models."""

class Inner(Base):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x)

class Outer(Base):
    def __init__(self):
        super().__init__()
        self.inner = Inner()
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.relu(self.inner(x)))

class Scaler(Base):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.weight

class Branchy(Base):
    """torch.export cannot capture a branch on values."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x) if x.sum() > 0 else -x

class Other(torch.nn.Module):
    def forward(self, x):
        return x + 1
'''

# No marker anywhere: models built in a test, in a module-scoped fixture, as a module global.
SUITE = '''
import pytest, torch
from mypkg import Branchy, Other, Outer, Scaler

GLOBAL = Branchy().eval()

@pytest.fixture(scope="module")
def outer():
    torch.manual_seed(0)
    return Outer().eval()

def test_outer_batch_2(outer):
    assert outer(torch.randn(2, 4)).shape == (2, 2)

def test_outer_batch_5(outer):
    outer(torch.randn(5, 4))

def test_outer_and_user_failure(outer):
    outer(torch.randn(3, 4))
    assert False, "a user test failure"

def test_inner_called_directly(outer):
    outer.inner(torch.randn(7, 4))

def test_built_in_the_test():
    Scaler()(torch.randn(3, 4))
    Other()(torch.randn(3, 4))

def test_module_global():
    GLOBAL(torch.randn(3, 4))

def test_no_model():
    pass
'''

SUITE_OBSERVED = '''
import pytest, torch
from mypkg import Scaler

@pytest.fixture
def scaler():
    return Scaler()

@pytest.mark.observe_export("scaler", name="scaler-marked")
def test_marked(scaler):
    scaler(torch.randn(2, 4))

def test_watched(export_observer):
    export_observer.watch(Scaler(), name="scaler-watched")(torch.randn(2, 4))
'''

OBSERVE = ("--export-observe", "mypkg.Base")
ORDINARY = {
    "test_suite::test_outer_batch_2": "passed",
    "test_suite::test_outer_batch_5": "passed",
    "test_suite::test_outer_and_user_failure": "failure",
    "test_suite::test_inner_called_directly": "passed",
    "test_suite::test_built_in_the_test": "passed",
    "test_suite::test_module_global": "passed",
    "test_suite::test_no_model": "passed",
    "test_observed::test_marked": "passed",
    "test_observed::test_watched": "passed",
}
MODELS = {
    "exportobs::Outer": "passed",
    "exportobs::Inner": "passed",
    "exportobs::Scaler": "passed",
    "exportobs::Branchy": "failure",
    "exportobs::scaler-marked": "passed",
    "exportobs::scaler-watched": "passed",
}
OBSERVED_BY = {  # test -> the groups it observed (junitxml properties)
    "test_outer_batch_2": ["Outer"],
    "test_outer_batch_5": ["Outer"],
    "test_outer_and_user_failure": ["Outer"],
    "test_inner_called_directly": ["Inner"],
    "test_built_in_the_test": ["Scaler"],
    "test_module_global": ["Branchy"],
    "test_no_model": [],
    "test_marked": ["scaler-marked"],
    "test_watched": ["scaler-watched"],
}


@pytest.fixture
def project(pytester: pytest.Pytester) -> pytest.Pytester:
    """``mypkg`` importable from the rootdir in the session's own process too (``pythonpath``)."""
    pytester.makepyfile(mypkg=MYPKG, test_suite=SUITE, test_observed=SUITE_OBSERVED)
    pytester.makeini("[pytest]\npythonpath = .\n")
    return pytester


def observed_by(path: Path) -> dict[str, list[str]]:
    """Test name -> the values of its ``exportobs`` properties in a junit xml file."""
    return {
        case.get("name"): [p.get("value") for p in case.iter("property") if p.get("name") == "exportobs"]
        for case in ET.parse(path).getroot().iter("testcase") if case.get("classname") != "exportobs"
    }


# -- the rule, in process


class Base(torch.nn.Module):
    pass


class Inner(Base):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class Outer(Base):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * 2


def started_by(observer: AutoObserve, calls: Callable[[], object]) -> list[str]:
    """The classes of the modules ``start`` was called for while ``calls()`` ran."""
    started: list[str] = []
    try:
        with observer.calls(lambda module: started.append(type(module).__name__)):
            calls()
    finally:
        observer.uninstall()
    return started


def test_only_the_outermost_call_is_observed_unless_the_inner_module_is_called_directly() -> None:
    outer, x = Outer(), torch.randn(2, 4)
    assert started_by(AutoObserve((Base,)), lambda: [outer(x), outer(x)]) == ["Outer"]
    assert started_by(AutoObserve((Base,)), lambda: [outer(x), outer.inner(x)]) == ["Outer", "Inner"]


def test_generate_observes_the_model_it_calls_not_the_base_model_inside(tiny_llama: torch.nn.Module) -> None:
    from transformers import PreTrainedModel

    def generate() -> torch.Tensor:
        return tiny_llama.generate(torch.randint(0, 100, (1, 5)), max_new_tokens=2, do_sample=False, pad_token_id=0)

    assert started_by(AutoObserve((PreTrainedModel,)), generate) == ["LlamaForCausalLM"]


def test_a_subclass_of_a_target_is_patched_through_its_base_unless_it_has_its_own_call() -> None:
    class OwnCall(Inner):
        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            return super().__call__(x)

    assert most_general([Inner, Base, Outer, Base]) == [Base]
    patched = patched_classes([Inner, Base])
    assert patched[0] is Base and OwnCall in patched and Inner not in patched
    outer, x = Outer(), torch.randn(2, 4)
    assert started_by(AutoObserve((Inner, Base)), lambda: outer(x)) == ["Outer"]
    assert started_by(AutoObserve((Inner,)), lambda: [OwnCall()(x), Outer()(x)]) == ["OwnCall", "Inner"]


def test_classes_get_back_exactly_their_attributes_and_a_raising_block_ends() -> None:
    class OwnCall(Base):
        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            return x + 1

    before = {cls: dict(vars(cls)) for cls in (Base, OwnCall, torch.nn.Module)}
    observer, started = AutoObserve((Base, OwnCall)), []
    with pytest.raises(RuntimeError, match="the test"):
        with observer.calls(started.append):
            assert OwnCall()(torch.zeros(1)).item() == 1
            raise RuntimeError("the test")
    Inner()(torch.zeros(1, 4))  # after the block: not observed
    assert [type(m).__name__ for m in started] == ["OwnCall"]
    observer.uninstall()
    assert {cls: dict(vars(cls)) for cls in before} == before


def test_a_failing_start_is_counted_and_the_model_still_runs_once() -> None:
    model, x, runs = Inner(), torch.randn(2, 4), []
    model.register_forward_hook(lambda *a: runs.append(1))

    def start(module: torch.nn.Module) -> None:
        raise ValueError("cannot observe")

    observer = AutoObserve((Base,))
    with observer.calls(start):
        got = model(x)
        model(x)
    observer.uninstall()
    torch.testing.assert_close(got, model(x))
    assert (len(runs), dict(observer.failures)) == (3, {"ValueError: cannot observe": 1})


def test_excluded_classes_other_threads_and_tracing_are_not_observed() -> None:
    outer, x = Outer(), torch.randn(2, 4)
    excluded = AutoObserve((Base,), exclude=("*.Outer",))
    assert started_by(excluded, lambda: outer(x)) == ["Inner"]  # an excluded class is no target
    thread = threading.Thread(target=outer, args=(x,))
    assert started_by(AutoObserve((Base,)), lambda: (thread.start(), thread.join())) == []
    assert started_by(AutoObserve((Base,)), lambda: torch.export.export(outer, (x,))) == []
    compiled, expected = torch.compile(lambda x: outer(x) + 1, fullgraph=True), outer(x) + 1
    assert started_by(AutoObserve((Base,)), lambda: torch.testing.assert_close(compiled(x), expected)) == []


def test_bad_paths_are_value_errors_naming_the_path() -> None:
    assert resolve_classes(["torch.nn.Linear", f"{__name__}.Base"]) == (torch.nn.Linear, Base)
    for path, reason in [("nopkg_exportobs.Base", "cannot be imported: ModuleNotFoundError"),
                         ("torch.nn.NoSuchClass", "cannot be imported: AttributeError"),
                         ("torch.nn.functional.relu", "is a function, not a class"),
                         ("threading.Thread", "is not a torch.nn.Module subclass")]:
        with pytest.raises(ValueError, match=f"'{path}' {reason}"):
            resolve_classes([path])


# -- real sessions


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_every_called_model_of_the_class_becomes_an_outcome(project: pytest.Pytester, workers: list[str]) -> None:
    result = project.runpytest_subprocess(*QUICK_CHECK, *OBSERVE, *workers, "--junitxml=junit.xml", "-rA")
    assert junit_cases(project.path / "junit.xml") == {**ORDINARY, **MODELS}
    assert observed_by(project.path / "junit.xml") == OBSERVED_BY
    result.stdout.fnmatch_lines(["FAILED exportobs::Branchy - failed at torch.export: *"])
    result.stdout.re_match_lines([r"Inner\s+passed\s+\S+\s+1\s", r"Outer\s+passed\s+\S+\s+3\s"])
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_without_export_check_the_option_does_nothing(project: pytest.Pytester) -> None:
    project.makeconftest('''
import json, sys

def pytest_sessionfinish(session):
    with open("loaded.json", "w") as f:
        json.dump(sorted(m for m in sys.modules if m.startswith("pytest_exportobs")), f)
''')
    result = project.runpytest_subprocess(*OBSERVE, "--junitxml=junit.xml", "-p", "no:cacheprovider")
    assert junit_cases(project.path / "junit.xml") == ORDINARY
    assert not any(observed_by(project.path / "junit.xml").values())
    assert json.loads((project.path / "loaded.json").read_text()) == LOADED_WITHOUT_CHECK  # as without the option
    assert not (project.path / ".exportobs").exists()
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_ini_form_and_exclusions_by_pattern_and_marker(project: pytest.Pytester) -> None:
    project.makeini("""[pytest]
pythonpath = .
export_observe =
    mypkg.Base
export_observe_exclude =
    *::test_module_global
    mypkg.Scal*
""")
    marked = SUITE.replace("def test_outer_batch_5", "@pytest.mark.no_observe_export\ndef test_outer_batch_5")
    project.makepyfile(test_suite=marked)
    project.makepyfile(test_excluded_module='''
import pytest, torch
from mypkg import Inner

pytestmark = pytest.mark.no_observe_export

def test_inner():
    Inner()(torch.randn(2, 4))
''')
    result = project.runpytest_subprocess(*QUICK_CHECK, "--strict-markers", "--junitxml=junit.xml")
    observed = {"Outer": "passed", "Inner": "passed", "scaler-marked": "passed", "scaler-watched": "passed"}
    assert junit_cases(project.path / "junit.xml") == {
        **ORDINARY, "test_excluded_module::test_inner": "passed", **{f"exportobs::{n}": v for n, v in observed.items()}}
    not_observed = ("test_outer_batch_5", "test_built_in_the_test", "test_module_global", "test_inner")
    assert observed_by(project.path / "junit.xml") == {**OBSERVED_BY, **{name: [] for name in not_observed}}
    assert result.ret == pytest.ExitCode.TESTS_FAILED


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_a_bad_class_path_is_a_usage_error_naming_it(project: pytest.Pytester, workers: list[str]) -> None:
    result = project.runpytest_subprocess(*QUICK_CHECK, "--export-observe", "mypkg.Nope", *workers)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --export-observe / export_observe 'mypkg.Nope' cannot be imported: "
                                 "AttributeError: module 'mypkg' has no attribute 'Nope'"])
    assert "Traceback" not in result.stdout.str() + result.stderr.str()
