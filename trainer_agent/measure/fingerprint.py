"""Element-wise fingerprints of gradients and parameters, and their comparison across ranks.

The stability guide (5.3) asks that data-parallel replicas agree on their gradients to better than
1e-5 (relative). A global norm cannot tell two gradients apart that differ element-wise but have
the same norm (silent data corruption on one device, a rank that skipped an all-reduce); a random
projection can. For every layer the agent computes ``K`` projections

    f_k(layer) = sum_i w_k[i] * x[i]          (x: the layer's gradient or parameter elements)

with weights ``w_k[i] = s_k[row] * r_k[col]`` in {-1, +1}: each tensor of ``n`` elements,
flattened, is laid out as ``rows_of(n)`` rows (``SMALL_ROWS`` below ``LARGE_ELEMENTS`` elements,
``LARGE_ROWS`` from there) of ``width_of(n)`` elements, its last rows zero-padded, and
``f_k = sum_col r_k[col] (X^T s_k)[col]``. The signs come from fixed generator seeds (the same on
every rank and in every process): ``s`` one column of signs per row count, shared by all tensors,
and ``r`` one per tensor (``width_of(n)`` values, from a generator of the tensor's own index), so
the weights cost ``n / rows + rows`` values, not one per element, and one pass reads each tensor
once (a matrix product: bandwidth-bound, like a norm). Because every weight has magnitude 1,
changing one element by ``d`` moves ``f_k`` by exactly ``d``: the relative difference
``|f_k(rank a) - f_k(rank b)| / ||x_layer||`` is the size of the perturbation relative to the
layer's norm (E[f_k^2] = ||x||^2), whatever element it hit.

On report steps the projections of every tensor are computed together
(:meth:`Fingerprinter.layer_values`, ``trainer_agent/measure/fingerprint_stage.py``), with a number of
kernel launches that does not grow with the tensor count: this layout is the one
``torch._chunk_cat`` makes, so one copy (one CUDA kernel) puts all tensors of one row count and
dtype side by side as the columns of one buffer, and one matrix product, one product with the
columns' signs and one ``index_add_`` into the layers follow; at most ``STAGE_ELEMENTS`` buffer
values per such chunk. The padding is zeros: every value is what the per-tensor formula
(:meth:`Fingerprinter.project_one`) gives, up to float32 rounding (the same weights, summed in
another order). A tensor of ``DIRECT_ELEMENTS`` or more, or a float64 one, is projected in place
(its own launches cost little next to reading it).

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
from typing import Any

import torch

from trainer_agent.measure import staged, stats
from trainer_agent.measure.fingerprint_stage import FusedProjections
from trainer_agent.measure.desync import DesyncFinding, desync, findings, rel_diff
from trainer_agent.measure.sharding import replica_units

__all__ = ["SMALL_ROWS", "LARGE_ROWS", "LARGE_ELEMENTS", "SEED", "STAGE_ELEMENTS", "DIRECT_ELEMENTS", "rows_of",
           "width_of", "Fingerprinter", "DesyncFinding", "desync", "findings", "for_ranks", "rel_diff"]

#: Rows of a tensor's layout (see the module docstring): few for a small tensor (at most
#: ``SMALL_ROWS - 1`` padding elements), many for a large one (few signs per tensor).
SMALL_ROWS = 16
LARGE_ROWS = 4096
#: Elements from which a tensor is laid out in ``LARGE_ROWS`` rows.
LARGE_ELEMENTS = 1 << 16
#: Seed of the sign patterns: the same on every rank.
SEED = 0x5EED_F1A9
#: Most values of one staged chunk's buffer (float32: 64 MiB).
STAGE_ELEMENTS = 1 << 24
#: Tensors at least this large are projected in place, not staged.
DIRECT_ELEMENTS = 1 << 22


def rows_of(numel: int) -> int:
    """Rows of the layout of a tensor of ``numel`` elements."""
    return SMALL_ROWS if numel < LARGE_ELEMENTS else LARGE_ROWS


def _layouts(buckets: Sequence[Sequence[torch.Tensor]]) -> tuple[staged.Layout, ...] | None:
    """The settled layouts of ``buckets`` (``staged.Settled``: the index's parameters, its gradients
    with none missing) when every bucket has one and still its dtype, else None."""
    layouts = tuple(getattr(b, "layout", None) for b in buckets)
    if all(layout is not None and layout.shapes and b[0].dtype == layout.dtype for b, layout in zip(buckets, layouts)):
        return layouts
    return None


def width_of(numel: int) -> int:
    """Elements per row of the layout of a tensor of ``numel`` elements (the last rows padded)."""
    return -(-numel // rows_of(numel))


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
        self._plans: dict[tuple, FusedProjections] = {}  # the fused projections, per dtypes or per set of layouts
        self.numels = list(numels)
        gen = torch.Generator().manual_seed(SEED)
        self._s = {rows: {torch.float32: _signs(gen, (rows, projections)).to(device)} for rows in (SMALL_ROWS, LARGE_ROWS)}
        # Tensor i's column signs, made from its own generator when needed (laid out per staged
        # chunk; kept on the device for those projected in place).
        self._r: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def s_for(self, rows: int, dtype: torch.dtype) -> torch.Tensor:
        """The row signs of a layout of ``rows`` rows, (rows, K), in ``dtype``."""
        by_dtype = self._s[rows]
        s = by_dtype.get(dtype)
        if s is None:
            s = by_dtype[dtype] = by_dtype[torch.float32].to(dtype)
        return s

    def r_host(self, i: int) -> torch.Tensor:
        """Tensor ``i``'s column signs, (width_of(numel), K) float32 on the host: from a generator
        of its own, so that they depend on its index and size only (two ranks holding the same
        shard draw the same weights whatever the sizes of their other, unevenly sharded,
        tensors)."""
        return _signs(torch.Generator().manual_seed(SEED + 1 + i), (width_of(self.numels[i]), self.k))

    def _r_for(self, i: int, dtype: torch.dtype) -> torch.Tensor:
        r = self._r.get((i, dtype))
        if r is None:
            r = self._r[(i, dtype)] = self.r_host(i).to(self.device, dtype)
        return r

    def unit_of(self, i: int) -> int:
        return self._ids_host[i]

    def project(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """(len(tensors), K) float64 projections, in the order of ``tensors`` (a 0-dim tensor
        stands for a missing gradient: projections 0)."""
        return torch.stack([self.project_one(i, x) for i, x in enumerate(tensors)])

    def project_one(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """(K,) float64 projections of ``x``, laid out as tensor ``i`` (0 for a 0-dim stand-in):
        its ``rows_of(n)`` rows of ``w = width_of(n)`` elements, ``X^T s`` times ``r``, summed,
        plus the last, partial row's share."""
        numel = self.numels[i]
        if x.numel() != numel:  # the 0-dim stand-in of a missing gradient
            return torch.zeros(self.k, dtype=torch.float64, device=self.device)
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        flat = x.detach().reshape(-1)
        if flat.dtype != dtype:
            flat = flat.to(dtype)  # bf16/fp16: project in float32 (a bf16 sum has ~3 digits)
        w = width_of(numel)
        s, r = self.s_for(rows_of(numel), dtype), self._r_for(i, dtype)
        full = numel // w
        f = ((flat[:full * w].view(full, w).t() @ s[:full]) * r).sum(0)
        tail = numel - full * w
        if tail:
            f = f + s[full] * (flat[full * w:] @ r[:tail])
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
        layouts = _layouts(buckets)
        self._stage(flat, layouts).project_into(out[:, :self.k], flat, skip, settled=layouts is not None)
        return out if whole else out[:dropped]

    def _stage(self, flat: Sequence[torch.Tensor], layouts: tuple[staged.Layout, ...] | None = None) -> FusedProjections:
        """The fused projections' plan for the dtypes of ``flat`` (made at first use); for buckets
        of settled layouts, per set of layouts, from their shapes and dtypes (no read per tensor)."""
        key: tuple = layouts if layouts is not None else tuple([x.dtype for x in flat])
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= 4:
                self._plans.clear()
            if layouts is None:
                shapes, dtypes = [x.shape for x in flat], key
            else:
                shapes = [s for layout in layouts for s in layout.shapes]
                dtypes = tuple(layout.dtype for layout in layouts for _ in layout.shapes)
            plan = self._plans[key] = FusedProjections(self, shapes, dtypes, self._ids_host)
        return plan

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


