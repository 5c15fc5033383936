"""``python -m pytest_exportobs.compare old.json new.json [--markdown]``: compare two JSON reports
(see :mod:`pytest_exportobs.gate.compare`)."""

from __future__ import annotations

from .gate.compare import main

if __name__ == "__main__":
    raise SystemExit(main())
