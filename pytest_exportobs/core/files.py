"""Stable JSON text and atomic writes."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any


def json_text(data: Any) -> str:
    """Stable JSON: sorted keys, indent 2, trailing newline (small diffs in code review)."""
    return json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def write_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` through a temporary file in the same directory and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "x", encoding="utf-8", newline="\n") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
