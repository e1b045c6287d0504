"""An ordinary step's gradient norm from DDP's gradient buckets, when the gradients are views of
them (``DistributedDataParallel(gradient_as_bucket_view=True)``), for the step meter
(``trainer_agent/measure/step_stats.py``).

The per-tensor norm of every ``.grad`` costs something per tensor: on the CPU ``torch._foreach_norm``
is a loop over the tensors (about 1 us each) and the ``torch.stack`` of its results another; on
CUDA it launches once per ~110 tensors, and the stack copies a batch of its 0-dim results per
launch. With DDP's gradient buckets as the gradients' storage, the same norm is a fused norm over
a few flat buckets (DDP's default cap is 25 MiB), whatever the number of tensors in them. The
result is the same sum of squares in another order (float32 accumulation per bucket, on the CPU
per row of a bucket, instead of per tensor, combined in float64; about 1e-7 relative).

It is taken only where the buckets hold exactly the gradients, so that it is never another value:

- the model the agent was given is a ``DistributedDataParallel`` with ``gradient_as_bucket_view``
  (or a framework's DDP wrapper of it: the Lightning callback hands over ``DDPStrategy``'s);
- the backward pass that just ended synchronised (not inside ``no_sync()``): at its end DDP's
  reducer has made every used parameter's ``.grad`` a view of its bucket and zeroed the bucket
  views of the parameters without a gradient, so a bucket holds the all-reduced gradients, 0 for
  a missing one, as the per-tensor norm counts it;
- the buckets were found tiled exactly by the agent's gradients (:meth:`BucketViews.find`, a pass
  over every gradient on a report step, which reads every tensor anyway): each gradient a
  dense view (contiguous or channels-last) of a 1-D bucket, side by side without a gap or an
  overlap, covering it whole — no parameter outside the optimizer (or ignored by DDP) in a
  bucket or outside one;
- each bucket's first gradient is still its view: DDP rebuilds its buckets once, after the first
  step, each into new storage, and the check then fails until the next report step finds the
  new ones.

Otherwise :meth:`BucketViews.norm` returns None and the meter takes the per-tensor norm. Report
steps always take the per-tensor norms: their per-layer statistics need them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from trainer_agent.compat import torch_private
from trainer_agent.measure import stats

if TYPE_CHECKING:
    from trainer_agent.measure.params import ParamIndex

__all__ = ["BucketViews", "ROW", "as_rows", "dense", "for_model", "rows_norm", "views_by_base"]

#: Elements per row of a bucket normed on the CPU (:func:`as_rows`).
ROW = 1 << 14


def as_rows(bucket: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A 1-D bucket as (rows of :data:`ROW` elements, the rest): the CPU's float32 norm of one
    long vector accumulates its rounding (2e-4 relative at 6.5 M elements, 1.4e-3 at 25 M); per
    row of 16,384 elements, combined in float64, it stays near 2e-8, at the same speed. An
    accelerator's fused norm reduces in blocks already."""
    whole = bucket.numel() // ROW * ROW
    return bucket[:whole].view(-1, ROW), bucket[whole:]


def rows_norm(buffers: Iterable[tuple[torch.Tensor, torch.Tensor]], *, wide: bool) -> torch.Tensor:
    """The norm of flat buffers given as :func:`as_rows` splits them: each row's norm (float32
    accumulation, float64 with ``wide`` or a float64 buffer), combined in float64 (a float64 scalar)."""
    parts = []
    for rows, rest in buffers:
        dtype = torch.float64 if wide else stats.norm_dtype(rest.dtype)
        if rows.numel():
            parts.append(torch.linalg.vector_norm(rows, dim=1, dtype=dtype))
        if rest.numel():
            parts.append(torch.linalg.vector_norm(rest, dtype=dtype).reshape(1))
    return torch.linalg.vector_norm(torch.cat(parts).to(torch.float64), dtype=torch.float64)


def dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill ``t.numel()`` consecutive places of its storage: contiguous, or
    channels-last (DDP's bucket views keep the parameter's strides)."""
    return (t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))
            or (t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d)))


def views_by_base(tensors: Sequence[torch.Tensor | None]
                  ) -> list[tuple[torch.Tensor, list[tuple[int, int, int]]]] | None:
    """The flat tensors that ``tensors`` are views of: per such base (a contiguous 1-D tensor of the
    view's dtype), in order of first appearance, the base and its views as (offset in the base,
    numel, index in ``tensors``), by offset. None when any entry is None, no view, or no dense view
    of such a base."""
    views: dict[int, list[tuple[int, int, int]]] = {}
    bases: dict[int, torch.Tensor] = {}
    for i, t in enumerate(tensors):
        base = None if t is None else torch_private.view_base(t)
        if base is None or base.dim() != 1 or not base.is_contiguous() or base.dtype != t.dtype or not dense(t):
            return None
        bases.setdefault(id(base), base)
        views.setdefault(id(base), []).append((t.storage_offset() - base.storage_offset(), t.numel(), i))
    return [(base, sorted(views[key])) for key, base in bases.items()]


def for_model(model: nn.Module, index: ParamIndex) -> BucketViews | None:
    """The :class:`BucketViews` of ``model`` for ``index``'s parameters when ``model`` is a DDP
    model with ``gradient_as_bucket_view`` and no parameter is a DTensor; else None. ``model``
    may be the wrapper of the module the agent was attached to (a framework's DDP strategy)."""
    if not BucketViews.applies(model) or index.sharding is not None:
        return None
    return BucketViews(model, index.params)


class BucketViews:
    """The flat gradient buckets of ``ddp`` (a ``DistributedDataParallel`` with
    ``gradient_as_bucket_view=True``), once :meth:`find` has found them tiled by ``params``' gradients."""

    #: On the CPU, norm the buckets per row (:func:`as_rows`); False: the accelerator's fused
    #: norm per bucket (tests run it on the CPU).
    cpu_rows = True

    def __init__(self, ddp: nn.Module, params: Sequence[torch.Tensor]) -> None:
        self.ddp = ddp
        self.params = list(params)
        #: The buckets, grouped by (device, dtype) for the fused norm; None until found.
        self.groups: list[list[torch.Tensor]] | None = None
        #: Per bucket, the parameter whose gradient is its first view, and the bucket.
        self._firsts: list[tuple[torch.Tensor, torch.Tensor]] = []
        #: The CPU's views of the buckets (:func:`as_rows`).
        self._rows: list[tuple[torch.Tensor, torch.Tensor]] = []
        #: Ordinary steps normed from the buckets (for tests and benchmarks).
        self.used = 0

    @staticmethod
    def applies(model: nn.Module) -> bool:
        """Whether ``model`` is a DDP model whose gradients are views of its buckets."""
        return (isinstance(model, nn.parallel.DistributedDataParallel)
                and bool(getattr(model, "gradient_as_bucket_view", False)))

    def wants_find(self) -> bool:
        """Whether a report step should look for the buckets: until found, after a synchronised
        backward pass (DDP keeps them, rebuilt once, after the first step)."""
        return self.groups is None and self.synced()

    def synced(self) -> bool:
        """Whether the backward pass that just ended all-reduced the gradients (not ``no_sync``)."""
        return bool(getattr(self.ddp, "require_backward_grad_sync", False))

    def find(self, grads: Sequence[torch.Tensor | None]) -> bool:
        """Look for the buckets in ``grads`` (``params``' current gradients, in order, after a
        synchronised backward pass); True when they tile the buckets exactly (see the module)."""
        self.groups, self._firsts = None, []
        found = views_by_base(grads)
        if found is None:
            return False
        for base, placed in found:
            end = 0
            for offset, numel, _ in placed:
                if offset != end:
                    return False  # a gap (another tensor's elements) or an overlap
                end += numel
            if end != base.numel():
                return False
        self._firsts = [(self.params[placed[0][2]], base) for base, placed in found]
        self.groups = [[found[i][0] for i in kind] for kind in stats.buckets([base for base, _ in found])]
        self._rows = [as_rows(base) for group in self.groups for base in group]
        return True

    def norm(self, device: torch.device, *, wide: bool) -> torch.Tensor | None:
        """The global norm of the gradients from the buckets (float64 device scalar, as the
        per-tensor norms would combine it), or None where it does not apply (see the module)."""
        if self.groups is None or not self.synced():
            return None
        for param, base in self._firsts:
            g = param.grad
            if g is None:
                return None  # unused this step: its bucket cannot be told from a rebuilt one
            if torch_private.view_base(g) is not base:
                self.groups, self._firsts = None, []  # rebuilt buckets: found again on a report step
                return None
        self.used += 1
        if device.type != "cpu" or not self.cpu_rows:
            return torch.linalg.vector_norm(stats.bucket_norms(self.groups, device, wide=wide), dtype=torch.float64)
        return rows_norm(self._rows, wide=wide)
