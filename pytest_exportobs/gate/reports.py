"""The report files of a session's export checks: the JSON report and the Markdown one beside it
written (their text is :mod:`.render`'s), and a JSON report read back."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.files import json_text, write_atomic
from ..engine.base.result import ModelResult
from .baseline import CHECKS, Checks, dict_of, is_a, list_of, load_json, require, require_version, validated_model
from .judge import Gate
from .render import REPORT_SCHEMA_VERSION, report_json, report_markdown

# The fields of a reported model that are read back (what the gate judges), with their checks.
_RESULT_CHECKS: Checks = {
    **CHECKS,
    "env": (dict_of(is_a(str)), "an object of strings"),
    "reason": (is_a(str), "a string"),
    "expected_failure": (is_a(str), "a string"),
    "graphs": (list_of(is_a(dict)), "a list of objects"),
}


@dataclass
class Report:
    """The models of a JSON report, as far as the gate needs them (verdict, stage, dims, versions…)."""

    results: list[ModelResult]

    @classmethod
    def from_json(cls, data: Any) -> Report:
        """Validate a decoded report; raises BaselineError describing the first problem."""
        require_version(data, REPORT_SCHEMA_VERSION, "report")
        require(data.get("models"), list_of(is_a(dict)), "models", "a list of objects")
        results = []
        for index, item in enumerate(data["models"]):
            require(item.get("name"), is_a(str), f"models[{index}].name", "a string")
            validated_model(item["name"], item, _RESULT_CHECKS)
            results.append(ModelResult.from_json(item))
        return cls(results)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Report:
        """Read a JSON report; any problem (missing, unreadable, invalid) raises BaselineError."""
        return load_json(path, cls.from_json)


def write_reports(
    path: str | os.PathLike[str], results: Iterable[ModelResult], gate: Gate | None, env: dict[str, str]
) -> list[Path]:
    """Write the JSON report at ``path`` and the Markdown report beside it; return both paths."""
    path = Path(path)
    results = sorted(results, key=lambda r: r.name)
    return [
        write_atomic(path, json_text(report_json(results, gate, env))),
        write_atomic(path.with_suffix(".md"), report_markdown(results, gate, env)),
    ]
