"""The CPU's non-finite count (``stats.nonfinite_count``'s scan of suspects): which tensors may hold
a NaN or an infinity, and how many such elements one holds, each with the fewest bytes moved.

**Suspects.** A tensor with a NaN or an infinity has a sum of squares that is not finite (NaN stays
NaN, an infinity's square is infinite, and a sum with an infinite term is infinite or NaN, never
finite); a finite tensor's sum of squares can also overflow, which only sends that tensor to the
exact count (it then finds 0). Where nobody measured the tensors' norms (the optimizer's state on
a report step: 55 M float32 elements for AdamW on the 27 M-parameter model of
``bench/agent_overhead.py``), the sum of squares of a large contiguous float32 or float64 tensor
is one ``torch.dot`` of it with itself (:func:`dot_sq_norms`), the BLAS's, read at the memory's
bandwidth: 16.1 ms for AdamW's two moments on that model just after its step, where the fused
float32 norm took 17.9 ms and a sum 17.5 ms (a maximum, ``aminmax`` and ``isfinite().all()``
more; one thread, thread CPU time, medians of 14). The dot squares and adds in the tensor's own
dtype as the float32 norm did, so its sum of squares overflows where the norm's did (float32:
from about 1.8e19 per element) and the same tensors go to the count. Small tensors (AdamW's
``step`` counters), other dtypes (float16 and bfloat16 state, whose norm accumulates in float32)
and strided ones keep the fused norm.

**The count** (:func:`nonfinite_elements`). ``t * 0`` is NaN exactly where ``t`` is not finite
(and a zero elsewhere), and ``count_nonzero`` counts those NaNs; chunk by chunk through a buffer
that stays in cache. ``(~torch.isfinite(t)).sum()`` took about 9.7 ms per million float32
elements (two passes writing temporaries of the tensor's size, fresh pages each time): a run
whose optimizer state had turned NaN paid 350 ms per report for it on that model.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from itertools import compress

import torch

__all__ = ["COUNT_CHUNK", "DOT_MIN_ELEMENTS", "dot_sq_norms", "nonfinite_elements"]

#: Elements from which a tensor is read by a dot of its own; smaller ones share one fused norm.
DOT_MIN_ELEMENTS = 1 << 12

#: Elements per step of :func:`nonfinite_elements` (its buffer stays in a core's L2 cache).
COUNT_CHUNK = 1 << 16

_DOT_DTYPES = (torch.float32, torch.float64)
_NUMEL = torch.Tensor.numel


def dot_sq_norms(tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor | None, list[torch.Tensor]]:
    """``(dotted, sq, rest)``: the large contiguous float32 and float64 CPU ``tensors``, their sums
    of squares (one ``torch.dot`` each, in their own dtype) as a float64 vector (None when there is
    no such tensor), and the other tensors. Host work per tensor: its size read in C, a comparison
    (a model of small tensors only takes none of this path)."""
    sizes = list(map(_NUMEL, tensors))
    if not sizes or max(sizes) < DOT_MIN_ELEMENTS:
        return [], None, list(tensors)
    large = [n >= DOT_MIN_ELEMENTS for n in sizes]
    dotted, rest = [], list(compress(tensors, map(operator.not_, large)))
    for t in compress(tensors, large):
        (dotted if t.is_cpu and t.dtype in _DOT_DTYPES and t.is_contiguous() else rest).append(t)
    if not dotted:
        return dotted, None, rest
    sq = [torch.dot(flat, flat) for flat in (t.view(-1) for t in dotted)]
    return dotted, torch.stack(sq).to(torch.float64), rest  # (stack promotes float32 beside float64)


@torch.no_grad()
def nonfinite_elements(t: torch.Tensor) -> int:
    """The number of NaN and infinite elements of the floating-point CPU tensor ``t``."""
    flat = t.detach().reshape(-1)  # (a copy only for a strided tensor)
    n = flat.numel()
    buffer = torch.empty(min(n, COUNT_CHUNK), dtype=flat.dtype)
    total = 0
    for start in range(0, n, COUNT_CHUNK):
        part = flat[start:start + COUNT_CHUNK]
        zeros_or_nan = buffer[:part.numel()]
        torch.mul(part, 0, out=zeros_or_nan)
        total += int(torch.count_nonzero(zeros_or_nan))
    return total
