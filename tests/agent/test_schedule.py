"""ReportSchedule: the one place that decides report and agreement steps."""

from __future__ import annotations

from trainer_agent.schedule import ReportSchedule


def test_report_steps_are_the_multiples_of_report_every() -> None:
    s = ReportSchedule(report_every=4, sync_every=3)
    assert [k for k in range(1, 13) if s.is_report(k)] == [4, 8, 12]


def test_agreement_steps_are_report_steps_and_multiples_of_sync_every() -> None:
    s = ReportSchedule(report_every=4, sync_every=3)
    assert [k for k in range(1, 13) if s.agrees(k)] == [3, 4, 6, 8, 9, 12]
    assert all(ReportSchedule(report_every=1).is_report(k) for k in range(1, 5))
