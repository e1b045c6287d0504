"""The report step's sum of the ranks' shares under sharded parameters (FSDP2, HSDP, tensor
parallel; ``trainer_agent/measure/sharding.py``), for the report pipeline (``trainer_agent/report/pipeline.py``).

Each rank holds only its shares of the per-parameter sums. The report step adds them up over the
ranks in one ``all_reduce`` of one float64 vector (the interval's per-step squared gradient norms,
the per-parameter squared gradient, weight, update and W_before norms, the non-finite counts),
before anything is derived from them: every metric is then the global one, equal on every rank.
"""

from __future__ import annotations

import math

import torch

from trainer_agent.measure import stats
from trainer_agent.measure.params import ParamIndex
from trainer_agent.measure.sharding import local
from trainer_agent.measure.step_state import StepState, unscale

__all__ = ["ShardSums"]


class ShardSums:
    """The sums over the ranks of one report pipeline: ``interval`` is its (steps, 2) device rows
    (loss, gradient share), whose gradient column the sum replaces; ``zero`` a device 0."""

    def __init__(self, index: ParamIndex, optimizer: torch.optim.Optimizer, interval: torch.Tensor,
                 zero: torch.Tensor) -> None:
        self.index, self.optimizer, self.interval, self.zero = index, optimizer, interval, zero
        self.device = index.device
        self.summed_step = -1  # the step whose shares entered the sum last
        self.state_nonfinite: torch.Tensor | None = None
        """The optimizer state's non-finite count summed over the ranks (after :meth:`sum`)."""

    def width(self) -> int:
        return self.interval.shape[0] + 4 * len(self.index.params) + 4

    def sum(self, step: int, st: StepState) -> None:
        """Sharded parameters: replace this rank's shares in ``st`` and in the interval's gradient
        column by their sums over the ranks (one ``all_reduce``; see the module docstring). If
        building the vector fails, the collective is still entered (with NaN) and the error
        raised afterwards, so no other rank waits alone."""
        sharding = self.index.sharding
        assert sharding is not None
        n = len(self.index.params)
        error: Exception | None = None
        try:
            vector = self._shares(st, n)
        except Exception as exc:  # noqa: BLE001 - re-raised after the collective
            error = exc
            vector = torch.full((self.width(),), math.nan, dtype=torch.float64, device=self.device)
        self.summed_step = step  # entered (even if it fails): never entered twice per step
        total = sharding.sum_over_ranks(vector)
        if error is not None:
            raise error
        r = self.interval.shape[0]
        grad_sq, param_sq, delta_sq, before_sq = total[r:r + 4 * n].view(4, n).unbind(0)
        grad_nonfinite, state_nonfinite, have_grads, have_update = total[r + 4 * n:].unbind(0)
        world = sharding.world_size
        self.interval[:, 1] = total[:r].sqrt()
        self.state_nonfinite = state_nonfinite
        st.param_sq = param_sq
        if st.grad_norms is not None:
            # The meter's flags agree on every rank (same schedule, same steps taken): a rank
            # that lacks a value lacks it everywhere; have_* only guards the derivation.
            st.grad_norms = torch.where(have_grads == world, grad_sq, math.nan).sqrt()
            st.grad_norm = unscale(st.grad_norms.square().sum().sqrt(), st.scale)
            st.grad_nonfinite = grad_nonfinite
        if st.delta_sq is not None and st.before_sq is not None:
            st.delta_sq = torch.where(have_update == world, delta_sq, math.nan)
            st.before_sq = before_sq

    def _shares(self, st: StepState, n: int) -> torch.Tensor:
        sharding = self.index.sharding
        assert sharding is not None
        zeros = torch.zeros(n, dtype=torch.float64, device=self.device)
        param_sq = st.param_sq if st.param_sq is not None else self.index.sq_norms()
        have_update = st.delta_sq is not None and st.before_sq is not None
        columns = [
            st.grad_norms.to(torch.float64).square() if st.grad_norms is not None else zeros,
            param_sq,
            st.delta_sq if have_update else zeros,
            st.before_sq if have_update else zeros,
        ]
        kept = sharding.kept
        params = self.index.params
        state_tensors = [local(t) for i in kept for t in self.optimizer.state.get(params[i], {}).values()
                         if isinstance(t, torch.Tensor)]
        scalars = torch.stack([
            st.grad_nonfinite if st.grad_nonfinite is not None else self.zero,
            stats.nonfinite_count(state_tensors, self.device).to(torch.float64),
            self.zero + (st.grad_norms is not None),
            self.zero + have_update,
        ])
        scalars[:2] *= sharding.count_share
        return torch.cat([self.interval[:, 1], sharding.shares(torch.stack(columns)).reshape(-1), scalars])

    def enter_nan(self, step: int) -> None:
        """After an error before this step's sum: enter it with NaN, so no other rank waits alone."""
        if self.index.sharding is not None and self.summed_step != step:
            self.summed_step = step
            self.index.sharding.sum_over_ranks(
                torch.full((self.width(),), math.nan, dtype=torch.float64, device=self.device))
