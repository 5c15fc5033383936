"""Versions of the packages an export depends on."""

from __future__ import annotations

import functools
from importlib.metadata import PackageNotFoundError, version

PACKAGES = ("torch", "onnx", "onnxscript", "onnxruntime", "executorch", "transformers", "pytest-exportobs")


@functools.cache
def package_versions() -> dict[str, str]:
    """``{package: version}`` of the installed packages among :data:`PACKAGES` (read once)."""
    versions = {}
    for package in PACKAGES:
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            continue
    return versions
