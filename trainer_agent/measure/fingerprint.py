"""Element-wise fingerprints of gradients and parameters, and their comparison across ranks.

The stability guide (5.3) asks that data-parallel replicas agree on their gradients to better than
1e-5 (relative). A global norm cannot tell two gradients apart that differ element-wise but have
the same norm (silent data corruption on one device, a rank that skipped an all-reduce); a random
projection can. For every layer the agent computes ``K`` projections

    f_k(layer) = sum_i w_k[i] * x[i]          (x: the layer's gradient or parameter elements)

with weights ``w_k[i] = s_k[row] * r_k[col]`` in {-1, +1}: each tensor, flattened, is viewed as
rows of ``TILE`` elements (``G``, shape (m, TILE), plus a tail of fewer than ``TILE``), and
``f_k = s_k^T G r_k + r_k[:tail] . tail``. The signs come from a fixed generator seed (the same on
every rank and in every process), one tile ``r`` shared by all tensors and one short ``s`` per
tensor (``m`` = numel / TILE values), so the weights cost ``TILE + numel / TILE`` values, not one
per element, and one pass reads each tensor once (a matrix-vector product: bandwidth-bound, like a
norm). Because every weight has magnitude 1, changing one element by ``d`` moves ``f_k`` by exactly
``d``: the relative difference ``|f_k(rank a) - f_k(rank b)| / ||x_layer||`` is the size of the
perturbation relative to the layer's norm (E[f_k^2] = ||x||^2), whatever element it hit.

On report steps the projections of every tensor are computed together
(:meth:`Fingerprinter.layer_values`), with a number of operators that does not grow with the
tensor count: one fused ``torch._foreach_copy_`` stages the tensors into a persistent buffer laid
out as rows (a tensor of ``TILE`` elements or more: its rows of ``TILE``, the tail zero-padded; a
smaller one: one row of the next power of two, at least ``MIN_ROW``), one matrix product per row
width gives every row's ``G r`` at once, each row is weighted by its ``s`` (1 for a tail or a small
tensor) and one ``index_add_`` sums the rows per layer. Zero padding leaves every value what the
per-tensor formula gives (up to float32 rounding: the same weights, summed in another order). The
buffer holds at most ``STAGE_ELEMENTS`` values (more tensors: one such pass per chunk); a tensor of
``DIRECT_ELEMENTS`` or more is projected in place (its own launches cost little next to reading it).

Replicas in sync run the same kernels on the same values (the same layout: the same tensor sizes)
and get bit-identical fingerprints.

The report step's one collective (``trainer_agent/report/exchange.py``) carries a whole-model
screen of them (``trainer_agent/measure/fingerprint_screen.py``: a few values per rank, whatever the
depth); the per-layer values (``Fingerprinter.row``: float32, 3 float64 slots per layer with K = 2)
go to the leader only when the screens differ (``trainer_agent/report/fingerprint_rounds.py``).
The leader alone compares them (:func:`desync`, ``trainer_agent/measure/desync.py``): a rank's difference is taken against
both middle values of the ranks (the median for an odd count), so with one bad rank among three
or more only that rank is named, and with two ranks both are (nothing tells which one is wrong).

Sharded parameters (DTensors: HSDP, tensor parallel, TP inside data parallelism) are compared
where their placements replicate them (``trainer_agent/measure/sharding.py``, ``replica_units``): the
ranks whose mesh coordinates agree on every ``Shard`` dimension hold the same local shard. Each
rank projects its *local* tensors (the weights of a tensor depend only on its index and its local
size, so identical shards give identical fingerprints: bit for bit when the ranks' other tensors
have the same sizes too, as with even shards; otherwise their staging layouts differ and the
values agree to float32 rounding, far below any tolerance); a *unit* is one layer's parameters with
the same replica layout, and :func:`desync` compares each unit within each group of replicas, on
the rows the report's gather already carries (no further collective). A gradient whose placements
are not its parameter's (a ``Partial`` sum still pending, as for a sequence-parallel norm) is left
out of the gradient comparison. Plain FSDP (every rank a different shard) has nothing to compare:
no fingerprint.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trainer_agent.measure import stats
from trainer_agent.measure.desync import DesyncFinding, desync, findings, rel_diff
from trainer_agent.compat import torch_private
from trainer_agent.measure.sharding import replica_units

__all__ = ["TILE", "SEED", "STAGE_ELEMENTS", "DIRECT_ELEMENTS", "MIN_ROW", "Fingerprinter", "DesyncFinding", "desync", "findings", "for_ranks", "rel_diff"]

#: Elements per row of the rank-1 sign pattern.
TILE = 4096
#: Seed of the sign patterns: the same on every rank.
SEED = 0x5EED_F1A9
#: Most values of the staging buffer of the fused projections (float32: 64 MiB).
STAGE_ELEMENTS = 1 << 24
#: Tensors at least this large are projected in place, not staged.
DIRECT_ELEMENTS = 1 << 22
#: Narrowest row of a small tensor in the staging buffer.
MIN_ROW = 16


def _signs(gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randint(0, 2, shape, generator=gen, dtype=torch.int8).to(torch.float32).mul_(2).sub_(1)


class Fingerprinter:
    """Per-unit projections and norms of a list of tensors laid out like ``numels``.

    ``numels``: the numel of each tensor (the agent's parameter order; a DTensor's *local* numel);
    ``layer_ids``: device long tensor, the unit of each (a layer; -1: left out, not projected);
    ``layers``: how many units. ``projections``: ``K``. ``names``: the units' names (default
    ``layer<i>``); ``groups``: the ranks compared in each unit (see :func:`desync`; default every
    rank in every unit).
    """

    def __init__(self, numels: Sequence[int], layer_ids: torch.Tensor, layers: int, *,
                 projections: int = 2, device: torch.device, names: Sequence[str] | None = None,
                 groups: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        if projections < 1:
            raise ValueError(f"projections must be >= 1, got {projections}")
        self.k = projections
        self.layers = layers
        self.names = list(names) if names is not None else [f"layer{i}" for i in range(layers)]
        self.groups = groups
        ids = layer_ids.to(torch.long)
        self._ids = ids.to(device)
        self._ids_host = ids.tolist()
        self._keep = [i for i, u in enumerate(ids.tolist()) if u >= 0]
        self._all = len(self._keep) == len(numels)
        self._keep_index = torch.tensor(self._keep, dtype=torch.long, device=device)
        self.layer_ids = self._ids if self._all else self._ids[self._keep_index]
        self._unit_or_dropped = torch.where(self._ids >= 0, self._ids, layers)
        self.device = device
        self._staging: _Stage | None = None  # the fused projections' plan and buffer (first use)
        self._r = {torch.float32: _signs(torch.Generator().manual_seed(SEED), (TILE, projections)).to(device)}
        self._numels = list(numels)
        self._s: list[torch.Tensor | None] = []
        for i, n in enumerate(numels):
            m = n // TILE if n >= TILE else 0
            # One generator per tensor: its pattern depends on its own index and size only, so two
            # ranks holding the same shard draw the same weights whatever the sizes of their
            # other (unevenly sharded) tensors.
            self._s.append(_signs(torch.Generator().manual_seed(SEED + 1 + i), (m, projections)).to(device)
                           if m else None)

    def _r_for(self, dtype: torch.dtype) -> torch.Tensor:
        r = self._r.get(dtype)
        if r is None:
            r = self._r[dtype] = self._r[torch.float32].to(dtype)
        return r

    def project(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """(len(tensors), K) float64 projections, in the order of ``tensors`` (a 0-dim tensor
        stands for a missing gradient: projections 0)."""
        return torch.stack([self.project_one(i, x) for i, x in enumerate(tensors)])

    def project_one(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """(K,) float64 projections of ``x``, laid out as tensor ``i`` (0 for a 0-dim stand-in)."""
        s, numel = self._s[i], self._numels[i]
        if x.numel() != numel:  # the 0-dim stand-in of a missing gradient
            return torch.zeros(self.k, dtype=torch.float64, device=self.device)
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        flat = x.detach().reshape(-1)
        if flat.dtype != dtype:
            flat = flat.to(dtype)  # bf16/fp16: project in float32 (a bf16 sum has ~3 digits)
        r = self._r_for(dtype)
        n = flat.numel()
        if s is None:
            return (flat @ r[:n]).to(torch.float64)
        m = s.shape[0]
        main = flat[: m * TILE].view(m, TILE) @ r  # (m, K)
        f = (main * s.to(dtype)).sum(0)
        tail = n - m * TILE
        if tail:
            f = f + flat[m * TILE:] @ r[:tail]
        return f.to(torch.float64)

    def layer_values(self, buckets: Sequence[Sequence[torch.Tensor]], skip: Collection[int] = (),
                     sq: torch.Tensor | None = None) -> torch.Tensor:
        """(units, K + 1) float64 device tensor: the K projections of each unit and its L2 norm
        (from ``sq``, the tensors' float64 squared norms when the caller has them, else one fused
        norm per bucket). Tensors of no unit or in ``skip`` are left out (not projected, norm 0);
        a 0-dim stand-in of a missing gradient projects to 0. Fused (see the module docstring): a
        few operators per staged chunk and per tensor of ``DIRECT_ELEMENTS`` or more."""
        flat = [t for b in buckets for t in b]
        sq = stats.bucket_norms(buckets, self.device).to(torch.float64).square() if sq is None else sq
        dropped = self.layers  # the row that collects what is left out, then is cut off
        whole = self._all and not skip  # nothing left out: no such row (and no slice to cut it off)
        ids = self._ids if whole else self._unit_or_dropped
        if skip:
            ids = ids.clone().index_fill_(0, torch.tensor(sorted(skip), dtype=torch.long, device=self.device), dropped)
        out = torch.zeros(self.layers + (0 if whole else 1), self.k + 1, dtype=torch.float64, device=self.device)
        out[:, self.k].index_add_(0, ids, sq).sqrt_()  # the norm column after the projections'
        self._stage().project_into(out[:, :self.k], flat, skip)
        return out if whole else out[:dropped]

    def _stage(self) -> _Stage:
        if self._staging is None:
            self._staging = _Stage(self, self._numels, self._ids.tolist())
        return self._staging

    def width(self) -> int:
        """float64 slots of one rank's per-layer row (:meth:`row`): the gradients' and the
        parameters' values of every unit as float32, two to a slot."""
        return self.layers * (self.k + 1)

    def row(self, grads: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        """This rank's per-layer row (what it sends the leader when the ranks' whole-model
        fingerprints differ) from two :meth:`layer_values` results:
        ``width()`` float64 slots holding their float32 values (the projections are float32 sums
        already; rounding the per-unit float64 sums to float32 moves them by at most 6e-8 of
        their size, far below any tolerance, and replicas in sync stay bit-identical)."""
        return torch.stack([grads, params]).to(torch.float32).view(-1).view(torch.float64)


class _Stage:
    """The fused projections of one :class:`Fingerprinter` (see the module docstring): the tensors
    below ``DIRECT_ELEMENTS`` in chunks of at most ``STAGE_ELEMENTS`` buffer values, each chunk laid
    out as blocks of rows of one width (``TILE`` for the tensors of ``TILE`` elements or more; the
    next power of two for a smaller one), with each row's weights (``s``, or 1) and unit."""

    def __init__(self, fp: Fingerprinter, numels: Sequence[int], units: Sequence[int]) -> None:
        self.fp = fp
        device, k = fp.device, fp.k
        self.direct = [i for i, n in enumerate(numels) if units[i] >= 0 and n >= DIRECT_ELEMENTS]
        staged = [i for i, n in enumerate(numels) if units[i] >= 0 and 0 < n < DIRECT_ELEMENTS]
        # chunks: lists of (tensor, row width, rows)
        chunks: list[list[tuple[int, int, int]]] = [[]]
        size = 0
        for i in staged:
            n = numels[i]
            width = TILE if n >= TILE else max(MIN_ROW, 1 << (n - 1).bit_length())
            rows = -(-n // width)
            if size + rows * width > STAGE_ELEMENTS and chunks[-1]:
                chunks.append([])
                size = 0
            chunks[-1].append((i, width, rows))
            size += rows * width
        self.chunks = [c for c in chunks if c]
        self.capacity = max((sum(w * r for _, w, r in c) for c in self.chunks), default=0)
        self.buffer = torch.zeros(self.capacity, dtype=torch.float32, device=device)
        r = fp._r_for(torch.float32)
        self.plans: list[_ChunkPlan] = []
        self.place: dict[int, tuple[int, int]] = {}  # tensor -> (chunk, offset in the buffer)
        for c, chunk in enumerate(self.chunks):
            widths = sorted({w for _, w, _ in chunk}, reverse=True)
            blocks, weights, row_units = [], [], []
            offset = 0
            for width in widths:
                members = [(i, rows) for i, w, rows in chunk if w == width]
                total = sum(rows for _, rows in members)
                blocks.append((self.buffer[offset:offset + total * width].view(total, width), r[:width]))
                for i, rows in members:
                    self.place[i] = (c, offset)
                    offset += rows * width
                    w_rows = torch.ones(rows, k, dtype=torch.float32)
                    s = fp._s[i]
                    if s is not None:  # the full rows: s; a tail row: 1
                        w_rows[:s.shape[0]] = s.cpu()
                    weights.append(w_rows)
                    row_units += [units[i]] * rows
            w = torch.cat(weights).to(device)
            self.plans.append(_ChunkPlan([i for i, _, _ in chunk], blocks, w,
                                         torch.tensor(row_units, dtype=torch.long, device=device),
                                         torch.empty(w.shape, dtype=torch.float64, device=device)))
        self._views: dict[int, torch.Tensor] = {}
        # Per plan, the shapes of its tensors when all of them were staged, and their views.
        self._staged: dict[int, tuple[list[torch.Size], list[torch.Tensor]]] = {}

    def _view(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Tensor ``i``'s region of the buffer, shaped like ``x`` (made once per shape)."""
        view = self._views.get(i)
        if view is None or view.shape != x.shape:
            _, offset = self.place[i]
            view = self._views[i] = self.buffer[offset:offset + x.numel()].view(x.shape)
        return view

    def _stage(self, plan: _ChunkPlan, flat: Sequence[torch.Tensor], skip: Collection[int],
               direct: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``(buffer views, tensors)`` of ``plan`` to stage, one by one: a tensor left out or
        missing (a zero in its place) is not; a float64 one is projected directly (appended to
        ``direct``)."""
        numels = self.fp._numels
        dst, src = [], []
        for i in plan.tensors:
            x = flat[i]
            if i in skip or x.numel() != numels[i]:
                continue  # left out, or a missing gradient: its rows stay 0
            if x.dtype == torch.float64:
                direct.append(i)  # projected in float64, in place
                continue
            dst.append(self._view(i, x))
            src.append(x)
        return dst, src

    def project_into(self, out: torch.Tensor, flat: Sequence[torch.Tensor], skip: Collection[int]) -> None:
        """Add the projections of the tensors ``flat`` (the fingerprinter's layout) to their units'
        rows of ``out`` ((units + 1, K) float64)."""
        fp = self.fp
        numels = fp._numels
        direct = [i for i in self.direct if i not in skip and flat[i].numel() == numels[i]]
        for k, plan in enumerate(self.plans):
            src = [flat[i] for i in plan.tensors]
            shapes = [x.shape for x in src]
            seen = self._staged.get(k)
            if (not skip and seen is not None and seen[0] == shapes
                    and torch.float64 not in {x.dtype for x in src}):
                dst = seen[1]  # the usual case: every tensor staged, as last time (no loop in Python)
            else:
                dst, src = self._stage(plan, flat, skip, direct)
                if not skip and len(dst) == len(plan.tensors):
                    self._staged[k] = (shapes, dst)
            if not dst:
                continue
            if len(self.plans) > 1 or len(dst) < len(plan.tensors):
                self.buffer.zero_()  # the padding, and the regions not copied now, read 0
            with torch.no_grad():  # (no detach per tensor: one operator each)
                torch_private.foreach_copy_(dst, src)
            products = [block @ r for block, r in plan.blocks]
            rows = products[0] if len(products) == 1 else torch.cat(products)
            # weighted in float32 (the weights are +-1: exact), written as float64: one operator
            out.index_add_(0, plan.units, torch.mul(rows, plan.weights, out=plan.weighted))
        if direct:
            ids = torch.tensor([fp._ids_host[i] for i in direct], dtype=torch.long, device=fp.device)
            out.index_add_(0, ids, torch.stack([fp.project_one(i, flat[i]) for i in direct]))


@dataclass(frozen=True, slots=True)
class _ChunkPlan:
    tensors: list[int]
    blocks: list[tuple[torch.Tensor, torch.Tensor]]  # (rows of one width: a view of the buffer, r[:width])
    weights: torch.Tensor  # (rows, K) float32: s of a full row, 1 otherwise
    units: torch.Tensor  # (rows,) long: the unit of each row
    weighted: torch.Tensor  # (rows, K) float64: the weighted rows (written each time)


def for_ranks(index: Any, world: int) -> Fingerprinter | None:
    """The fingerprinter comparing the ranks of ``index`` (a ``ParamIndex``): every layer on every
    rank without sharding; with DTensors, the replicas of each shard (``replica_units``); None
    when nothing is replicated (plain FSDP)."""
    if index.sharding is None:
        return Fingerprinter([p.numel() for p in index.params], index.layer_ids, len(index.layers),
                             device=index.device, names=index.layers)
    units = replica_units(index.params, index.layer_ids.tolist(), index.layers, world, index.device)
    if units is None:
        return None
    unit_of, names, groups = units
    return Fingerprinter([t.numel() for b in index.buckets for t in b], torch.tensor(unit_of), len(names),
                         device=index.device, names=names, groups=groups)
