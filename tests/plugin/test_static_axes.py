"""``export_static``: axes kept static in every model that takes the input they name (but those a
model's own ``dynamic=`` names), in real sessions (serial and xdist), against the same session
without the setting."""

from __future__ import annotations

import json

import pytest

from models import QUICK_CHECK, junit_cases

pytestmark = pytest.mark.slow  # pytest sessions in subprocesses

VISION = '''
import torch

class Classifier(torch.nn.Module):
    """Images of any side: a convolution, then the mean over the sides."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        return self.conv(x).mean(dim=(2, 3))

class Tagger(torch.nn.Module):
    """Token states of any length (its input is not named ``x``)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, states):
        return self.linear(states)
'''

# the tests vary the batch of the images, never their sides; the tagger's length
SUITE = '''
import torch
from vision import Classifier, Tagger

def test_classify():
    model = Classifier().eval()
    for batch in (2, 3):
        assert model(torch.randn(batch, 3, 8, 8)).shape == (batch, 4)

def test_tag():
    model = Tagger().eval()
    for length in (5, 7):
        assert model(torch.randn(2, length, 4)).shape == (2, length, 2)

def test_any_side(export_observer):
    model = export_observer.watch(Classifier().eval(), name="any-side", dynamic=("x:2", "x:3"))
    for batch in (2, 3):
        assert model(torch.randn(batch, 3, 8, 8)).shape == (batch, 4)
'''

OBSERVE = ("--export-observe", "torch.nn.Module", "--export-report=report.json", "--junitxml=junit.xml")
STATIC = "[pytest]\npythonpath = .\nexport_static =\n    x:2\n    x:3\n"


@pytest.fixture
def project(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(vision=VISION, test_suite=SUITE)
    pytester.makeini("[pytest]\npythonpath = .\n")
    return pytester


def dims_of(project: pytest.Pytester) -> dict[str, list[dict[str, dict[str, str]]]]:
    """Model name -> its graphs' dims, as the report gives them."""
    report = json.loads((project.path / "report.json").read_text())
    return {model["name"]: [graph["dims"] for graph in model["graphs"]] for model in report["models"]}


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_the_named_axes_stay_static_in_the_models_taking_that_input_and_no_other_changes(
    project: pytest.Pytester, workers: list[str]
) -> None:
    project.runpytest_subprocess(*QUICK_CHECK, *OBSERVE)
    guessed = dims_of(project)
    assert guessed["Classifier"] == [{"x": {"0": "batch", "2": "height", "3": "width"}}]  # sides guessed

    project.makeini(STATIC)
    result = project.runpytest_subprocess(*QUICK_CHECK, *OBSERVE, *workers)
    assert result.ret == pytest.ExitCode.OK
    assert junit_cases(project.path / "junit.xml") == {
        "test_suite::test_classify": "passed", "test_suite::test_tag": "passed", "test_suite::test_any_side": "passed",
        "exportobs::Classifier": "passed", "exportobs::Tagger": "passed", "exportobs::any-side": "passed",
    }
    pinned = dims_of(project)
    assert pinned["Classifier"] == [{"x": {"0": "batch"}}]  # the batch the tests vary stays dynamic
    assert pinned["Tagger"] == guessed["Tagger"]  # takes no x: as without the setting
    assert pinned["Tagger"][0]["states"]["1"]  # its length is dynamic
    assert pinned["any-side"] == guessed["any-side"] == guessed["Classifier"]  # its own dynamic= wins


def test_an_axis_not_named_input_colon_axis_is_a_usage_error(project: pytest.Pytester) -> None:
    project.makeini("[pytest]\npythonpath = .\nexport_static =\n    pixel_values\n")
    result = project.runpytest_subprocess(*QUICK_CHECK, *OBSERVE)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: export_static: expected input:axis (pixel_values:2), got 'pixel_values'"])
