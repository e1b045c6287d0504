"""The leader's comparison of the ranks' fingerprints (``trainer_agent/measure/fingerprint.py`` makes
them): :func:`desync` takes the gathered fingerprint parts of every rank and gives each rank's
largest relative difference from the middle values of its group of replicas, the unit (layer)
where it is, and each unit's largest; :func:`findings` turns that into the report's per-rank
vectors and the layers above the tolerance (``DesyncFinding``).

A rank's difference is taken against both middle values of its group (the median for an odd
count), so with one bad rank among three or more only that rank is named, and with two ranks both
are (nothing tells which one is wrong). Host rows are compared in O(W log W) when most ranks of a
group agree bit for bit; rows on a device by sorting, with no host read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["DesyncFinding", "desync", "findings", "rel_diff"]


def desync(rows: torch.Tensor, layers: int, k: int,
           groups: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None, *, by_sorting: bool = False
           ) -> torch.Tensor:
    """Compare the gathered fingerprint parts ``rows`` (world, 2 * layers * (k + 1)) float64 values,
    or (world, layers * (k + 1)) slots of float32 pairs: :meth:`Fingerprinter.row`), on their
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
    values (non-finite included) differ by 0, a non-finite value against a finite one by inf.

    Host rows are compared in O(W log W) per unit set when most ranks of a group agree (see
    :func:`_majority_rel`: only the ranks that differ are compared element by element); rows on a
    device (or with ``by_sorting``) by sorting each group's values, with no host read."""
    world = rows.shape[0]
    packed = rows.shape[1] == layers * (k + 1)  # float32 pairs (Fingerprinter.row)
    if not packed and rows.shape[1] != 2 * layers * (k + 1):
        raise ValueError(f"fingerprint rows of {layers} units and {k} projections have {layers * (k + 1)} "
                         f"(packed) or {2 * layers * (k + 1)} values, got {rows.shape[1]}")
    if rows.device.type == "cpu" and not by_sorting:
        return _host_desync(rows.contiguous().view(torch.float32) if packed else rows, layers, k, groups)
    if groups is None:
        groups = [(torch.arange(layers, device=rows.device), torch.arange(world, device=rows.device).view(1, world))]
    if packed:
        rows = rows.contiguous().view(torch.float32).to(torch.float64)
    parts = rows.reshape(world, 2, layers, k + 1)
    rel = torch.zeros(2, world, layers, dtype=torch.float64, device=rows.device)
    for units, ranks in groups:  # sorted, without a branch on a device value (no sync)
        for kind in range(2):
            x = parts[:, kind, units][ranks]  # (G, c, U, K + 1)
            rel[kind, ranks.reshape(-1, 1), units.view(1, -1)] = _sorted_rel(x[..., :k], x[..., k]
                                                                             ).reshape(-1, units.numel())
    out = []
    for kind in range(2):
        worst, layer = rel[kind].max(dim=1)
        out += [worst, layer.to(torch.float64), parts[:, kind, :, 0].sum(dim=1), rel[kind].amax(dim=0)]
    return torch.cat(out)


