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

Replicas in sync run the same kernels on the same values and get bit-identical fingerprints.

The ranks' fingerprints travel in the report step's one collective (``trainer_agent/ranks.py``,
the row's tail); :func:`desync` compares them on the device: a rank's difference is taken against
both middle values of the ranks (the median for an odd count), so with one bad rank among three
or more only that rank is named, and with two ranks both are (nothing tells which one is wrong).

Sharded parameters (DTensors: HSDP, tensor parallel, TP inside data parallelism) are compared
where their placements replicate them (``trainer_agent/sharding.py``, ``replica_units``): the
ranks whose mesh coordinates agree on every ``Shard`` dimension hold the same local shard. Each
rank projects its *local* tensors (the weights of a tensor depend only on its index and its local
size, so identical shards give identical fingerprints); a *unit* is one layer's parameters with
the same replica layout, and :func:`desync` compares each unit within each group of replicas, on
the rows the report's gather already carries (no further collective). A gradient whose placements
are not its parameter's (a ``Partial`` sum still pending, as for a sequence-parallel norm) is left
out of the gradient comparison. Plain FSDP (every rank a different shard) has nothing to compare:
no fingerprint.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trainer_agent import stats
from trainer_agent.sharding import replica_units

__all__ = ["TILE", "SEED", "Fingerprinter", "DesyncFinding", "desync", "findings", "for_ranks", "rel_diff"]

#: Elements per row of the rank-1 sign pattern.
TILE = 4096
#: Seed of the sign patterns: the same on every rank.
SEED = 0x5EED_F1A9


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
        self._keep = [i for i, u in enumerate(ids.tolist()) if u >= 0]
        self._all = len(self._keep) == len(numels)
        self._keep_index = torch.tensor(self._keep, dtype=torch.long, device=device)
        self.layer_ids = self._ids if self._all else self._ids[self._keep_index]
        self.device = device
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

    def layer_values(self, buckets: Sequence[Sequence[torch.Tensor]], skip: Collection[int] = ()) -> torch.Tensor:
        """(units, K + 1) float64 device tensor: the K projections of each unit and its L2 norm
        (one fused norm per bucket). Tensors of no unit, and those whose index is in ``skip``,
        are left out (not projected, norm 0)."""
        flat = [t for b in buckets for t in b]
        norms = stats.bucket_norms(buckets, self.device).to(torch.float64)
        if self._all and not skip:
            proj, ids = self.project(flat), self.layer_ids
        else:
            keep, index = self._keep, self._keep_index
            if skip:
                keep = [i for i in keep if i not in skip]
                index = torch.tensor(keep, dtype=torch.long, device=self.device)
            proj = torch.stack([self.project_one(i, flat[i]) for i in keep]) if keep \
                else torch.zeros(0, self.k, dtype=torch.float64, device=self.device)
            norms, ids = norms[index], self._ids[index]
        cols = torch.cat([proj, (norms * norms).unsqueeze(1)], dim=1)
        per_layer = torch.zeros(self.layers, self.k + 1, dtype=torch.float64, device=self.device)
        per_layer.index_add_(0, ids, cols)
        per_layer[:, self.k].sqrt_()
        return per_layer

    def width(self) -> int:
        """Values of one rank's fingerprint part of the report row: gradients and parameters."""
        return 2 * self.layers * (self.k + 1)


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


def desync(rows: torch.Tensor, layers: int, k: int,
           groups: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None) -> torch.Tensor:
    """Compare the gathered fingerprint parts ``rows`` (world, 2 * layers * (k + 1)) on the
    device. Returns one float64 vector::

        [grad: per rank max rel. diff (W), per rank worst layer (W), per rank projection 0 summed (W),
               per layer max rel. diff over ranks (layers)]
        [param: the same]

    ``groups``: which ranks must agree in which units (layers), as pairs ``(units, ranks)``:
    ``units`` a long tensor of unit indices, ``ranks`` a (G, c) long tensor, G groups of c ranks
    each; every group's ranks are compared with each other in those units, and a rank in no group
    of a unit differs by 0 there. Default: one group of every rank in every unit (data
    parallelism). Sharded parameters compare their replicas only (``replica_units``).

    The relative difference of rank r in a layer is ``max_k |f_k(r) - ref_k| / ||x_layer||``
    against both middle values ``ref`` of its group, over the group's median norm; identical
    values (non-finite included) differ by 0, a non-finite value against a finite one by inf."""
    world = rows.shape[0]
    parts = rows.reshape(world, 2, layers, k + 1)
    if groups is None:
        groups = [(torch.arange(layers, device=rows.device), torch.arange(world, device=rows.device).view(1, world))]
    out = []
    for kind in range(2):
        f = parts[:, kind, :, :k]  # (W, L, K)
        norm = parts[:, kind, :, k]  # (W, L)
        rel = torch.zeros(world, layers, dtype=torch.float64, device=rows.device)
        for units, ranks in groups:
            c = ranks.shape[1]
            fg = f[:, units][ranks]  # (G, c, U, K)
            s_f = fg.sort(dim=1).values
            lo, hi = s_f[:, (c - 1) // 2].unsqueeze(1), s_f[:, c // 2].unsqueeze(1)
            den = norm[:, units][ranks].sort(dim=1).values[:, (c - 1) // 2].clamp_min(1e-30).unsqueeze(1)
            r = torch.maximum(_rel(fg, lo, den), _rel(fg, hi, den)).amax(dim=3)  # (G, c, U)
            rel[ranks.reshape(-1, 1), units.view(1, -1)] = r.reshape(-1, units.numel())
        worst, layer = rel.max(dim=1)
        out += [worst, layer.to(torch.float64), f[:, :, 0].sum(dim=1), rel.amax(dim=0)]
    return torch.cat(out)


def rel_diff(f: torch.Tensor, ref: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``|f - ref| / den`` (den broadcast over the last axis), 0 where both are equal (NaN
    included), inf where only one is NaN or the difference is over a zero norm."""
    return _rel(f, ref, den)


def _rel(f: torch.Tensor, ref: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    same = (f == ref) | (torch.isnan(f) & torch.isnan(ref))
    diff = (f - ref).abs() / den.unsqueeze(-1)
    diff = torch.where(torch.isnan(diff), math.inf, diff)
    return torch.where(same, 0.0, diff)


@dataclass(frozen=True, slots=True)
class DesyncFinding:
    """One layer whose fingerprint differs across ranks by more than the tolerance."""

    kind: str  # "grad" or "param"
    layer: str
    rel_diff: float
    ranks: tuple[int, ...]


def findings(flat: Sequence[float], world: int, layer_names: Sequence[str], tol: float
             ) -> tuple[dict[str, list[float]], list[DesyncFinding]]:
    """Host side of :func:`desync`'s vector: the per-rank vectors (``grad_desync``,
    ``grad_desync_layer``, ``grad_fingerprint`` and the ``param_`` ones) and the layers above
    ``tol`` (worst first; a layer names the ranks whose worst layer it is, or every rank above
    ``tol`` when none is)."""
    n_layers = len(layer_names)
    per = 3 * world + n_layers
    vectors: dict[str, list[float]] = {}
    found: list[DesyncFinding] = []
    for i, kind in enumerate(("grad", "param")):
        seg = list(flat[i * per:(i + 1) * per])
        worst, layer, fp, by_layer = (seg[:world], seg[world:2 * world], seg[2 * world:3 * world],
                                      seg[3 * world:])
        vectors[f"{kind}_desync"] = worst
        vectors[f"{kind}_desync_layer"] = layer
        vectors[f"{kind}_fingerprint"] = fp
        bad_ranks = tuple(r for r in range(world) if worst[r] > tol)
        for j, v in enumerate(by_layer):
            if v > tol:
                named = tuple(r for r in bad_ranks if int(layer[r]) == j) or bad_ranks
                found.append(DesyncFinding(kind, layer_names[j], v, named))
    found.sort(key=lambda d: -d.rel_diff)
    return vectors, found
