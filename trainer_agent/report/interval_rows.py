"""The report interval's rows on the device (``IntervalRows``): one (loss, gradient norm) row per
step, and the interval's loss, non-finite steps and largest gradient norm derived from them at the
report step (``trainer_agent/report/pipeline.py``), without a host-device sync."""

from __future__ import annotations

import math

import torch

from trainer_agent.report.host_derived import HostDerived, Raw

__all__ = ["IntervalRows"]


def _no_finite_norm(raw: Raw, values: dict[str, float]) -> None:
    """Host job: ``trainguard_grad_norm_max`` is NaN where no step of the interval had a finite norm."""
    if values.get("trainguard_grad_norm_max") == -math.inf:
        values["trainguard_grad_norm_max"] = math.nan


def _no_loss(raw: Raw, values: dict[str, float]) -> None:
    """Host job: no step of the report interval had a loss (``end_step(None)`` only): the report has none."""
    values.pop("trainguard_loss", None)


class IntervalRows:
    """One row per step of the report interval, (loss, pre-clip gradient norm or 0), on the device:
    a step costs one small copy; the report derives from the rows the interval's non-finite steps,
    its first non-finite loss (the loss the report then carries, so a NaN between two reports is
    not lost) and its largest finite gradient norm. Zeroed (all finite) after each report. 16 bytes
    per step of ``report_every``. Whether a step of the interval had a loss is known on the host
    (:attr:`had_loss`): a report whose interval had none has no loss, rather than repeat an
    earlier interval's (a NaN counted again at every report)."""

    def __init__(self, report_every: int, device: torch.device) -> None:
        self.interval = torch.zeros(report_every, 2, dtype=torch.float64, device=device)
        self.zero = torch.zeros((), dtype=torch.float64, device=device)
        self.nonfinite_steps = torch.zeros((), dtype=torch.float64, device=device)
        """Non-finite steps before the current report interval (device scalar: no sync)."""
        self.had_loss = False
        """A step of the current report interval had a loss (host)."""
        self.had_norm = False
        """A step of the current report interval had a gradient norm (host)."""
        self.unnormed: set[int] = set()
        """The interval's rows of steps without a gradient norm (host; rare): out of its largest."""
        self.recorded = 0
        """Steps recorded in the current report interval (host)."""
        self.first_row = 0
        """The row of the interval's first step: with fewer steps than rows (the report of step 1,
        the one after it, the first after a restore) the others were not written and are left out."""

    def record(self, step: int, loss_t: torch.Tensor | None, grad_norm: torch.Tensor | None) -> torch.Tensor:
        """The step's row of the interval: (loss, grad norm); a step without one counts it as 0.
        With sharded parameters ``grad_norm`` is the step's ``StepState.grad_share`` (a share of
        the squared norm), turned into the global norm at the report."""
        at = (step - 1) % self.interval.shape[0]
        if not self.recorded:
            self.first_row = at
        self.recorded += 1
        self.had_loss |= loss_t is not None
        if grad_norm is None:
            self.unnormed.add(at)
        else:
            self.had_norm = True
            self.unnormed.discard(at)
        row = torch.stack([loss_t if loss_t is not None else self.zero, grad_norm if grad_norm is not None else self.zero])
        self.interval[at].copy_(row)
        return row

    def clear(self) -> None:
        """No step in the report interval (a restored run starts one afresh)."""
        self.interval.zero_()
        self._restart()

    def _restart(self) -> None:
        self.had_loss = self.had_norm = False
        self.unnormed.clear()
        self.recorded = 0

    def _not_normed(self) -> list[int]:
        """The interval's rows that hold no gradient norm of its steps: those of steps without one,
        and those no step of the interval wrote."""
        rows = self.interval.shape[0]
        if self.recorded >= rows:
            return sorted(self.unnormed)
        written = {(self.first_row + i) % rows for i in range(self.recorded)}
        return sorted(self.unnormed | (set(range(rows)) - written))

    def nonfinite(self, nan_where_bad: torch.Tensor | None = None) -> torch.Tensor:
        """Non-finite steps among the report interval's rows (device scalar; unused rows are 0).
        ``nan_where_bad``: ``interval * 0``, if made already (NaN exactly where a value is NaN or
        +-Inf, else 0): a row's sum is NaN, which ``count_nonzero`` counts, exactly when it holds
        a non-finite value."""
        if nan_where_bad is None:
            nan_where_bad = self.interval * 0
        return torch.count_nonzero(nan_where_bad.sum(dim=1))

    def values(self, dev: dict[str, torch.Tensor], loss_t: torch.Tensor | None, grad_norm: torch.Tensor | None,
               derived: HostDerived) -> None:
        """The interval's report values into ``dev`` (and what the host makes of them into
        ``derived``), then the rows zeroed for the next one. ``loss_t``: the last loss a step had;
        the report has no ``trainguard_loss`` when no step of the interval had one."""
        rows = self.interval
        if not self.had_loss:
            loss_t = torch.full_like(self.zero, math.nan)  # the rank row's filler; left out of the report
            derived.job(_no_loss)
        nan_where_bad = rows * 0  # x * 0 is NaN exactly where x is NaN or +-Inf, else 0
        losses, norms = rows.unbind(1)
        self.nonfinite_steps += self.nonfinite(nan_where_bad)
        # A non-finite loss anywhere in the interval is the interval's loss: the first one (argmin
        # finds the first NaN of the loss column; take: indexing with a device tensor could read it
        # on the host); the column sums to 0 exactly when every loss is finite.
        bad_loss = nan_where_bad.select(1, 0)
        first_bad = losses.take(bad_loss.argmin())
        dev["trainguard_loss"] = torch.where(bad_loss.sum() == 0, loss_t, first_bad)
        # the counter itself: it changes next at the next report, after this report's copy
        # (device order), so no snapshot of it is needed
        dev["trainguard_nonfinite_steps_total"] = self.nonfinite_steps
        if grad_norm is not None:
            dev["trainguard_grad_norm"] = grad_norm
        if self.had_norm:  # (a step without a gradient has no norm: a 0 in its row, not a value)
            # The largest finite one; -inf (norms are never negative) when none was, which the host
            # makes NaN: not a 0 that reads as a vanished gradient.
            if self.unnormed or self.recorded < rows.shape[0]:  # (a host list to the device: rare)
                norms = norms.index_fill(0, torch.tensor(self._not_normed(), device=norms.device), -math.inf)
            dev["trainguard_grad_norm_max"] = norms.nan_to_num(-math.inf, -math.inf, -math.inf).amax()
            derived.job(_no_finite_norm)
        rows.zero_()  # after its last reader above (device order)
        self._restart()
