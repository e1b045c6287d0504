"""Tensors laid out as rows of cache-sized chunks, for the CPU's passes over many or large tensors
(``chunked_moments.py``, ``chunked_updates.py``).

On the CPU a ``torch._foreach_*`` operator is a loop over its tensors inside ATen with a fixed
cost per tensor (about 1 us), and an operator over a whole large tensor streams it through the
cache once per statistic. A :class:`ChunkPlan` is made once per set of shapes and dtypes: each
tensor becomes rows of at most ``chunk`` elements (a large tensor is cut into rows of ``chunk``
and a shorter last row), and the shorter rows of one dtype are packed, longest first, into
chunks of ``chunk // length`` rows of their first row's length (the tensors of a model repeat a
few shapes, one per kind of layer, so most chunks hold rows of one length; a shorter row is
padded, and each pass makes its padding neutral). A pass then costs a fixed number of operators
per chunk, whatever the tensors in it: a packed chunk is staged with one ``torch._foreach_copy_``
into a buffer that stays in cache and reduced along its rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["Chunk", "ChunkPlan", "Pieces", "norm_dtype", "per_tensor_sums"]


def norm_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of a norm: float32, float64 for float64 tensors (no narrowing)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class Chunk:
    """``rows`` rows of ``length`` elements of ``dtype``: ``pieces``, per row the tensor's index,
    its first element (-1: the whole tensor, shaped as it is) and how many of its elements the
    row holds (``length`` or fewer: the rest of the row is padding, ``pad`` marks it; None when
    no row is padded)."""

    __slots__ = ("dtype", "rows", "length", "pieces", "pad", "whole")

    def __init__(self, dtype: torch.dtype, length: int, pieces: list[tuple[int, int, int]]) -> None:
        self.dtype, self.rows, self.length, self.pieces = dtype, len(pieces), length, pieces
        #: The tensors' indexes when every row is a whole tensor (the common case), else None.
        self.whole = [i for i, _, _ in pieces] if all(start < 0 for _, start, _ in pieces) else None
        sizes = torch.tensor([n for _, _, n in pieces])
        self.pad: torch.Tensor | None = None
        if bool((sizes < length).any()):
            self.pad = torch.arange(length).expand(self.rows, length) >= sizes.unsqueeze(1)

    def shapes(self, shapes: Sequence[torch.Size]) -> list[torch.Size | tuple[int]]:
        """Each row's shape as read from its tensor: the tensor's for a whole one, else flat."""
        return [shapes[i] if start < 0 else (n,) for i, start, n in self.pieces]

    def staging(self, buffer: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
        """One view of ``buffer`` per row, at the row's place, shaped like its source."""
        return [buffer[k * self.length:k * self.length + n].view(shape)
                for k, ((_, _, n), shape) in enumerate(zip(self.pieces, self.shapes(shapes)))]


class ChunkPlan:
    """The chunks of tensors of ``shapes`` and ``dtypes`` (see the module docstring), dtype after
    dtype in order of first appearance: first a large tensor's rows of ``chunk`` elements, one
    chunk each; then the other rows (whole tensors, large tensors' last rows), longest first,
    packed as many to a chunk as its first, longest row allows, the shorter ones padded (rows of
    one length, the common case, are not). Empty tensors have no rows."""

    def __init__(self, shapes: Sequence[torch.Size], dtypes: Sequence[torch.dtype], chunk: int) -> None:
        self.key = (tuple(shapes), tuple(dtypes), chunk)
        self.dtypes = list(dict.fromkeys(dtypes))
        full: dict[torch.dtype, list[Chunk]] = {d: [] for d in self.dtypes}
        short: dict[torch.dtype, list[tuple[int, int, int]]] = {d: [] for d in self.dtypes}
        for i, (shape, dtype) in enumerate(zip(shapes, dtypes)):
            n = shape.numel()
            if 0 < n <= chunk:
                short[dtype].append((i, -1, n))
                continue
            for start in range(0, n if n > chunk else 0, chunk):
                if n - start >= chunk:
                    full[dtype].append(Chunk(dtype, chunk, [(i, start, chunk)]))
                else:
                    short[dtype].append((i, start, n - start))
        self.chunks: list[Chunk] = []
        for dtype in self.dtypes:
            self.chunks += full[dtype]
            rows = sorted(short[dtype], key=lambda row: -row[2])  # stable: equal lengths keep their order
            k = 0
            while k < len(rows):
                per = chunk // rows[k][2]
                self.chunks.append(Chunk(dtype, rows[k][2], rows[k:k + per]))
                k += per
        owner = [i for c in self.chunks for i, _, _ in c.pieces]
        self.tensors = len(shapes)
        #: Every tensor exactly one row, in order: per-row results are per-tensor results.
        self.identity = owner == list(range(self.tensors))
        #: The tensor of each row, rows in chunk order.
        self.owner = torch.tensor(owner, dtype=torch.long)

    def matches(self, shapes: Sequence[torch.Size], dtypes: Sequence[torch.dtype], chunk: int) -> bool:
        return self.key == (tuple(shapes), tuple(dtypes), chunk)

    def rows_by_dtype(self) -> tuple[dict[torch.dtype, int], list[slice]]:
        """Each dtype's row count, and each chunk's rows among its dtype's (a dtype's chunks follow
        one another): where a pass writes a chunk's results in per-dtype result buffers."""
        counts = dict.fromkeys(self.dtypes, 0)
        places = []
        for c in self.chunks:
            places.append(slice(counts[c.dtype], counts[c.dtype] + c.rows))
            counts[c.dtype] += c.rows
        return counts, places


class Pieces:
    """The rows of the current ``tensors`` (one call of a pass): a whole tensor as it is, a
    piece as a slice of its flattened tensor (flattened once; a view when it is contiguous, so a
    write to the piece reaches the tensor)."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = tensors
        self._flat: dict[int, torch.Tensor] = {}

    def row(self, i: int, start: int, length: int) -> torch.Tensor:
        if start < 0:
            return self.tensors[i]
        flat = self._flat.get(i)
        if flat is None:
            flat = self._flat[i] = self.tensors[i].detach().reshape(-1)
        return flat[start:start + length]

    def flat_row(self, i: int, start: int, length: int) -> torch.Tensor:
        """The row flattened (a view when its tensor is contiguous)."""
        return self.row(i, start, length).reshape(length)

    def rows(self, chunk: Chunk) -> list[torch.Tensor]:
        if chunk.whole is not None:
            tensors = self.tensors
            return [tensors[i] for i in chunk.whole]
        return [self.row(i, start, n) for i, start, n in chunk.pieces]


def per_tensor_sums(plan: ChunkPlan, rows: torch.Tensor) -> torch.Tensor:
    """(k, rows) per-row values summed per tensor: (k, tensors); 0 for a tensor without rows."""
    if plan.identity:
        return rows
    return torch.zeros(rows.shape[0], plan.tensors, dtype=rows.dtype).index_add_(1, plan.owner, rows)
