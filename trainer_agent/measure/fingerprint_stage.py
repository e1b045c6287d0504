"""The fused projections of a :class:`~trainer_agent.measure.fingerprint.Fingerprinter`: every
tensor below ``DIRECT_ELEMENTS`` projected with a fixed number of launches per staged chunk,
whatever the tensor count.

A tensor of ``n`` elements is laid out as ``rows_of(n)`` rows of ``width_of(n)`` elements
(zero-padded at its end; see ``fingerprint.py``), which is what ``torch._chunk_cat(tensors, 0,
rows)`` makes of a 1-D tensor, and of a tensor whose first dimension ``rows`` divides: one copy,
on CUDA one kernel for all of them, puts the tensors of one row count and dtype side by side as
the columns of one (rows, columns) buffer. Then, per chunk: ``s^T @ buffer`` (one matrix product:
every column's sum weighted by the rows' signs), times each column's sign ``r`` (one product, the
per-tensor signs laid out once beside the columns) and one ``index_add_`` of the columns into
their units: four launches per chunk of at most ``STAGE_ELEMENTS`` buffer values. A tensor whose
first dimension ``rows`` does not divide, or one not contiguous (CUDA's kernel would copy it in
memory order), is flattened first (in logical order); float64
tensors and those of ``DIRECT_ELEMENTS`` or more are projected in place (``project_one``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch

from trainer_agent.compat import torch_private

__all__ = ["FusedProjections"]

_CONTIGUOUS = torch.Tensor.is_contiguous


class _Chunk:
    """Tensors of one row count and dtype, side by side in the buffer: their indexes, shapes,
    positions to flatten, the buffer's (rows, columns) view, each column's signs ``r`` (K,
    columns) and unit."""

    __slots__ = ("tensors", "shapes", "flatten", "dtype", "rows", "view", "r", "units", "_skips", "_zeros", "_members")

    def __init__(self, fp: Any, tensors: list[int], shapes: list[torch.Size], dtype: torch.dtype, rows: int,
                 buffer: torch.Tensor, units: Sequence[int]) -> None:
        from trainer_agent.measure.fingerprint import width_of

        self.tensors, self.dtype, self.rows = tensors, dtype, rows
        # (a missing gradient's 0-dim stand-in when the plan was made: its tensor, flattened)
        self._expect([s if s.numel() == fp.numels[i] else torch.Size([fp.numels[i]]) for i, s in zip(tensors, shapes)])
        widths = [width_of(fp.numels[i]) for i in tensors]
        columns = sum(widths)
        self.view = buffer[:rows * columns].view(rows, columns)
        # The (K, columns) signs and the columns' units (a column per 16 elements of a small tensor):
        # on an accelerator int8 and int32, 5 bytes per column kept on the device; on the CPU
        # float32 and int64 (its mixed-dtype product and int32 index_add_ are 10-15x slower).
        compact = fp.device.type != "cpu"
        r = torch.cat([fp.r_host(i) for i in tensors]).t()
        self.r = r.to(torch.int8 if compact else torch.float32).contiguous().to(fp.device)
        self.units = torch.repeat_interleave(torch.tensor([units[i] for i in tensors], dtype=torch.long),
                                             torch.tensor(widths)).to(torch.int32 if compact else torch.long).to(fp.device)
        self._skips: dict[frozenset[int], torch.Tensor] = {}
        self._zeros: dict[int, torch.Tensor] = {}
        self._members = set(tensors)

    def _expect(self, shapes: list[torch.Size]) -> None:
        """The shapes the fast path of :meth:`inputs` takes as they are, and which of them it
        flattens (0-dim, or a first dimension ``rows`` does not divide)."""
        self.shapes = shapes
        self.flatten = [k for k, s in enumerate(shapes) if len(s) == 0 or (len(s) > 1 and s[0] % self.rows)]

    def inputs(self, flat: Sequence[torch.Tensor], numels: Sequence[int], settled: bool = False) -> list[torch.Tensor]:
        """This chunk's tensors of ``flat`` as ``chunk_cat`` lays them out: as they are where their
        shapes are the plan's (the usual case: no loop over them in Python but the list), else
        flattened, a missing gradient's 0-dim stand-in as zeros. ``settled``: ``flat`` has the
        shapes of the settled layouts the plan was made from (their shapes are not read)."""
        xs = [flat[i] for i in self.tensors]
        if (settled or [x.shape for x in xs] == self.shapes) and all(map(_CONTIGUOUS, xs)):
            for k in self.flatten:
                xs[k] = xs[k].reshape(-1)  # (a view: contiguous)
            return xs
        shapes, missing = None if settled else [x.shape for x in xs], False
        for k, i in enumerate(self.tensors):
            if xs[k].numel() != numels[i]:  # no gradient: zeros in its place (projected to 0)
                zeros = self._zeros.get(i)
                if zeros is None:
                    zeros = self._zeros[i] = torch.zeros(numels[i], dtype=self.dtype, device=self.view.device)
                xs[k], missing = zeros, True
            elif xs[k].dim() != 1 or not xs[k].is_contiguous():
                # flattened in logical order (CUDA's kernel copies a dense tensor in memory order)
                xs[k] = xs[k].reshape(-1)
        if not missing and shapes is not None:  # every tensor present with new shapes: the fast path's from now on
            self._expect(shapes)
        return xs

    def units_without(self, skip: Collection[int], dropped: int, numels: Sequence[int]) -> torch.Tensor:
        """The columns' units with those of the tensors in ``skip`` moved to the ``dropped`` row."""
        key = frozenset(i for i in skip if i in self._members)
        if not key:
            return self.units
        units = self._skips.get(key)
        if units is None:
            from trainer_agent.measure.fingerprint import width_of

            moved, at = [], 0
            for i in self.tensors:
                w = width_of(numels[i])
                if i in key:
                    moved += range(at, at + w)
                at += w
            index = torch.tensor(moved, dtype=torch.long, device=self.units.device)
            units = self._skips[key] = self.units.clone().index_fill_(0, index, dropped)
        return units