def for_ranks(index: Any, world: int, left_out: Collection[int] = ()) -> Fingerprinter | None:
    """The fingerprinter comparing the ranks of ``index`` (a ``ParamIndex``): every layer on every
    rank without sharding; with DTensors, the replicas of each shard (``replica_units``); None
    when nothing is replicated (plain FSDP). ``left_out``: indices of parameters not compared
    (they differ by design: ``trainer_agent/measure/fingerprint_layouts.py``)."""
    if index.sharding is None:
        ids = index.layer_ids.tolist()
        ids = [-1 if i in left_out else u for i, u in enumerate(ids)] if left_out else ids
        if all(u < 0 for u in ids):
            return None
        return Fingerprinter([p.numel() for p in index.params], torch.tensor(ids) if left_out else index.layer_ids,
                             len(index.layers), device=index.device, names=index.layers)
    units = replica_units(index.params, index.layer_ids.tolist(), index.layers, world, index.device)
    if units is None:
        return None
    unit_of, names, groups = units
    unit_of = [-1 if i in left_out else u for i, u in enumerate(unit_of)]
    if all(u < 0 for u in unit_of):
        return None
    return Fingerprinter([t.numel() for b in index.buckets for t in b], torch.tensor(unit_of), len(names),
                         device=index.device, names=names, groups=groups)
