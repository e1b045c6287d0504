"""What the step meter's hooks (``trainer_agent/measure/step_stats.py``) learn during one optimizer
step: device values the report pipeline (``trainer_agent/report/pipeline.py``) reads at ``end_step``."""

from __future__ import annotations

import numpy as np
import torch

from trainer_agent.measure.layer_stats import GradMoments

__all__ = ["StepState", "unscale"]


class StepState:
    """What the hooks learn during one optimizer step; replaced by ``end_step``."""

    __slots__ = ("backwards", "micro_norms", "grad_norms", "grad_norm", "grad_share", "grad_nonfinite", "scale",
                 "stepped", "snapshot_taken", "before_sq", "delta_sq", "param_sq", "lrs", "grad_fp", "grad_stats",
                 "micro_missed", "ungraded")

    def __init__(self) -> None:
        self.backwards = 0
        #: Per backward pass: ||incoming gradient|| over all parameters (float64 device scalar,
        #: times the loss scale).
        self.micro_norms: list[torch.Tensor] = []
        #: A backward pass after the first ran without the per-parameter hooks (accumulation that
        #: started on a report step after steps of one pass each): ``micro_norms`` stays empty.
        self.micro_missed = False
        #: Per-parameter ||accumulated grad|| at the end of the last backward (device vector in the
        #: agent's parameter order, times the loss scale; 0 without a gradient).
        self.grad_norms: torch.Tensor | None = None
        #: The step's global pre-clip gradient norm, unscaled (float64 device scalar). With sharded
        #: parameters (``ParamIndex.sharding``): the norm of this rank's local shards only (finite
        #: exactly when they are); the global norm is formed at the report.
        self.grad_norm: torch.Tensor | None = None
        #: The value the report interval's row carries for this step: ``grad_norm`` without
        #: sharding; with sharding, this rank's share of the global squared norm (unscaled), which
        #: the report sums over the ranks.
        self.grad_share: torch.Tensor | None = None
        self.grad_nonfinite: torch.Tensor | None = None
        #: Loss scale at the last backward (device scalar) or None without an enabled scaler.
        self.scale: torch.Tensor | None = None
        self.stepped = False
        self.snapshot_taken = False
        self.before_sq: torch.Tensor | None = None
        self.delta_sq: torch.Tensor | None = None
        self.param_sq: torch.Tensor | None = None
        #: LR per param group as used by the step (float, or a device tensor for tensor LRs).
        self.lrs: list[float | torch.Tensor] | None = None
        #: Report steps with a fingerprinter: (layers, K + 1) projections and norms of the
        #: gradients the optimizer used (``trainer_agent/measure/fingerprint.py``).
        self.grad_fp: torch.Tensor | None = None
        #: Report steps: the moments of the gradients the optimizer used (``LayerGradStats.measure``).
        self.grad_stats: GradMoments | None = None
        #: Report steps: the parameters the optimizer found without a gradient
        #: (``ParamIndex.ungraded``; None: every one had one).
        self.ungraded: np.ndarray | None = None


def unscale(value: torch.Tensor, scale: torch.Tensor | None, power: int = 1) -> torch.Tensor:
    return value if scale is None else value / scale**power
