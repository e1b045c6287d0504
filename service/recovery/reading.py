"""What recovery reads of a run's newest report (``RunRecovery.before_decide`` and ``consider``),
and the ladder window of the open incident's rung in force."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trainguard.service.adaptive_lr import baseline
from trainguard.service.cause import DATA_DIAGNOSES

#: Rule diagnoses of a loss that swings periodically: its likely cause is a batch already too large.
OSCILLATION_DIAGNOSES = frozenset({"loss_oscillation"})
#: A data-quality rule on the newest report: (name, metric, op, threshold, firing).
DataCheck = tuple[str, "str | None", str, Any, bool]


def largest_measured(rows: np.ndarray) -> float | None:
    """The largest value of the newest row that is not NaN (NaN: not measured), None when none is."""
    if len(rows) == 0:
        return None
    row = rows[-1]
    measured = row[~np.isnan(row)]
    return float(measured.max()) if measured.size else None


@dataclass(slots=True)
class ReportReading:
    """The newest report's measurement, the agent's skipped steps, and its data-quality rules."""

    values: dict[str, float] = field(default_factory=dict)
    measured: float | None = None
    """The policy's metric (the update ratio)."""
    measured_scale: float | None = None
    """The ``lr_scale`` the agent reported (the one ``measured`` was measured at)."""
    lr: float | None = None
    """The LR the user's schedule set."""
    skipped_total: float = 0.0
    skipped_now: int = 0
    amp_total: float = 0.0
    amp_skipped_now: int = 0
    """Steps the mixed-precision loss scaler (a GradScaler) skipped since the last report: not
    taken, the weights as they were, but no sign of trouble by themselves (a healthy float16 run's
    scaler skips a step whenever it raises its scale too far): they open an incident (its skip
    rung) only on a report that is unhealthy otherwise, e.g. with a non-finite loss."""
    float32_now: float | None = None
    """The newest report's float32 recompute (largest over the ranks)."""
    data_active: bool = False
    """A data-quality rule fires on the newest report."""
    data_checks: list[DataCheck] = field(default_factory=list)
    """Each data-quality rule on the newest report."""
    oscillating: bool = False
    """A rule of a periodically swinging loss fires on the newest report (``OSCILLATION_DIAGNOSES``)."""

    def take(self, values: dict[str, float], metric: str, *, skips_nonfinite: bool) -> None:
        """Read the report's ``values`` (``RunRecovery.before_decide``)."""
        # Steps the agent did not take since the last report: non-finite ones (when the run skips
        # them: its registration says so) and the spike guard's run of skips at the report step.
        nonfinite = values.get("trainguard_nonfinite_steps_total")
        rose = 0
        if nonfinite is not None and math.isfinite(nonfinite):
            rose = max(int(nonfinite - self.skipped_total), 0) if skips_nonfinite else 0
            self.skipped_total = nonfinite
        spikes = values.get("trainguard_consecutive_skipped_steps", 0.0)
        self.skipped_now = max(rose, int(spikes) if math.isfinite(spikes) else 0)
        amp = values.get("trainguard_amp_skipped_steps_total")
        self.amp_skipped_now = 0
        if amp is not None and math.isfinite(amp):
            self.amp_skipped_now = max(int(amp - self.amp_total), 0)
            self.amp_total = amp
        v = values.get(metric)
        self.measured = None if v is None else float(v)
        self.values = values
        lr = values.get("trainguard_scheduler_lr")
        self.lr = float(lr) if lr is not None and math.isfinite(lr) and lr > 0 else None
        at = values.get("trainguard_lr_scale")
        self.measured_scale = float(at) if at is not None and math.isfinite(at) and at > 0 else None

    def take_findings(self, findings: list[Any], window: Any) -> None:
        """Read the data-quality and loss-oscillation rules and the float32 recompute of the report
        (``RunRecovery.consider``)."""
        self.float32_now = largest_measured(window.rank_history("verify_float32", 1))
        self.data_active = any(f.active and f.rule.diagnosis in DATA_DIAGNOSES for f in findings)
        self.data_checks = [(f.rule.name, getattr(f.rule, "metric", None), getattr(f.rule, "op", ""),
                             getattr(f.rule, "value", None), bool(f.active))
                            for f in findings if f.rule.diagnosis in DATA_DIAGNOSES]
        self.oscillating = any(f.active and f.rule.diagnosis in OSCILLATION_DIAGNOSES for f in findings)

    def save(self) -> tuple[Any, ...]:
        """What a report's undo takes back (the values and the float32 recompute are read afresh)."""
        return (self.skipped_total, self.skipped_now, self.amp_total, self.amp_skipped_now, self.measured,
                self.measured_scale, self.lr, self.data_active, self.data_checks, self.oscillating)

    def restore(self, saved: tuple[Any, ...]) -> None:
        (self.skipped_total, self.skipped_now, self.amp_total, self.amp_skipped_now, self.measured,
         self.measured_scale, self.lr, self.data_active, self.data_checks, self.oscillating) = saved


@dataclass(slots=True)
class RungWindow:
    """The open incident's window: the rung in force gets ``window_reports`` unhealthy reports and
    ``window_steps`` steps from ``rung_step``; ``recover_reports`` healthy ones in a row end it."""

    rung_step: int = 0
    reports_since_rung: int = 0
    healthy_in_a_row: int = 0
    incident_losses: tuple[float, ...] = ()
    """The open incident's losses of its last ``recover_reports`` reports with the signals back."""

    def restart(self, step: int) -> None:
        """A fresh window from ``step`` (a rung taken, or one that stopped working)."""
        self.reports_since_rung = 0
        self.rung_step = step

    def open_at(self, step: int) -> None:
        """An incident opened at ``step``."""
        self.healthy_in_a_row = 0
        self.incident_losses = ()
        self.restart(step)

    def record_loss(self, values: dict[str, float], keep: int) -> None:
        """Keep the report's loss (signals back), the last ``keep`` of them."""
        loss = values.get("trainguard_loss")
        if loss is not None and math.isfinite(loss):
            self.incident_losses = (*self.incident_losses, float(loss))[-keep:]

    def loss_median(self) -> float | None:
        return baseline(self.incident_losses)

    def spent(self, step: int, window_reports: int, window_steps: int) -> bool:
        """Whether the rung in force had its window (counting this unhealthy report)."""
        self.healthy_in_a_row = 0
        self.reports_since_rung += 1
        return self.reports_since_rung >= window_reports and step - self.rung_step >= window_steps
