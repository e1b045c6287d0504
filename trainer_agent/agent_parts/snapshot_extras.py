"""What the agent's in-memory snapshots hold besides the model and optimizer state
(``trainer_agent/control/snapshots.py``): the LR scheduler's, the GradScaler's and the spike guard's state,
restored with them by a rollback."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["SnapshotExtras"]


class SnapshotExtras:
    """``scaler()``: the GradScaler (None without one), and ``guard()``: the control plane's
    spike guard (None without one); read when used, as a scaler may be found once training runs
    (``AgentHooks.find_scaler``) and the control plane is built after the snapshot store."""

    def __init__(self, lr_scheduler: Any, scaler: Callable[[], Any], guard: Callable[[], Any]) -> None:
        self.lr_scheduler, self.scaler, self.guard = lr_scheduler, scaler, guard

    def state(self) -> dict[str, Any]:
        guard, scaler = self.guard(), self.scaler()
        return {
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "scaler": scaler.state_dict() if scaler is not None else None,
            "spike_guard": guard.state_dict() if guard is not None else None,
        }

    def load(self, extra: dict[str, Any]) -> None:
        if self.lr_scheduler is not None and extra["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        scaler = self.scaler()
        if scaler is not None and extra["scaler"] is not None:
            scaler.load_state_dict(extra["scaler"])
        guard = self.guard()
        if guard is not None and extra["spike_guard"] is not None:
            guard.load_state_dict(extra["spike_guard"])
            guard.consecutive = 0  # the restored state is a healthy one
