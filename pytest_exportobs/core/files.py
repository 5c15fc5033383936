"""Stable JSON text, atomic writes and files known by their content."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
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


def copy_atomic(source: str | os.PathLike[str], path: str | os.PathLike[str]) -> FileMark:
    """Copy ``source`` to ``path`` as :func:`write_atomic` writes; the :class:`FileMark` of the
    copy, taken before it is moved there (a file another process moves there later has its own)."""
    with _replacing(Path(path)) as tmp:
        shutil.copyfile(source, tmp)
        mark = FileMark.of(tmp)
    return mark


def file_digest(path: str | os.PathLike[str]) -> str:
    """SHA-256 of a file's content: what a copy keeps (a cache restored in CI: a new inode and,
    after ``cp`` or some archivers, a new modification time) and a rewrite changes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class FileMark:
    """A file's content as hashed (:func:`file_digest`), with the size and modification time it
    had then: a file that still has both is taken as hashed without being read again (a rerun in
    place); another (a copy, a cache restored in CI) is hashed."""

    digest: str
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: str | os.PathLike[str]) -> FileMark:
        found = os.stat(path)  # before the content: a write while it is hashed changes the time
        return cls(file_digest(path), found.st_size, found.st_mtime_ns)

    def describes(self, path: str | os.PathLike[str]) -> bool:
        """Whether ``path`` holds the content marked (raises ``OSError`` when it cannot be read)."""
        found = os.stat(path)
        if (found.st_size, found.st_mtime_ns) == (self.size, self.mtime_ns):
            return True
        return found.st_size == self.size and file_digest(path) == self.digest


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
