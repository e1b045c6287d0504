"""The data pipeline's integer settings: what one is (an integer, a numpy one too, never a bool:
``True`` is no size) and the ``ValueError`` that names a bad one."""

from __future__ import annotations

import numbers
from typing import Any

__all__ = ["int_setting", "is_int"]


def is_int(value: Any) -> bool:
    """Whether ``value`` is an integer (a numpy one too) and not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def int_setting(name: str, value: Any, *, least: int = 1, most: int | None = None, why: str = "") -> int:
    """``value`` of the setting ``name`` as an int in ``least..most``; ``ValueError`` naming the
    setting otherwise (``why``: the reason for ``most``)."""
    if not is_int(value) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    if most is not None and value > most:
        raise ValueError(f"{name} must be <= {most}{f' ({why})' if why else ''}, got {value}")
    return int(value)
