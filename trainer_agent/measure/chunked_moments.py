"""The :data:`~trainer_agent.measure.stats.MOMENTS` of CPU tensors, chunk by chunk through two
small buffers that stay in cache (``stats.tensor_moments`` calls it for every CPU tensor when
measuring on the CPU).

On an accelerator the moments are eight fused ``torch._foreach_*`` passes (few launches,
bandwidth to spare). On the CPU those passes are loops over the tensors inside ATen: every pass
pays a fixed cost per tensor (5,000 tensors of 400 elements took 96 ms), and the two float64 L1
norms first convert each whole tensor to float64 (9 passes over the gradients, 534 ms for 36.7 M
float32 elements on the project's 2-core machine).

Here the tensors are laid out once as rows of chunks (``chunk_plan.py``: large tensors cut into
rows, small ones of one dtype and length packed, staged with one ``torch._foreach_copy_``), and
per chunk of up to :data:`MOMENT_CHUNK` elements, whatever the tensors in it, about eight
operators read it while it is in cache:

- copied once into a float64 buffer: per row its sum, its sum of squares, then, made absolute in
  place, its L1 norm -- every sum accumulated in float64;
- its absolute values in the tensor's own dtype, read as integers of the same width, give each
  row's smallest and largest ``|x|`` exactly (non-negative IEEE floats order like their bit
  patterns; an integer ``amin``/``amax`` is several times faster than a float one, which checks
  for NaN). NaN's bits sort above infinity, so the largest is NaN when one is; the smallest is
  then made NaN too, as on the fused passes.

Rows of one tensor are then summed (``index_add_``) and their extremes combined
(``scatter_reduce_``), a handful of operators for all tensors together. Nothing is written to
memory but the buffers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trainer_agent.compat import torch_private
from trainer_agent.measure.chunk_plan import Chunk, ChunkPlan, Pieces, per_tensor_sums

__all__ = ["MOMENT_CHUNK", "BITS", "MomentPlan", "chunked_moments"]

#: Elements per chunk (512 KiB in float64: the buffers stay in a core's L2 cache).
MOMENT_CHUNK = 1 << 16

#: The integer type of each float dtype's width: its absolute values' bits order like the values.
BITS: dict[torch.dtype, torch.dtype] = {torch.float32: torch.int32, torch.float64: torch.int64,
                                        torch.float16: torch.int16, torch.bfloat16: torch.int16}


class _Views:
    """A chunk's views of the two buffers: the staging views (one per row, shaped like its
    source), the float64 copy as the source's shape and as rows, the absolute values as rows of
    integers; and its places in the plan's results (its rows' sums, sums of squares and L1 norms,
    their smallest and largest ``|x|`` bits), written in place."""

    __slots__ = ("staged", "wide", "wide_flat", "absolute", "wide_rows", "bit_rows", "bit_flat", "pad_flat", "top",
                 "sums", "squares", "l1s", "low", "high")

    def __init__(self, c: Chunk, shapes: Sequence[torch.Size], wide: torch.Tensor, stage: torch.Tensor,
                 results: tuple[torch.Tensor, torch.Tensor]) -> None:
        size = c.rows * c.length
        shape = c.shapes(shapes)
        self.staged = c.staging(stage, shapes)
        # Padding: 0 for the sums and the largest |x|, the largest integer for the smallest.
        self.pad_flat = None if c.pad is None else c.pad.reshape(-1)
        self.top = torch.iinfo(BITS[c.dtype]).max
        # One row is read straight from its tensor into the float64 buffer (no staging).
        self.wide = wide[:c.length].view(shape[0]) if c.rows == 1 else wide[:size]
        self.wide_flat = wide[:size]
        self.absolute = stage[:c.length].view(shape[0]) if c.rows == 1 else stage[:size]
        self.wide_rows = wide[:size].view(c.rows, c.length)
        self.bit_flat = stage[:size].view(BITS[c.dtype])
        self.bit_rows = self.bit_flat.view(c.rows, c.length)
        (self.sums, self.squares, self.l1s), (low, high) = results
        # One row: its extremes as 0-dim places, for one ``aminmax`` of the whole row.
        self.low, self.high = (low[0], high[0]) if c.rows == 1 else (low, high)


class MomentPlan(ChunkPlan):
    """A :class:`ChunkPlan` with its buffers: one float64 chunk, one staging chunk per dtype, and
    the rows' results (``sums``: their sums, sums of squares and L1 norms, float64; ``bits``: per
    dtype their smallest and largest ``|x|`` as integers), each chunk's rows at its place."""

    def __init__(self, shapes: Sequence[torch.Size], dtypes: Sequence[torch.dtype], chunk: int) -> None:
        super().__init__(shapes, dtypes, chunk)
        wide = torch.empty(chunk, dtype=torch.float64)
        stages = {d: torch.empty(chunk, dtype=d) for d in self.dtypes}
        self.sums = torch.empty(3, len(self.owner), dtype=torch.float64)
        counts, places = self.rows_by_dtype()
        self.bits = {d: torch.empty(2, counts[d], dtype=BITS[d]) for d in self.dtypes}
        self.views = []
        row = 0
        for c, at in zip(self.chunks, places):
            results = (self.sums[:, row:row + c.rows].unbind(0), self.bits[c.dtype][:, at].unbind(0))
            self.views.append(_Views(c, shapes, wide, stages[c.dtype], results))
            row += c.rows


