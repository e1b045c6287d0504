"""The snapshots a run holds, as the controller tracks them: the steps the agent keeps (spaced out
by ``trainguard/protocol/retention.py`` as the agent spaces them), each *good* after
``snapshot_confirm_reports`` healthy reports and tainted for good by an unhealthy one before then."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from trainguard.protocol.retention import retained


def snapshot_policy(config: dict[str, Any]) -> tuple[int | None, int]:
    """(every, keep) of a run's snapshots, from its registration config (the agent sends its
    own; ``every`` None when it is not known)."""
    every, keep = config.get("snapshot_every"), config.get("snapshot_keep")
    return (every if type(every) is int and 1 <= every <= 1 << 40 else None,
            keep if type(keep) is int and 1 <= keep <= 1024 else 3)


@dataclass(slots=True)
class Snap:
    step: int
    healthy_after: int = 0
    tainted: bool = False

    def good(self, confirm: int) -> bool:
        return not self.tainted and self.healthy_after >= confirm


class Snapshots:
    """The snapshots of one run, oldest first."""

    def __init__(self, every: int | None = None, keep: int = 3) -> None:
        self.every = every
        self.keep = max(int(keep), 1)
        self.held: deque[Snap] = deque()

    def track(self, values: dict[str, float], healthy: bool, confirm: int) -> None:
        """Count one report for the snapshots not yet confirmed, and take the one it carries."""
        for snap in self.held:
            if not snap.good(confirm):
                if healthy:
                    snap.healthy_after += 1
                else:
                    snap.tainted = True
        v = values.get("trainguard_snapshot_step")
        if v is None or not math.isfinite(v):
            return
        newest = int(v)
        self.drop_after(newest)
        if not self.held or self.held[-1].step < newest:
            self.held.append(Snap(newest))
            if self.every is not None:
                keep = set(retained((s.step for s in self.held), every=self.every, keep=self.keep))
                self.held = deque(s for s in self.held if s.step in keep)
            while len(self.held) > self.keep:
                self.held.popleft()

    def drop_after(self, step: int) -> None:
        while self.held and self.held[-1].step > step:
            self.held.pop()

    def any_good(self, confirm: int) -> bool:
        return any(s.good(confirm) for s in self.held)

    def rollback_target(self, confirm: int) -> tuple[int | None, str]:
        """The newest good snapshot's step and why (None: none, and the reason)."""
        for snap in reversed(self.held):
            if snap.good(confirm):
                return snap.step, f"snapshot of step {snap.step}"
        if not self.held:
            return None, "the run reports no snapshot (AgentConfig.snapshot_every is not set, or none taken yet)"
        return None, (f"no snapshot was followed by {confirm} healthy reports: the anomaly may predate every "
                      f"snapshot held (steps {', '.join(str(s.step) for s in self.held)})")

    def save(self) -> list[tuple[Snap, int, bool]]:
        return [(snap, snap.healthy_after, snap.tainted) for snap in self.held]

    def restore(self, saved: list[tuple[Snap, int, bool]]) -> None:
        for snap, healthy_after, tainted in saved:
            snap.healthy_after, snap.tainted = healthy_after, tainted
        self.held = deque(snap for snap, _, _ in saved)