class FusedProjections:
    """The plan of a :class:`Fingerprinter`'s fused projections for tensors of ``shapes`` and
    ``dtypes`` (made at first use, one per set of dtypes): chunks of at most ``STAGE_ELEMENTS``
    buffer values per (row count, dtype), the tensors projected in place (``direct``) apart."""

    def __init__(self, fp: Any, shapes: Sequence[torch.Size], dtypes: Sequence[torch.dtype],
                 units: Sequence[int]) -> None:
        from trainer_agent.measure import fingerprint

        self.fp = fp
        numels = fp.numels
        big, stage = fingerprint.DIRECT_ELEMENTS, fingerprint.STAGE_ELEMENTS
        self.direct = [i for i, n in enumerate(numels)
                       if units[i] >= 0 and n and (n >= big or dtypes[i] == torch.float64)]
        groups: dict[tuple[int, torch.dtype], list[list[int]]] = {}
        sizes: dict[tuple[int, torch.dtype], int] = {}
        for i, n in enumerate(numels):
            if units[i] < 0 or not 0 < n < big or dtypes[i] == torch.float64:
                continue
            key = (fingerprint.rows_of(n), dtypes[i])
            size = key[0] * fingerprint.width_of(n)
            chunks = groups.setdefault(key, [[]])
            if chunks[-1] and sizes[key] + size > stage:
                chunks.append([])
                sizes[key] = 0
            chunks[-1].append(i)
            sizes[key] = sizes.get(key, 0) + size
        capacity = max((rows * sum(fingerprint.width_of(numels[i]) for i in c)
                        for (rows, _), chunks in groups.items() for c in chunks), default=0)
        self.buffer = torch.zeros(capacity, dtype=torch.float32, device=fp.device)
        self.chunks = [_Chunk(fp, c, [shapes[i] for i in c], dtype, rows, self.buffer, units)
                       for (rows, dtype), chunks in groups.items() for c in chunks if c]
        self._direct_ids: dict[tuple[int, ...], torch.Tensor] = {}

    def project_into(self, out: torch.Tensor, flat: Sequence[torch.Tensor], skip: Collection[int], *,
                     settled: bool = False) -> None:
        """Add the projections of the tensors ``flat`` (the fingerprinter's layout) to their units'
        rows of ``out`` ((units + 1, K) float64; the last row collects what ``skip`` leaves out).
        ``settled``: the plan was made from the settled layouts ``flat`` has."""
        fp = self.fp
        numels = fp.numels
        dropped = out.shape[0] - 1
        with torch.no_grad():  # parameters are copied, not differentiated
            for chunk in self.chunks:
                xs = chunk.inputs(flat, numels, settled)
                if chunk.dtype in (torch.float32, torch.bfloat16):  # (CUDA's kernel widens bfloat16)
                    torch_private.chunk_cat(xs, chunk.rows, out=chunk.view)
                else:
                    chunk.view.copy_(torch_private.chunk_cat(xs, chunk.rows))
                # (K, columns): every column's elements weighted by their rows' signs and summed,
                # the buffer read row after row (4x faster on a CPU than columns after columns)
                sums = fp.s_for(chunk.rows, torch.float32).t() @ chunk.view
                units = chunk.units_without(skip, dropped, numels) if skip else chunk.units
                # signed (the signs are +-1: exact) and written as float64, a temporary: one operator
                weighted = torch.empty(sums.shape, dtype=torch.float64, device=sums.device)
                out.index_add_(0, units, torch.mul(sums, chunk.r, out=weighted).t())
            direct = tuple(i for i in self.direct if i not in skip and flat[i].numel() == numels[i])
            if direct:
                ids = self._direct_ids.get(direct)
                if ids is None:  # once per set (no host-to-device copy per report)
                    ids = self._direct_ids[direct] = torch.tensor([fp.unit_of(i) for i in direct], device=fp.device)
                out.index_add_(0, ids, torch.stack([fp.project_one(i, flat[i]) for i in direct]))
