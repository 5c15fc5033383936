"""Where a model's files go: one directory per model name inside the export directory."""

from __future__ import annotations

import hashlib
import re
import tempfile
from pathlib import Path

RESERVED = frozenset({"cache"})  # entries of the export directory that are no model's
MAX_READABLE = 64  # characters of the name kept readable in its directory name
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")
_DIGEST_SUFFIX = re.compile(r"-[0-9a-f]{8}$")


def model_directory(export_dir: Path, name: str) -> Path:
    """The directory of model ``name``: ``export_dir/<name>`` when ``name`` is a plain file name,
    else ``export_dir/<readable part>-<8 hex digits of the exact name>``.

    Distinct names never share a directory (a plain name never ends like a digest suffix), no
    name leaves ``export_dir`` or takes a reserved entry (``cache``), and the directory name
    stays short (at most ``MAX_READABLE`` + 9 ASCII characters).
    """
    readable = _UNSAFE.sub("_", name).lstrip("._")[:MAX_READABLE].rstrip("._") or "model"
    plain = readable == name and readable.lower() not in RESERVED and not _DIGEST_SUFFIX.search(name)
    if plain:
        return export_dir / name
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return export_dir / f"{readable}-{digest}"


def require_writable_directory(path: Path) -> None:
    """Create ``path`` if needed and write a file in it; raises ``OSError`` when either fails."""
    path.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=path):
        pass
