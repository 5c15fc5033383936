"""The version is kept in one place: ``pytest_exportobs.__version__`` is the newest release in
CHANGELOG.md, and pyproject.toml reads it from the package (pure Python, no torch)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import pytest_exportobs

ROOT = Path(__file__).parents[2]
RELEASE = re.compile(r"^## \[(\d+)\.(\d+)\.(\d+)\] - (\d{4}-\d{2}-\d{2})$", re.MULTILINE)


def changelog() -> str:
    return (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")


def releases() -> list[tuple[tuple[int, int, int], str]]:
    """``((major, minor, patch), date)`` of every release heading, in the file's order."""
    return [((int(major), int(minor), int(patch)), date) for major, minor, patch, date in RELEASE.findall(changelog())]


def test_the_package_version_is_the_newest_release_in_the_changelog() -> None:
    newest, _ = releases()[0]
    assert pytest_exportobs.__version__ == ".".join(map(str, newest))


def test_releases_come_newest_first_under_unreleased() -> None:
    found = releases()
    versions, dates = [version for version, _ in found], [date for _, date in found]
    assert len(found) >= 2
    assert versions == sorted(set(versions), reverse=True)
    assert dates == sorted(dates, reverse=True)
    newest = ".".join(map(str, versions[0]))
    assert -1 < changelog().find("\n## [Unreleased]\n") < changelog().index(f"\n## [{newest}] - ")


def test_pyproject_reads_the_version_from_the_package() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "pytest_exportobs.__version__"}


def test_the_version_is_read_without_torch() -> None:
    code = "import sys, pytest_exportobs; print(pytest_exportobs.__version__, 'torch' in sys.modules)"
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           cwd=ROOT).stdout.split()
    assert shown == [pytest_exportobs.__version__, "False"]
