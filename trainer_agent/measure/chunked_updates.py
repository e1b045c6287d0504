"""The update's squared norms on the CPU, chunk by chunk (``stats.update_sq_norms`` calls it when
measuring on the CPU): per parameter ``||W_before - W_after||^2``, ``||W_after||^2`` and, when
asked, ``||W_before||^2``, from the agent's snapshot of ``W_before``.

Laid out by a :class:`~trainer_agent.measure.chunk_plan.ChunkPlan` (made once per set of shapes):
a chunk that is one row (a large parameter's piece, or a parameter alone at its length) is read
in place, a chunk of several small parameters of one length is staged with one
``torch._foreach_copy_`` per side into buffers that stay in cache. Per chunk, whatever the
parameters in it: the difference into a buffer, then a float32 norm per row of the difference,
of ``W_after`` and of ``W_before``, while the chunk is in cache. ``W_before`` and ``W_after`` are
read once and nothing is written to memory (8 bytes per float32 element instead of the 20 of an
in-place difference and three whole-tensor norms); with ``refresh``, ``W_after`` is also copied
into the snapshot from the cache, so that a measured step that follows needs no snapshot copy.
Row norms are squared in float64 and summed per parameter (more accurate than one float32 norm
of a large tensor).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trainer_agent.compat import torch_private
from trainer_agent.measure.chunk_plan import Chunk, ChunkPlan, Pieces, norm_dtype, per_tensor_sums

__all__ = ["UPDATE_CHUNK", "chunked_update_sq_norms"]

#: Elements per chunk: the difference buffer (256 KiB in float32) and the chunks it reads stay in
#: a core's L2 cache.
UPDATE_CHUNK = 1 << 16


class _Views:
    """A chunk's views of its dtype's three buffers (after, before, difference): per row shaped
    like its source for staging, and as (rows, length) matrices; the dtype of its norms."""

    __slots__ = ("after", "before", "after_rows", "before_rows", "diff", "diff_rows", "norm_dtype", "norms")

    def __init__(self, c: Chunk, shapes: Sequence[torch.Size], buffers: tuple[torch.Tensor, ...],
                 norms: torch.Tensor) -> None:
        size = c.rows * c.length
        after, before, diff = buffers
        self.norm_dtype = norm_dtype(c.dtype)
        #: Its rows' norms (of the difference, of W_after, of W_before), written in place.
        self.norms = norms.unbind(0)
        self.after, self.before = c.staging(after, shapes), c.staging(before, shapes)
        self.after_rows, self.before_rows = after[:size].view(c.rows, c.length), before[:size].view(c.rows, c.length)
        self.diff, self.diff_rows = diff[:size], diff[:size].view(c.rows, c.length)


class UpdatePlan(ChunkPlan):
    """A :class:`ChunkPlan` with its buffers, three chunks per dtype, the rows' three norms per
    dtype (``norms``: a (3, rows) tensor of the norms' dtype each, each chunk's rows at its place),
    and the rows of the tensors it last read (:meth:`rows_of`)."""

    def __init__(self, shapes: Sequence[torch.Size], dtypes: Sequence[torch.dtype], chunk: int) -> None:
        super().__init__(shapes, dtypes, chunk)
        buffers = {d: tuple(torch.empty(chunk, dtype=d) for _ in range(3)) for d in self.dtypes}
        counts, places = self.rows_by_dtype()
        self.norms = {d: torch.empty(3, counts[d], dtype=norm_dtype(d)) for d in self.dtypes}
        self.views = [_Views(c, shapes, buffers[c.dtype], self.norms[c.dtype][:, at])
                      for c, at in zip(self.chunks, places)]
        self._rows: tuple[tuple[int, ...], list[tuple]] | None = None

    def rows_of(self, before: Sequence[torch.Tensor], after: Sequence[torch.Tensor]) -> list[tuple]:
        """Per chunk the rows the pass reads: of a one-row chunk ``(after, before)`` as (1, length)
        views, else the two lists of rows its staging copies read. The parameters and the snapshot
        are the same tensors from step to step: their rows (a few views per chunk) are kept while
        every tensor is contiguous at the same address, and made again otherwise."""
        key = tuple([t.data_ptr() for t in after] + [t.data_ptr() for t in before])
        contiguous = all(t.is_contiguous() for t in after) and all(t.is_contiguous() for t in before)
        if contiguous and self._rows is not None and self._rows[0] == key:
            return self._rows[1]
        new, old = Pieces(after), Pieces(before)
        rows = [(new.flat_row(*c.pieces[0]).view(1, c.length), old.flat_row(*c.pieces[0]).view(1, c.length))
                if c.rows == 1 else (new.rows(c), old.rows(c)) for c in self.chunks]
        self._rows = (key, rows) if contiguous else None
        return rows


@torch.no_grad()
def chunked_update_sq_norms(before: Sequence[torch.Tensor], after: Sequence[torch.Tensor], cache: dict, *,
                            before_norms: bool, refresh: bool) -> list[torch.Tensor]:
    """Per parameter (CPU tensors, ``before[i]`` the contiguous snapshot of ``after[i]``),
    float64 vectors: ``[||before - after||^2, ||after||^2]`` and, with ``before_norms``,
    ``||before||^2``; with ``refresh`` the snapshot holds ``after`` on return. ``cache``: a dict
    the caller keeps (the plan and its buffers)."""
    shapes, dtypes = [t.shape for t in after], [t.dtype for t in after]
    plan = cache.get("update_plan")
    if plan is None or not plan.matches(shapes, dtypes, UPDATE_CHUNK):
        plan = cache["update_plan"] = UpdatePlan(shapes, dtypes, UPDATE_CHUNK)
    for c, v, (new, old) in zip(plan.chunks, plan.views, plan.rows_of(before, after)):
        if c.rows == 1:
            a_rows, b_rows = new, old
            torch.sub(b_rows, a_rows, out=v.diff_rows)
        else:
            torch_private.foreach_copy_(v.after, new)
            torch_private.foreach_copy_(v.before, old)
            a_rows, b_rows = v.after_rows, v.before_rows
            if c.pad is not None:  # padding: 0 on both sides, adding nothing to a norm
                a_rows.masked_fill_(c.pad, 0)
                b_rows.masked_fill_(c.pad, 0)
            torch.sub(b_rows, a_rows, out=v.diff_rows)
        dtype, (delta, param, old_norm) = v.norm_dtype, v.norms
        torch.linalg.vector_norm(v.diff_rows, dim=1, dtype=dtype, out=delta)
        torch.linalg.vector_norm(a_rows, dim=1, dtype=dtype, out=param)
        if before_norms:
            torch.linalg.vector_norm(b_rows, dim=1, dtype=dtype, out=old_norm)
        if refresh:  # W_after into the snapshot, from the cache
            if c.rows == 1:
                b_rows.copy_(a_rows)
            else:
                torch_private.foreach_copy_(old, v.after)
    k = 3 if before_norms else 2
    if not plan.chunks:
        return [torch.zeros(plan.tensors, dtype=torch.float64) for _ in range(k)]
    # (a new tensor, also for float64 norms: the plan's are written again by its next pass)
    rows = torch.cat([norms[:k].to(torch.float64) for norms in plan.norms.values()], dim=1).square_()
    return list(per_tensor_sums(plan, rows).unbind(0))
