"""A rule's verdict on a window as the evaluation gives it (:class:`Finding`), and what each rule
kind's function returns (:data:`Verdict`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Finding", "Verdict", "json_number"]


@dataclass(frozen=True, slots=True)
class Finding:
    """A rule's verdict on a window: ``active`` True (condition holds), False (it does not), or
    None (no data to judge: the firing state stays as it is)."""

    rule: Any
    active: bool | None
    summary: str = ""
    values: dict[str, Any] = field(default_factory=dict)


#: What an evaluation function returns: a firing :class:`Finding`, or ``False`` (the condition does
#: not hold) or ``None`` (no data to judge). :func:`evaluate` turns the last two into the rule's
#: shared findings (see ``service.evaluate._Plan``).
Verdict = Any


def json_number(x: float) -> float | str:
    """A float for JSON-friendly alert values (NaN/Inf as the wire's strings)."""
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    return float(x)
