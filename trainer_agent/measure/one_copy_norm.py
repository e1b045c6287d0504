"""An ordinary step's gradient norm over many small gradients from one copy of them, with no host
work per tensor beyond reading its ``.grad``.

An ordinary step needs only the norm of all gradients together (the spike guard, the interval's
largest norm). On an accelerator a fused per-tensor norm launches a kernel per ~110 tensors; for
a bucket (one device and dtype) of at least :data:`~trainer_agent.measure.staged.STAGED_MIN_TENSORS`
gradients that fits one stage (:data:`~trainer_agent.measure.staged.STAGE_ELEMENTS` elements) one
copy of the bucket (``torch_private.flat_cat``: ``torch._chunk_cat``, one CUDA kernel) and one
float64-accumulated norm of it are two launches whatever the tensor count.

Everything that does not change between steps is settled once, at attach, from the parameters:
a gradient has its parameter's shape, dtype and device (autograd refuses any other), so whether
the buckets qualify, where each bucket lies in the parameter list and which gradients are 0-dim
(``_chunk_cat`` takes tensors of one dimension or more) are known before the first step. Per step
the host work is the index's one read of every ``.grad`` (``ParamIndex.flat_grads``: ``map`` of an
``attrgetter``, no bytecode per tensor) and one ``_chunk_cat`` call per bucket, whose CUDA launch walks the list in C++; nothing
builds a key of shapes or tests each tensor's layout. The order in which a dense gradient's
elements are copied (CUDA copies a dense tensor in memory order, any other through ATen's general
path in logical order) does not change its sum of squares. A missing gradient (``None``: a
parameter unused this step) makes ``_chunk_cat`` raise ``TypeError`` before it copies anything;
that bucket is then copied with a one-element zero in its place (norm 0), so the common step
tests nothing per tensor.

Empty parameters are left out of the copy (``_chunk_cat`` refuses them; they add nothing), each
bucket's norm is moved to the index's device before they are joined (buckets on several devices),
and a model cast to another dtype since attach is normed by the fused passes. Should a copy fail
otherwise (a sparse gradient set by hand, a build without the operator), the staged passes are
turned off for the process (``staged.attempt``) and the caller takes the fused per-tensor norms,
the same values.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trainer_agent.compat import torch_private
from trainer_agent.measure import staged

__all__ = ["OneCopyNorm"]

class OneCopyNorm:
    """The gradients of the parameters of ``buckets`` (plain tensors; their gradients come in one
    list, bucket after bucket), normed from one copy per bucket. Build with :meth:`for_buckets`."""

    def __init__(self, buckets: Sequence[Sequence[torch.Tensor]]) -> None:
        self.bounds: list[tuple[int, int]] = []
        start = 0
        for bucket in buckets:
            self.bounds.append((start, start + len(bucket)))
            start += len(bucket)
        #: Per bucket, the places of its 0-dim parameters (their gradients are copied as 1-element views).
        self.scalars = [[i for i, t in enumerate(bucket) if t.dim() == 0] for bucket in buckets]
        #: Per bucket, the places of its non-empty parameters where it has empty ones (``_chunk_cat``
        #: refuses an empty tensor; an empty gradient adds nothing to the norm), else None.
        self.kept = [[i for i, t in enumerate(bucket) if t.numel()] if any(not t.numel() for t in bucket) else None
                     for bucket in buckets]
        self.zeros = [torch.zeros(1, dtype=b[0].dtype, device=b[0].device) for b in buckets]
        #: Ordinary steps whose norm came from the copies.
        self.used = 0

    @classmethod
    def for_buckets(cls, buckets: Sequence[Sequence[torch.Tensor]]) -> OneCopyNorm | None:
        """The norm for these parameters when every bucket holds enough plain floating-point dense
        tensors for the staged passes and fits one stage (``staged.fits_one_stage``), else None: a
        larger model's ordinary steps keep the fused norm, which then costs no more than reading."""
        if not staged.fits_one_stage(buckets):
            return None
        if not all(type(t) in staged.PLAIN and t.is_floating_point() and t.layout == torch.strided
                   for bucket in buckets for t in bucket):
            return None
        return cls(buckets)

    def norm(self, grads: list[torch.Tensor | None], device: torch.device) -> torch.Tensor | None:
        """The L2 norm of ``grads`` (the parameters' current ``.grad``, in the buckets' order; a
        float64 scalar on ``device``), or None where the staged passes do not run here (the CPU
        without ``staged.ON_CPU``) or have failed."""
        if staged.FAILED is not None or (device.type == "cpu" and not staged.ON_CPU):
            return None
        for (start, _), zero in zip(self.bounds, self.zeros):
            first = grads[start]
            if first is not None and first.dtype != zero.dtype:
                return None  # the model was cast since attach (``model.half()``): the fused norms this time
        norms = staged.attempt(self._norms, grads, device)
        if norms is None:
            return None
        self.used += 1
        return torch.linalg.vector_norm(norms, dtype=torch.float64)

    @torch.no_grad()
    def _norms(self, grads: list[torch.Tensor | None], device: torch.device) -> torch.Tensor:
        """Each bucket's norm (float64, on ``device``)."""
        norms = []
        for (start, end), scalars, kept, zero in zip(self.bounds, self.scalars, self.kept, self.zeros):
            bucket = grads[start:end]
            for i in scalars:
                if bucket[i] is not None:
                    bucket[i] = bucket[i].reshape(1)
            if kept is not None:
                bucket = [bucket[i] for i in kept] or [zero]
            try:
                flat = torch_private.flat_cat(bucket)
            except (TypeError, AttributeError):  # a missing gradient (None): nothing was copied
                flat = torch_private.flat_cat([zero if g is None else g for g in bucket])
            norms.append(torch.linalg.vector_norm(flat, dtype=torch.float64).reshape(1).to(device))
        return norms[0] if len(norms) == 1 else torch.cat(norms)
