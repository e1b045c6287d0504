"""What the controller client (``trainer_agent/report/client.py``) holds to send: the bounded buffers of
reports and acks, and the counts of what was sent, refused and dropped (exported by the agent as
``trainguard_agent_reports_dropped_total`` and the like)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from trainguard.protocol.wire import Ack, Report

__all__ = ["Outbox", "SendCounts"]


@dataclass
class SendCounts:
    """What the sender did (exported by the agent's ``/metrics``)."""

    reports_dropped: int = 0
    """Reports dropped, oldest first, because the buffer was full."""
    reports_sent: int = 0
    """Reports the controller accepted."""
    acks_sent: int = 0
    """Acks the controller accepted."""
    refused: int = 0
    """Reports and acks the controller refused with a 4xx (dropped: resending cannot help)."""
    reports_too_large: int = 0
    """Of those, reports refused as too large (413)."""
    commands_refused: int = 0
    """Desired states refused for a field outside the protocol's bounds."""
    finished: bool = False
    """True once the controller accepted the finish sent by :meth:`ControllerClient.close`."""


class Outbox:
    """The reports and acks waiting to be sent, bounded (callers hold the client's lock)."""

    def __init__(self, max_reports: int, counts: SendCounts) -> None:
        self.reports: deque[Report] = deque()
        self.max_reports = max_reports
        self.acks: deque[Ack] = deque(maxlen=64)
        self._counts = counts

    def __bool__(self) -> bool:
        return bool(self.acks or self.reports)

    def add_report(self, report: Report) -> None:
        if len(self.reports) >= self.max_reports:
            self.reports.popleft()
            self._counts.reports_dropped += 1
        self.reports.append(report)

    def take(self) -> tuple[str, Report | Ack]:
        """The next item to send: acks first."""
        return ("ack", self.acks.popleft()) if self.acks else ("report", self.reports.popleft())

    def requeue(self, op: str, item: Report | Ack) -> None:
        """Put a failed item back at the head of its buffer, or count it dropped when newer
        ones filled the buffer meanwhile (it is the oldest)."""
        if op == "ack":
            if len(self.acks) < (self.acks.maxlen or 0):
                self.acks.appendleft(item)  # type: ignore[arg-type]
        elif len(self.reports) < self.max_reports:
            self.reports.appendleft(item)  # type: ignore[arg-type]
        else:
            self._counts.reports_dropped += 1
