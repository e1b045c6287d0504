"""Param-group values set for one optimizer step and restored after it: the controller's LR scale
and the optimizer actuators' overrides (momentum, weight decay)."""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

__all__ = ["GroupOverride", "LrScale"]

log = logging.getLogger("trainer_agent.control.plane")


class GroupOverride:
    """Sets a key of each param group for one optimizer step, restored after it: between the
    optimizer's pre- and post-hook the groups hold the commanded values, otherwise the run's own
    (its scheduler, its checkpoints see only those)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer
        self._saved: list[tuple[dict, str, Any]] | None = None

    def override(self, key_of: Callable[[dict], str | None], value: Callable[[Any], Any]) -> None:
        """Each group's ``key_of(group)`` (None: leave the group) becomes ``value(own)``."""
        if self._saved is not None:  # the last post-hook did not run (the step raised)
            self.restore()
        saved: list[tuple[dict, str, Any]] = []
        for g in self._optimizer.param_groups:
            key = key_of(g)
            if key is not None and key in g:
                saved.append((g, key, g[key]))
                g[key] = value(g[key])
        self._saved = saved

    def restore(self) -> None:
        """The groups' own values (objects: floats or tensors) as they were."""
        saved, self._saved = self._saved, None
        for g, key, own in saved or ():
            g[key] = own


class LrScale(GroupOverride):
    """Multiplies every param group's LR by ``scale`` between the optimizer's pre- and post-hook; a
    group whose LR is None (Hugging Face's Adafactor, ``relative_step=True``) is left, warned once."""

    _warned = False

    def before_step(self, scale: float) -> None:
        """Optimizer pre-hook: each group's LR becomes scheduler LR x ``scale`` for this step."""
        if self._saved is not None:
            self.restore()
        if scale != 1.0:
            self.override(self._scaled_key, lambda lr: lr * scale)

    def _scaled_key(self, group: dict) -> str | None:
        if group.get("lr") is None and not self._warned:
            self._warned = True
            log.warning("trainguard: an LR command cannot act on a param group whose LR is None (Hugging Face's "
                        "Adafactor with relative_step=True sizes its own steps); give it an LR to let them act")
        return None if group.get("lr") is None else "lr"

    def after_step(self) -> None:
        """Optimizer post-hook: restore the scheduler's LR objects (floats or tensors) as they were."""
        self.restore()
