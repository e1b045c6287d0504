"""The controller's refusals, each answered with its HTTP status by the app (``service.app``)."""

from __future__ import annotations

__all__ = ["NotFound", "Conflict", "Forbidden", "Invalid"]


class NotFound(LookupError):
    """404."""


class Conflict(Exception):
    """409."""


class Forbidden(Exception):
    """403."""


class Invalid(ValueError):
    """422."""
