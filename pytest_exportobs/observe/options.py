"""What the ``observe_export`` marker and ``watch()`` accept: torch-free, the plugin reads it at import."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ObserveOptions:
    """What the ``observe_export`` marker and ``watch()`` accept besides fixture names."""

    name: str | None = None
    set_batch_dimension_for: bool | frozenset[int | str] | None = None
    value_if_missing: dict[str | int, Any] | None = None
    dim_names: dict[str, str] | None = None
    atol: float | None = None
    rtol: float | None = None
    examples: int | None = None
    method: str = "forward"
    xfail: bool | str | None = None
    patches: tuple[str, ...] = ()
    store_n_calls: int = 3
    dims: str | None = None  # "roles" or "observed"; None: the session's export_dims
    dynamic: tuple[str, ...] = ()  # "input:axis" made dynamic
    static: tuple[str, ...] = ()  # "input:axis" pinned static

    @classmethod
    def signature(cls) -> str:
        """The keyword arguments with their defaults: ``name=None, ..., static=()``."""
        return ", ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(cls))

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any], where: str) -> ObserveOptions:
        """Validated options; unknown keys or wrong types raise ``TypeError`` naming ``where``."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"{where}: unknown argument(s) {unknown}; accepted: {sorted(known)}")
        values = dict(kwargs)
        batch = values.get("set_batch_dimension_for")
        if batch is not None and not isinstance(batch, bool):
            values["set_batch_dimension_for"] = frozenset(batch)
        for key in ("patches", "dynamic", "static"):
            if isinstance(values.get(key), str):
                values[key] = (values[key],)
            values[key] = tuple(values.get(key, ()))
        if values.get("dims") not in (None, "roles", "observed"):
            raise TypeError(f"{where}: dims must be 'roles' or 'observed', got {values['dims']!r}")
        for key in ("atol", "rtol"):
            if values.get(key) is not None and not isinstance(values[key], (int, float)):
                raise TypeError(f"{where}: {key} must be a number, got {values[key]!r}")
        examples = values.get("examples")
        if examples is not None and (not isinstance(examples, int) or examples < 0):
            raise TypeError(f"{where}: examples must be a non-negative int, got {examples!r}")
        return cls(**values)
