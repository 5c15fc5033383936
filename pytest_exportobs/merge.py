"""``python -m pytest_exportobs.merge shard-*.json --report merged.json [--baseline B.json]``:
merge CI shards' JSON reports and gate them as one run (see :mod:`pytest_exportobs.gate.merge`)."""

from __future__ import annotations

from .gate.merge import main

if __name__ == "__main__":
    raise SystemExit(main())
