"""An ordinary step's gradient norm under FSDP2 from its flat gradient buffers, for the step meter
(``trainer_agent/measure/step_stats.py``), as ``bucket_views.py`` takes it from DDP's buckets.

FSDP2 (``fully_shard``) reduce-scatters the gradients of each of its parameter groups (one per
``fully_shard`` call) into one flat buffer per rank, and makes every sharded ``.grad``'s local
tensor a view of it (``torch.as_strided`` at the parameter's offset, in
``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``'s ``foreach_reduce``). Between the
views lies each shard's padding (a shard is padded to the largest rank's size), which the
reduce-scatter's input was padded with zeros for. So the sum of squares of this rank's
gradients is that of a few flat buffers, one per group, whatever the number of tensors in them:
per step a fused norm over the buffers instead of one per tensor (on the CPU a loop over the
tensors inside ``torch._foreach_norm``; on CUDA a launch per ~110 tensors) and a ``torch.stack``
of their results. The result is the same sum of squares in another order (about 1e-7 relative),
and, like the per-tensor path, this rank's share of the global value (summed over the ranks at a
report, ``trainer_agent/report/shard_sums.py``).

It is taken only where the buffers hold exactly the gradients, so that it is never another value:

- every measured parameter is a DTensor and this rank's share of every one is the same
  (``Sharding.share``: FSDP2 on a 1-D mesh, HSDP; not a tensor-parallel plan, whose replicated
  parameters are counted on one rank only);
- on a report step, which reads every gradient anyway (the first, and any after a step that could
  not use the buffers), :meth:`FsdpGradBuffers.find` found every gradient's local tensor a dense
  view of a 1-D buffer of its dtype, the views of a buffer not overlapping, every element of a
  buffer outside them 0 (the padding), and no parameter outside a buffer (a CPU-offloaded
  gradient is a copy: never found);
- on the step measured, each buffer's first and last gradient are views of one tensor of the
  size found, at the offsets found. FSDP2 allocates a new buffer per group and step; a
  parameter unused in a step is left out of its group's buffer (a shorter buffer: not taken),
  and gradients accumulated over micro-batches stay views of the first micro-batch's buffer.

Otherwise :meth:`FsdpGradBuffers.norm` returns None and the meter takes the per-tensor norms.
Report steps always take the per-tensor norms: their per-layer statistics need them. Between
report steps the padding is trusted to stay 0: FSDP2 writes only the views (the reduce-scatter's
output, the division by the world size, accumulation and clipping are element-wise on them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from trainer_agent.compat import torch_private
from trainer_agent.measure import stats
from trainer_agent.measure.bucket_views import as_rows, rows_norm, views_by_base
from trainer_agent.measure.sharding import is_dtensor, local

if TYPE_CHECKING:
    from trainer_agent.measure.params import ParamIndex

__all__ = ["FsdpGradBuffers", "for_index"]


def for_index(index: ParamIndex) -> FsdpGradBuffers | None:
    """The :class:`FsdpGradBuffers` for ``index``'s parameters when every one is a DTensor and this
    rank's share of each is the same (see the module); else None."""
    sharding = index.sharding
    if sharding is None or index.sparse or not all(is_dtensor(p) for p in index.params):
        return None
    shares = set(sharding.share.tolist())  # once, at attach
    if len(shares) != 1:
        return None
    return FsdpGradBuffers(index.params, shares.pop())


@dataclass(frozen=True, slots=True)
class _Buffer:
    """One flat gradient buffer as found: its size, and its first and last view (the parameter's
    index and the view's offset in the buffer)."""

    numel: int
    first: int
    first_offset: int
    last: int
    last_offset: int


class FsdpGradBuffers:
    """FSDP2's flat gradient buffers of ``params`` (DTensors whose local gradients are views of
    them), once :meth:`find` has found them; ``share``: this rank's weight of its sums."""

    #: On the CPU, norm the buffers per row (``bucket_views.as_rows``); False: the accelerator's
    #: fused norm per buffer (tests run it on the CPU).
    cpu_rows = True

    def __init__(self, params: Sequence[torch.Tensor], share: float) -> None:
        self.params = list(params)
        self.share = share
        #: The buffers' layouts, None until found.
        self.groups: list[_Buffer] | None = None
        #: Ordinary steps normed from the buffers (for tests and benchmarks).
        self.used = 0
        #: Whether a step since the last :meth:`find` could not take the norm from the buffers.
        self._missed = False

    def wants_find(self) -> bool:
        """Whether a report step should look for the buffers: until found, and again after an
        ordinary step whose gradients did not lie as found (a parameter unused that step, or
        the layout changed)."""
        return self.groups is None or self._missed

    def find(self, grads: Sequence[torch.Tensor | None]) -> bool:
        """Look for the buffers in ``grads`` (``params``' current gradients, DTensors, in order);
        True when they hold exactly the gradients (see the module). One read of the padding."""
        self.groups, self._missed = None, False
        if not all(is_dtensor(g) for g in grads):
            return False
        placed_by_base = views_by_base([local(g) for g in grads])
        if placed_by_base is None:
            return False
        padding: list[torch.Tensor] = []
        found = []
        for base, placed in placed_by_base:
            end = 0
            for offset, numel, _ in placed:
                if offset < end:
                    return False  # an overlap
                if offset > end:
                    padding.append(base[end:offset])
                end = offset + numel
            if end > base.numel():
                return False
            if end < base.numel():
                padding.append(base[end:])
            found.append(_Buffer(base.numel(), placed[0][2], placed[0][0], placed[-1][2], placed[-1][0]))
        if padding and bool(torch.cat(padding).count_nonzero()):  # SYNC: a report step's, at most once
            return False
        self.groups = found
        return True

    def shared(self, norm: torch.Tensor) -> torch.Tensor:
        """This rank's share of the global sum of squares given its ``norm``, as
        ``Sharding.shares`` weighs it: 0 where this rank keeps none, even when ``norm`` is NaN."""
        return self.share * norm.square() if self.share else torch.zeros_like(norm)

    def norm(self, device: torch.device, *, wide: bool) -> torch.Tensor | None:
        """This rank's norm of its local gradients from the buffers (float64 device scalar, as the
        per-tensor norms would combine it), or None where it does not apply (see the module)."""
        if self.groups is None:
            return None
        buffers = []
        for found in self.groups:
            first, last = self.params[found.first].grad, self.params[found.last].grad
            if first is None or last is None:
                self._missed = True
                return None
            head, tail = local(first), local(last)
            base = torch_private.view_base(head)
            if (base is None or torch_private.view_base(tail) is not base or base.numel() != found.numel
                    or not base.is_contiguous()
                    or head.storage_offset() - base.storage_offset() != found.first_offset
                    or tail.storage_offset() - base.storage_offset() != found.last_offset):
                self._missed = True
                return None
            buffers.append(base)
        self.used += 1
        if device.type != "cpu" or not self.cpu_rows:
            kinds = [[buffers[i] for i in kind] for kind in stats.buckets(buffers)]
            return torch.linalg.vector_norm(stats.bucket_norms(kinds, device, wide=wide), dtype=torch.float64)
        return rows_norm(map(as_rows, buffers), wide=wide)
