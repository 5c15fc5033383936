"""pytest-exportobs: export-readiness testing of PyTorch models from the calls your tests make.

The public names are resolved lazily so that loading the pytest plugin imports no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.7.0"  # the newest release in CHANGELOG.md (tests/unit/test_version.py)

_PUBLIC = {  # public name -> module defining it
    "InputObserver": "api.observer",
    "ObserverError": "api.errors",
    "ObserverIndexError": "api.errors",
    "Observation": "observe.recorder",
    "string_type": "core.string_type",
    "register_flattening_functions": "core.cache_pytrees",
    "load_program": "core.programs",
    "make_dynamic_cache": "core.caches",
    "export_patches": "compat.export_patches",
    "make_encoder_decoder_cache": "core.caches",
    "make_static_cache": "core.caches",
    "ModelInputs": "api.inputs",
    "all_dynamic_shape_from_inputs": "api.inputs",
    "all_dynamic_shapes_from_inputs": "api.inputs",
    "use_dyn_not_str": "api.inputs",
    "ShapeModel": "shapes.model",
    "get_untrained_model_with_inputs": "api.untrained",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'pytest_exportobs' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
