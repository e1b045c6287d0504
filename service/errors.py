"""The controller's refusals, each answered with its HTTP status by the app (``service.app``)."""

from __future__ import annotations

__all__ = ["NotFound", "Conflict", "Forbidden", "Invalid", "TooMany"]


class NotFound(LookupError):
    """404."""


class Conflict(Exception):
    """409."""


class Forbidden(Exception):
    """403."""


class Invalid(ValueError):
    """422."""


class TooMany(Exception):
    """429: a limit on what one client may create (runs, series)."""
