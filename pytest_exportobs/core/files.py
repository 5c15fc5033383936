"""Stable JSON text and atomic writes."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def json_text(data: Any) -> str:
    """Stable JSON: sorted keys, indent 2, trailing newline (small diffs in code review)."""
    return json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def write_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` so that a concurrent reader sees the old file or the new one, never a part."""
    with _replacing(Path(path)) as tmp:
        with open(tmp, "x", encoding="utf-8", newline="\n") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    return Path(path)


def copy_atomic(source: str | os.PathLike[str], path: str | os.PathLike[str]) -> os.stat_result:
    """Copy ``source`` to ``path`` as :func:`write_atomic` writes; the status of the copy, taken
    before it is moved there (the move keeps its inode, size and modification time: a file
    another process moves there later has another inode)."""
    with _replacing(Path(path)) as tmp:
        shutil.copyfile(source, tmp)
        copied = os.stat(tmp)
    return copied


def file_identity(status: os.stat_result) -> list[int]:
    """Inode, size and modification time of a file in nanoseconds: what changes when the file is
    replaced or written again, checked without reading it (as Python checks a ``.pyc`` against
    its source)."""
    return [status.st_ino, status.st_size, status.st_mtime_ns]


@contextlib.contextmanager
def _replacing(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write; ``os.replace`` moves it there on success."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
