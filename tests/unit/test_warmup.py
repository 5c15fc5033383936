"""The warm-up before forked checks (engine.export.warmup)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from pytest_exportobs.engine.export.warmup import warm_up


def test_the_warm_up_exports_and_runs_its_model_leaving_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It goes through the whole pipeline (a warm-up that silently failed would save nothing),
    in a temporary directory it removes."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert warm_up()
    assert not list(tmp_path.iterdir())
