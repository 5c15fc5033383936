"""hypothesis' private names: the constants it draws some examples from, read from the sources
of the local modules."""

from __future__ import annotations


def collect_local_constants() -> None:
    """Read the constants of the local modules now (hypothesis reads them once per process, at
    its first draw of a constant, and caches them by source hash in its storage directory)."""
    from hypothesis.internal.conjecture.providers import _get_local_constants

    _get_local_constants()
