"""Which steps are report steps and which are agreement steps: decided here, and only here.

Every rank must take the same decision at the same step (the collectives of those steps pair up
across ranks), so the decision depends on the step number and the configuration only.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ReportSchedule"]


@dataclass(frozen=True, slots=True)
class ReportSchedule:
    """``report_every`` and ``sync_every`` of :class:`~trainer_agent.config.AgentConfig`."""

    report_every: int
    sync_every: int = 1

    def is_report(self, step: int) -> bool:
        """Step ``step`` (1-based, as counted by ``end_step``) ends with a report: the device
        statistics are copied to the host and, with several ranks, the ranks' rows are gathered
        in the step's one collective (which also carries the controller's desired state)."""
        return step % self.report_every == 0

    def agrees(self, step: int) -> bool:
        """Step ``step`` ends with an agreement of the ranks on the controller's desired state:
        inside the report collective on report steps, a broadcast of the state otherwise."""
        return self.is_report(step) or step % self.sync_every == 0
