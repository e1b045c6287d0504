"""The controller client's settings (``trainer_agent/report/client.py``): their bounds
(:func:`check_settings`) and the delay its retries wait after failures (:func:`backoff_delay`)."""

from __future__ import annotations

import random

__all__ = ["backoff_delay", "check_settings"]


def backoff_delay(failures: int, initial_s: float, max_s: float, rng: random.Random) -> float:
    """Seconds to wait after ``failures`` consecutive failures (>= 1): exponential with "equal
    jitter", ``d/2 + uniform(0, d/2)`` with ``d = min(max_s, initial_s * 2**(failures-1))``, so
    that the agents of many jobs do not retry in lockstep after a controller restart."""
    d = min(max_s, initial_s * 2 ** min(failures - 1, 60))
    return d / 2 + rng.uniform(0, d / 2)


def check_settings(request_timeout_s: float, connect_timeout_s: float | None, long_poll_s: float,
                   max_buffered_reports: int, backoff_initial_s: float, backoff_max_s: float) -> None:
    """Raise ValueError when a setting of the controller client is out of its bounds."""
    if not request_timeout_s > 0:
        raise ValueError(f"request_timeout_s must be > 0, got {request_timeout_s}")
    if connect_timeout_s is not None and not connect_timeout_s > 0:
        raise ValueError(f"connect_timeout_s must be > 0, got {connect_timeout_s}")
    if not long_poll_s >= 0:
        raise ValueError(f"long_poll_s must be >= 0, got {long_poll_s}")
    if max_buffered_reports < 1:
        raise ValueError(f"max_buffered_reports must be >= 1, got {max_buffered_reports}")
    if not 0 < backoff_initial_s <= backoff_max_s:
        raise ValueError(
            f"need 0 < backoff_initial_s <= backoff_max_s, got {backoff_initial_s}, {backoff_max_s}"
        )
