"""Suggestions for a misspelt name (a metric, a per-rank vector): the known names most like it."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["closest"]

_PREFIX = "trainguard_"


def closest(name: str, known: Iterable[str], n: int = 3) -> list[str]:
    """Up to ``n`` of ``known`` most like ``name``, best first, compared without the common
    ``trainguard_`` prefix (which would make every metric look alike to every other)."""
    by_short = {k.removeprefix(_PREFIX): k for k in known}
    return [by_short[c] for c in difflib.get_close_matches(name.removeprefix(_PREFIX), list(by_short), n=n, cutoff=0.7)]