@torch.no_grad()
def chunked_moments(tensors: Sequence[torch.Tensor], cache: dict | None = None) -> torch.Tensor:
    """The :data:`~trainer_agent.measure.stats.MOMENTS` of non-empty CPU tensors of the dtypes
    of :data:`BITS`, as a (5, len(tensors)) float64 tensor, a column per tensor in order:
    ``||relu(t)||_1``, ``||t||_1``, ``||t||^2``, ``max |t|``, ``-min |t|``. NaN propagates
    into every moment of its tensor. ``cache``: a dict the caller keeps (the plan and its
    buffers)."""
    cache = {} if cache is None else cache
    shapes, dtypes = [t.shape for t in tensors], [t.dtype for t in tensors]
    plan = cache.get("moment_plan")
    if plan is None or not plan.matches(shapes, dtypes, MOMENT_CHUNK):
        plan = cache["moment_plan"] = MomentPlan(shapes, dtypes, MOMENT_CHUNK)
    pieces = Pieces(tensors)
    for c, v in zip(plan.chunks, plan.views):
        if c.rows == 1:
            src = pieces.row(*c.pieces[0])
            v.wide.copy_(src)  # the one read of these elements: float64 from here on, in cache
            torch.abs(src, out=v.absolute)
        else:
            torch_private.foreach_copy_(v.staged, pieces.rows(c))
            if v.pad_flat is not None:
                v.absolute.masked_fill_(v.pad_flat, 0)
            v.wide.copy_(v.absolute)
            v.absolute.abs_()
        w = v.wide_rows
        torch.sum(w, dim=1, out=v.sums)
        if c.rows == 1:
            torch.mv(w, v.wide_flat, out=v.squares)
        else:
            torch.linalg.vector_norm(w, dim=1, out=v.squares).square_()
        w.abs_()
        torch.sum(w, dim=1, out=v.l1s)
        if c.rows == 1:  # (``aminmax`` along a dimension is not vectorized: over the whole row)
            torch.aminmax(v.bit_flat, out=(v.low, v.high))
            continue
        torch.amax(v.bit_rows, dim=1, out=v.high)
        if c.pad is not None:
            v.bit_rows.masked_fill_(c.pad, v.top)
        torch.amin(v.bit_rows, dim=1, out=v.low)
    return _per_tensor(plan, tensors)


def _per_tensor(plan: MomentPlan, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The rows' (sum, sum of squares, L1) and extreme bits combined per tensor, in MOMENTS form
    (a new tensor: the plan's results are written again by its next pass)."""
    extremes = torch.cat([bits.view(dtype).to(torch.float64) for dtype, bits in plan.bits.items()], dim=1)
    low, high = extremes.unbind(0)
    low = torch.where(high.isnan(), high, low)  # the integer minimum passes over NaN
    rows = per_tensor_sums(plan, plan.sums)
    if not plan.identity:
        n = plan.tensors
        high = torch.empty(n, dtype=torch.float64).scatter_reduce_(0, plan.owner, high, "amax", include_self=False)
        low = torch.empty(n, dtype=torch.float64).scatter_reduce_(0, plan.owner, low, "amin", include_self=False)
    total, sq, l1 = rows.unbind(0)
    positive = (total + l1) / 2
    # A tensor with an infinity and no NaN: (sum + L1) / 2 is no longer its positive part, which
    # is then summed as it is (rare; these are the CPU's own values, read without a device sync).
    # With a NaN every moment is NaN, that one too.
    for i in torch.nonzero(~total.isfinite() & ~high.isnan()).flatten().tolist():
        positive[i] = tensors[i].detach().double().clamp_min(0).sum()
    return torch.stack([positive, l1, sq, high, low.neg()])
