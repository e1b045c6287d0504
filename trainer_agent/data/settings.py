"""The data pipeline's number settings: what an integer or a real one is (a numpy one too, never a
bool: ``True`` is no size), the ``ValueError`` that names a bad one, and the token ids a setting names
(special ids, the padding id)."""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import Any

__all__ = ["check_pad_id", "int_setting", "is_int", "is_real", "token_ids"]


def is_int(value: Any) -> bool:
    """Whether ``value`` is an integer (a numpy one too) and not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """Whether ``value`` is a real number (a numpy one too) and not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def int_setting(name: str, value: Any, *, least: int = 1, most: int | None = None, why: str = "") -> int:
    """``value`` of the setting ``name`` as an int in ``least..most``; ``ValueError`` naming the
    setting otherwise (``why``: the reason for ``most``)."""
    if not is_int(value) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    if most is not None and value > most:
        raise ValueError(f"{name} must be <= {most}{f' ({why})' if why else ''}, got {value}")
    return int(value)


def token_ids(ids: Any, vocab_size: int | None = None) -> tuple[int, ...]:
    """``ids`` (special token ids: a collection, an array or a tensor) as a tuple of ints, each in
    ``[0, vocab_size)`` when the vocabulary is known; ``ValueError`` for anything else (a string is
    no collection of ids: ``"12"`` is not ids 1 and 2)."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise ValueError(f"special_ids must be a collection of token ids, got {ids!r}")
    out = tuple(ids.tolist() if hasattr(ids, "tolist") else ids)  # an array or tensor of ids
    for i in out:
        if not is_int(i):
            raise ValueError(f"special ids must be integers, got {i!r}")
        if vocab_size is not None and not 0 <= i < vocab_size:
            raise ValueError(f"special id {i} outside the vocabulary [0, {vocab_size})")
    return tuple(int(i) for i in out)


def check_pad_id(pad_id: Any) -> None:
    """``ValueError`` unless ``pad_id`` is an integer or None (a string would match no token: no
    padding at all)."""
    if pad_id is not None and not is_int(pad_id):
        raise ValueError(f"pad_id must be an integer or None, got {pad_id!r}")
