"""The old name of :mod:`service.rate_and_oscillation` (the ``rate`` and ``oscillation`` rule
kinds' evaluation; unrelated to ``trainer_agent/measure/triage_stats.py``, the agent's gradient statistics):
re-exports it."""

from trainguard.service.rate_and_oscillation import centred_steps, oscillation, periodogram_peak, rate

__all__ = ["rate", "oscillation", "periodogram_peak", "centred_steps"]
