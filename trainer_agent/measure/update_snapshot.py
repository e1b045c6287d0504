"""The weights before the optimizer step, for the update size of a measured step (the step
meter's, ``trainer_agent/measure/step_stats.py``): ``||W_after - W_before||``, ``||W_after||`` and
``||W_before||`` per tensor, from one snapshot per tensor kept between steps.

The snapshot is copied in the optimizer's pre-hook of a measured step and compared in its
post-hook (``stats.update_sq_norms``). The CPU's pass of a measured step may leave ``W_after`` in
the snapshot: if no parameter changed since (autograd's version counters, read on the host, count
in-place writes), it already holds the next step's ``W_before`` and needs no copy; likewise
``||W_before||`` is the last measured ``||W_after||`` under the same condition.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from trainer_agent.measure import staged, stats
from trainer_agent.compat import torch_private
from trainer_agent.measure.params import ParamIndex

if TYPE_CHECKING:
    from trainer_agent.measure.step_state import StepState

__all__ = ["UpdateSnapshot"]


class UpdateSnapshot:
    """The snapshot of ``index``'s parameters (made on first use), per bucket like ``index.buckets``."""

    def __init__(self, index: ParamIndex) -> None:
        self.index = index
        self._tensors: list[list[torch.Tensor]] | None = None
        # Per bucket: the snapshot as one flat buffer and its staged layout, or None (made with _tensors).
        self._flats: list[torch.Tensor | None] = []
        self._plans: list[staged.StagePlan | None] = []
        # Version counters when the CPU update pass last copied W_after into the snapshot (None:
        # the snapshot is not the current weights).
        self._versions: tuple[int, ...] | None = None
        self._norm_cache: dict = {}
        self._param_sq_prev: tuple[torch.Tensor, tuple[int, ...]] | None = None

    def take(self, st: StepState) -> None:
        """Pre-hook of a measured step: W_before into the snapshot (unless it holds it already),
        and ``st.before_sq`` when the last measured ``||W_after||`` is still the weights'."""
        # Version counters only where a reading to compare them with is kept (a measured step just before).
        known = self._versions is not None or self._param_sq_prev is not None
        versions = self.index.versions() if known else None
        if self._tensors is None:
            self._allocate()
        if self._versions is None or self._versions != versions:
            for snap, flat, plan, bucket in zip(self._tensors, self._flats, self._plans, self.index.buckets):
                # one copy per stage of elements, whatever the tensor count (else one fused copy)
                if plan is None or staged.FAILED is not None or staged.attempt(_copy_flat, plan, bucket, flat) is None:
                    torch_private.foreach_copy_(snap, bucket)
        self._versions = None  # the post-step hook consumes it
        st.snapshot_taken = True
        if self._param_sq_prev is not None and self._param_sq_prev[1] == versions:
            st.before_sq = self._param_sq_prev[0]

    def _allocate(self) -> None:
        """The snapshot's tensors: per bucket one like each parameter, or, for a bucket the staged
        passes measure (``staged.plan_for``), views of one flat buffer in their layout (copied
        and compared with a fixed number of launches per stage of elements)."""
        self._tensors, self._flats, self._plans = [], [], []
        for bucket in self.index.buckets:
            plan = staged.plan_for(bucket, self.index.device)
            flat = None
            if plan is None:
                snap = [torch.empty_like(p, memory_format=torch.contiguous_format) for p in bucket]
            else:
                flat = torch.empty(plan.elements, dtype=bucket[0].dtype, device=bucket[0].device)
                snap, at = [], 0
                for p in bucket:
                    snap.append(flat[at:at + p.numel()].view(p.shape))
                    at += p.numel()
            self._tensors.append(snap)
            self._flats.append(flat)
            self._plans.append(plan)

    def measure(self, st: StepState, *, refresh: bool) -> None:
        """Post-hook of a measured step: the update's squared norms into ``st``; with ``refresh``
        the snapshot keeps W_after for the next measured step."""
        assert self._tensors is not None
        st.delta_sq, st.param_sq, before_sq, refreshed = stats.update_sq_norms(
            self._tensors, self.index.buckets, self.index.device, self._norm_cache,
            before_norms=st.before_sq is None, refresh=refresh, flat_before=self._flats)
        if st.before_sq is None:
            st.before_sq = before_sq
        # Kept for the next step when it is measured too (else ``forget`` drops them before any use).
        versions = self.index.versions() if refresh else None
        self._param_sq_prev = None if versions is None else (st.param_sq, versions)
        self._versions = versions if refreshed else None

    def forget(self) -> None:
        """A step not measured: the last ``||W_after||`` is no longer known to be current."""
        self._param_sq_prev = None

    def measure_params(self, st: StepState) -> None:
        """A report step without the update measured: ``||W_after||`` alone."""
        st.param_sq = self.index.sq_norms()
        self._param_sq_prev = (st.param_sq, self.index.versions())


@torch.no_grad()
def _copy_flat(plan: staged.StagePlan, bucket: list[torch.Tensor], flat: torch.Tensor) -> torch.Tensor:
    """``bucket`` into ``flat`` (its snapshot in ``plan``'s layout), a copy per stage."""
    for stage in plan.stages:
        torch_private.flat_cat(stage.inputs(bucket), out=flat[stage.begin:stage.begin + stage.size])
    return flat