def _sorted_rel(fg: torch.Tensor, ng: torch.Tensor) -> torch.Tensor:
    """(G, c, U): each rank's largest relative difference over the K projections against both
    middle values of its group, per unit (``fg``: (G, c, U, K) projections, ``ng``: (G, c, U)
    norms)."""
    c = fg.shape[1]
    s_f = fg.sort(dim=1).values
    lo, hi = s_f[:, (c - 1) // 2].unsqueeze(1), s_f[:, c // 2].unsqueeze(1)
    den = ng.sort(dim=1).values[:, (c - 1) // 2].clamp_min(1e-30).unsqueeze(1)
    return torch.maximum(_rel(fg, lo, den), _rel(fg, hi, den)).amax(dim=3)


def _host_desync(values: torch.Tensor, layers: int, k: int,
                 groups: Sequence[tuple[torch.Tensor, torch.Tensor]] | None) -> torch.Tensor:
    """:func:`desync` of host rows (``values``: (W, 2 * layers * (k + 1)) float32 or float64), in
    O(W log W) per group set when a group's ranks mostly agree. In a group where more than half
    the ranks hold the same bits (projections and norms of every unit, both kinds), both middle
    values and the median norm are theirs: those ranks differ by 0 and any other rank differs
    from them alone. The ranks of each group are ordered by the sum of their values (equal rows,
    equal keys; a key serves speed only: a candidate outside the majority is seen as no
    majority), the middle one is the candidate, every rank is
    compared with it bit for bit (one linear pass over the rows), and only the ranks that differ
    are compared value by value; a group without such a majority is compared by sorting, as on
    a device. Nothing of size (W, layers) is made unless that many ranks differ."""
    world = values.shape[0]
    parts = values.view(world, 2, layers, k + 1)
    words = values.view(torch.int32).view(world, 2, layers, -1)
    updates: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (ranks, units, (D, 2, U) rel)
    if groups is None:  # one group: every rank in every unit, compared as whole rows of 64-bit words
        x, key = values.view(torch.int64).view(1, world, -1), values.sum(dim=1).view(1, world)
        updates += _group_updates(parts, x, key, torch.arange(layers), torch.arange(world).view(1, world), k)
    for units, ranks in groups or ():
        G, c = ranks.shape
        x = words[:, :, units][ranks.reshape(-1)].view(G, c, -1)
        key = parts[:, :, units].sum(dim=(1, 2, 3))[ranks]
        updates += _group_updates(parts, x, key, units, ranks, k)
    worst, where, by_layer = _spread(updates, world, layers)
    fingerprint = parts[..., 0].to(torch.float64).sum(dim=2).t()  # (2, W): projection 0 summed
    per_rank = torch.stack([worst, where, fingerprint], dim=1).view(2, 3 * world)
    return torch.cat([per_rank, by_layer], dim=1).view(-1)


def _group_updates(parts: torch.Tensor, x: torch.Tensor, key: torch.Tensor, units: torch.Tensor, ranks: torch.Tensor,
                   k: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The relative differences of the ranks of one group set (``ranks``: (G, c)) in ``units``:
    ``x`` their values as words (G, c, -1), ``key`` the sort key of each (G, c). Ranks agreeing
    bit for bit with a majority are left out (they differ by 0)."""
    G, c = ranks.shape
    updates = []
    pick = key.argsort(dim=1)[:, (c - 1) // 2]
    same = (x == x[torch.arange(G), pick].unsqueeze(1)).all(dim=2)  # (G, c)
    agree = same.sum(dim=1) * 2 > c
    differ = (~same & agree.unsqueeze(1)).nonzero()
    if differ.numel():
        gi, mi = differ[:, 0], differ[:, 1]
        mine = parts[ranks[gi, mi]][:, :, units].to(torch.float64)  # (D, 2, U, K + 1)
        ref = parts[ranks[gi, pick[gi]]][:, :, units].to(torch.float64)
        rel = _rel(mine[..., :k], ref[..., :k], ref[..., k].clamp_min(1e-30)).amax(dim=3)
        updates.append((ranks[gi, mi], units, rel))
    if not bool(agree.all()):
        sub = ranks[(~agree).nonzero().view(-1)]  # (G', c)
        x64 = parts[:, :, units][sub.reshape(-1)].to(torch.float64)  # (G' c, 2, U, K + 1)
        rel = torch.stack([_sorted_rel(x64[:, kind, :, :k].view(*sub.shape, -1, k),
                                       x64[:, kind, :, k].view(*sub.shape, -1)).reshape(sub.numel(), -1)
                           for kind in range(2)], dim=1)
        updates.append((sub.reshape(-1), units, rel))
    return updates


def _spread(updates: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], world: int, layers: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per kind, each rank's worst relative difference and its unit, and each unit's worst, from
    the differing ranks' ``updates`` (0 elsewhere)."""
    worst = torch.zeros(2, world, dtype=torch.float64)
    where = torch.zeros(2, world, dtype=torch.float64)
    by_layer = torch.zeros(2, layers, dtype=torch.float64)
    if updates:
        touched = torch.cat([u[0] for u in updates]).unique()
        rel = torch.zeros(2, touched.numel(), layers, dtype=torch.float64)
        for ranks_, units, r in updates:
            rel[:, torch.searchsorted(touched, ranks_).view(-1, 1), units.view(1, -1)] = r.transpose(0, 1)
        top, at = rel.max(dim=2)
        worst[:, touched], where[:, touched] = top, at.to(torch.float64)
        by_layer = rel.amax(dim=1)
    return worst, where, by_layer


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


def findings(flat: Sequence[float] | np.ndarray, world: int, layer_names: Sequence[str], tol: float
             ) -> tuple[dict[str, list[float]], list[DesyncFinding]]:
    """Host side of :func:`desync`'s vector (a sequence or a float64 array): the per-rank vectors
    (``grad_desync``, ``grad_desync_layer``, ``grad_fingerprint`` and the ``param_`` ones) and
    the layers above ``tol`` (worst first; a layer names the ranks whose worst layer it is, or
    every rank above ``tol`` when none is). Array operations: no Python loop over the ranks."""
    n_layers = len(layer_names)
    per = 3 * world + n_layers
    values = np.asarray(flat, dtype=np.float64)
    vectors: dict[str, list[float]] = {}
    found: list[DesyncFinding] = []
    for i, kind in enumerate(("grad", "param")):
        seg = values[i * per:(i + 1) * per]
        worst, layer, fp, by_layer = (seg[:world], seg[world:2 * world], seg[2 * world:3 * world],
                                      seg[3 * world:])
        vectors[f"{kind}_desync"] = worst.tolist()
        vectors[f"{kind}_desync_layer"] = layer.tolist()
        vectors[f"{kind}_fingerprint"] = fp.tolist()
        bad_ranks = np.flatnonzero(worst > tol)  # NaN: no verdict
        bad_layers = layer[bad_ranks]
        for j in np.flatnonzero(by_layer > tol).tolist():
            named = bad_ranks[bad_layers == j]
            found.append(DesyncFinding(kind, layer_names[j], float(by_layer[j]),
                                       tuple((named if named.size else bad_ranks).tolist())))
    found.sort(key=lambda d: -d.rel_diff)
    return vectors, found
