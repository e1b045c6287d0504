"""The fingerprints of a report step in two rounds: a whole-model screen in every report's gather,
the per-layer values only when the screens differ.

1. **Every report step.** Each rank's row of the report's gather carries its screen
   (``trainer_agent/measure/fingerprint_screen.py``: ``K + 1`` values per kind and replica layout,
   whatever the depth); its per-layer values stay on its device (made a row,
   ``Fingerprinter.row``, float32 pairs, only when they are gathered).
2. **Right after the gather** every rank holds every rank's screen and checks, with the same
   operations on the same values (so every rank reaches the same answer without a further
   message), whether any rank's screen differs from the first rank of its replica group by more
   than :data:`SCREEN_FRACTION` of the tolerance (non-finite against finite included). On CUDA
   rows the answer is read with the desired state, in one read (``RankExchange.head``).
3. **Only then** every rank sends its per-layer row to the leader (one ``gather``: the leader
   receives ``world x layers`` values; the others send theirs and receive nothing), and the leader
   compares them layer by layer (:func:`~trainer_agent.measure.desync.desync`), off the training
   thread: that report's per-rank ``*_desync`` values are the per-layer comparison's, exactly as
   without a screen, its ``*_desync_layer`` name the layer, and its ``desync`` findings the layers
   and ranks. Otherwise the per-rank ``*_desync`` values are the leader's comparison of the
   screens (below the threshold for every rank: within tolerance), and ``*_desync_layer`` is NaN
   (no layer was compared).

A rank whose report failed to build sends a row of NaN (``RankExchange.nan_row``: every field
NaN). Its fingerprints are no evidence of a desync: before the check and the comparisons its
screen and per-layer values are replaced by those of a rank of its replica group whose report
was built (:func:`stand_in`), and the leader reports NaN for it (no verdict), as for a rank left
without a replica to compare with. Without that, the NaN set that rank apart by an infinite
difference, and in a group of two ranks the other one too: a critical alert on a healthy run.

In sync the replicas' screens are bit-identical and a report step costs one gather of a few values
per rank whatever the depth; a difference costs that report step the per-layer gather to the
leader, which a difference that lasts (parameters that diverged) pays at every report.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch
import torch.distributed as dist

from trainer_agent.measure.desync import DesyncFinding, desync, findings
from trainer_agent.measure.fingerprint import Fingerprinter
from trainer_agent.measure.fingerprint_screen import Screen

__all__ = ["FingerprintRounds", "SCREEN_FRACTION", "failed_ranks"]

log = logging.getLogger(__name__)

#: A screen difference above this share of the tolerance sends the per-layer values.
SCREEN_FRACTION = 1 / 8


class FingerprintRounds:
    """The two rounds of one rank (see the module docstring). ``fp``: the per-layer fingerprints;
    ``world``/``rank``/``group``: the report exchange's; ``tol``: the desync tolerance."""

    def __init__(self, fp: Fingerprinter, *, world: int, rank: int, tol: float,
                 group: dist.ProcessGroup | None = None) -> None:
        self.fp = fp
        self.screen = Screen(fp)
        self.world, self.rank, self.tol, self.group = world, rank, tol, group
        self._values: tuple[int, torch.Tensor] | None = None  # (report step, its per-layer values)
        #: Report steps whose per-layer rows were gathered (every rank counts the same).
        self.detailed = 0
        # Per replica layout, for stand_in: (its index along axis 2 of the screens (2) or its units
        # along the layers (3), its groups of ranks (G, c)), as host arrays and on the device.
        sc, every = self.screen, np.arange(world).reshape(1, -1)
        self._host_sets: dict[int, list[tuple[object, np.ndarray]]] = (
            {2: [(slice(None), every)], 3: [(slice(None), every)]} if fp.groups is None else
            {2: list(enumerate(sc.host_groups)),
             3: [(units.cpu().numpy(), ranks) for (units, _), ranks in zip(fp.groups, sc.host_groups)]})
        self._device_sets = {axis: [(w if isinstance(w, (slice, int)) else torch.as_tensor(w, device=fp.device),
                                     torch.as_tensor(g, device=fp.device)) for w, g in sets]
                             for axis, sets in self._host_sets.items()}

    def row(self, step: int, grads: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        """This rank's screen for its row of ``step`` from the per-layer values of the gradients
        and the parameters (:meth:`Fingerprinter.layer_values`); their per-layer row is kept for
        :meth:`gather_detail`."""
        values = torch.stack([grads, params])
        self._values = (step, values)  # made a row (float32 pairs) only when gathered
        return self.screen.row(values)

    def differ(self, screens: torch.Tensor | np.ndarray, fields: torch.Tensor | np.ndarray) -> torch.Tensor | bool:
        """Every rank, on the gathered screens (world, :meth:`width`) and ``RANK_FIELDS``, where
        the gather left them: whether some rank's screen differs from its group's first rank's by
        more than ``tol * SCREEN_FRACTION``, a rank whose report failed (:func:`failed_ranks`)
        standing in as its group's. Host rows (gloo), as numpy arrays: a bool (in sync, one pass
        over the screens' bits and nothing more); device rows: a 0-dim bool tensor (no host read
        here)."""
        if not isinstance(screens, np.ndarray):
            return self.differ_on_device(screens, failed_ranks(fields))
        sc = self.screen
        above = self.tol * SCREEN_FRACTION
        values = screens.reshape(self.world, 2, sc.sets, sc.k + 1)
        if _same_bits(values, values[:1]):
            return False  # every rank's screen alike, bit for bit: no group can differ
        failed = failed_ranks(fields)
        if failed.any():
            values = stand_in(values.copy(), failed, self._host_sets[2])
        if sc.groups is None:
            return _apart_host(values, values[:1], above)
        return any(_apart_host(m, m[:, :1], above)
                   for m in (values[:, :, s][ranks] for s, ranks in enumerate(sc.host_groups)))

    def differ_on_device(self, screens: torch.Tensor, failed: torch.Tensor) -> torch.Tensor:
        """:meth:`differ` of rows on a device (any device: the CPU in the tests), as a 0-dim bool
        tensor, with device operators only (no branch on a value: no host read)."""
        sc = self.screen
        above = self.tol * SCREEN_FRACTION
        values = stand_in(screens.reshape(self.world, 2, sc.sets, sc.k + 1).clone(), failed, self._device_sets[2])
        if sc.groups is None:
            return _apart(values, values[:1], above)
        flags = []
        for s, (_, ranks) in enumerate(sc.groups):
            members = values[:, :, s][ranks.to(values.device)]  # (G, c, 2, K + 1)
            flags.append(_apart(members, members[:, :1], above))
        return torch.stack(flags).any()

    def _unjudged(self, failed: np.ndarray) -> np.ndarray:
        """The ranks without a verdict: those whose report ``failed``, and those left with no
        replica to be compared with in any of their groups."""
        if not failed.any():
            return failed
        judged = np.zeros(self.world, dtype=bool)
        for _, groups in self._host_sets[2]:
            ok = ~failed[groups]  # (G, c)
            judged[groups[(ok.sum(axis=1) >= 2)[:, None] & ok]] = True
        return ~judged

    def gather_detail(self, step: int, backend_device: torch.device) -> torch.Tensor | None:
        """Every rank, when :meth:`differ` said so: the per-layer row of report step ``step`` to
        the leader (NaN if this rank built none). The leader gets every rank's, (world, per-layer
        width) on ``backend_device``; the others None."""
        self.detailed += 1
        width = self.fp.width()
        kept, self._values = self._values, None
        row = (self.fp.row(kept[1][0], kept[1][1]) if kept is not None and kept[0] == step
               else torch.full((width,), math.nan, dtype=torch.float64))
        src = row.to(backend_device)
        # the leader's global rank (``group_dst`` came in a later torch than the agent supports)
        dst = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        if self.rank == 0:
            out = torch.empty(self.world, width, dtype=torch.float64, device=backend_device)
            dist.gather(src, list(out.unbind(0)), dst=dst, group=self.group)
            return out
        dist.gather(src, None, dst=dst, group=self.group)
        return None

    def compare(self, screens: torch.Tensor, detail: torch.Tensor | None, failed: torch.Tensor) -> torch.Tensor:
        """The leader's comparison of a report's gathered screens, and of its per-layer rows when
        they were gathered, the ``failed`` ranks (a bool tensor per rank) standing in as their
        group's: one float64 vector, the screens' part first (:meth:`decoder`)."""
        sc, fp = self.screen, self.fp
        # host values: only when a report failed; device values: always (no host read to choose)
        stand = bool(failed.any()) if failed.device.type == "cpu" else True
        sets = self._host_sets if screens.device.type == "cpu" else self._device_sets
        if stand:
            screens = stand_in(screens.reshape(self.world, 2, sc.sets, sc.k + 1).clone(), failed,
                               _on(sets[2], screens.device)).reshape(self.world, -1)
        compared = sc.compare(screens)
        if detail is None:
            return compared
        detail = detail.to(compared.device)
        if stand:
            pairs = detail.contiguous().view(torch.float32).view(self.world, 2, fp.layers, fp.k + 1).clone()
            detail = stand_in(pairs, failed.to(detail.device), _on(sets[3], detail.device)).reshape(
                self.world, -1).view(torch.float64)
        return torch.cat([compared, desync(detail, fp.layers, fp.k, fp.groups)])

    def decoder(self, step: int, detailed: bool):  # -> cross_rank.Decode
        """What turns :meth:`compare`'s host vector of the report of ``step`` into the per-rank
        vectors and the findings (logged as a warning)."""
        world, sets, tol, names = self.world, self.screen.sets, self.tol, self.fp.names
        screen_len = 2 * (3 * world + sets)

        def decode(flat: np.ndarray, matrix: np.ndarray) -> tuple[dict[str, list[float]], list[DesyncFinding]]:
            vectors, _ = findings(flat[:screen_len], world, [f"set{i}" for i in range(sets)], tol)
            unjudged = self._unjudged(failed_ranks(matrix))  # a report that failed to build
            if not detailed:
                for kind in ("grad", "param"):
                    vectors[f"{kind}_desync_layer"] = [math.nan] * world
                return _no_verdict(vectors, unjudged), []
            per_layer, found = findings(flat[screen_len:], world, names, tol)
            if found:
                log.warning("trainguard: ranks disagree at step %d (relative difference above %g): %s", step, tol,
                            "; ".join(f"{d.kind} of layer {d.layer!r} on rank(s) {list(d.ranks)}: {d.rel_diff:.3g}"
                                      for d in found[:8]))
            for kind in ("grad", "param"):  # the fingerprint stays the screen's: the whole model's
                for name in ("desync", "desync_layer"):
                    vectors[f"{kind}_{name}"] = per_layer[f"{kind}_{name}"]
            return _no_verdict(vectors, unjudged), found

        return decode


def failed_ranks(fields: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
    """Per rank, whether its row of ``fields`` (the gathered ``RANK_FIELDS``) is a report that
    failed to build (every field NaN: ``RankExchange.nan_row``): a numpy bool array for a numpy
    array, a bool tensor on the rows' device otherwise (no host read)."""
    if isinstance(fields, np.ndarray):
        return np.isnan(fields).all(axis=1)
    return fields.isnan().all(dim=1)


def stand_in(values, failed, sets):  # (torch.Tensor | np.ndarray) -> the same
    """``values`` (world, 2, units or sets, K + 1; a tensor or an array, changed in place)
    with each ``failed`` rank's values in each replica layout of ``sets`` ((index or units along
    axis 2, groups of ranks (G, c)), see :meth:`FingerprintRounds._sets`) replaced by those of the
    first rank of its group that did not fail (its own when all did). On a device: no host
    read."""
    host = isinstance(values, np.ndarray)
    if not host and len(sets) == 1 and isinstance(sets[0][0], slice) and sets[0][1].shape == (1, values.shape[0]):
        # one group of every rank, in order (data parallelism): the first rank that did not fail
        first = (~failed).to(torch.int8).argmax()
        return torch.where(failed.view(-1, *([1] * (values.dim() - 1))), values[first], values)
    lib = np if host else torch
    for where, groups in sets:
        ranks = groups if host else torch.as_tensor(groups, device=values.device)
        bad = failed[ranks]  # (G, c)
        first = (~bad).argmax(1) if host else (~bad).to(torch.int8).argmax(dim=1)  # the first that did not fail
        ref = ranks[lib.arange(ranks.shape[0]), first]  # (G,)
        source = lib.where(bad, ref[:, None], ranks)  # (G, c): whose values each member takes
        take = lib.arange(values.shape[0]) if host else torch.arange(values.shape[0], device=values.device)
        take[ranks.reshape(-1)] = source.reshape(-1)
        values[:, :, where] = values[take][:, :, where]
    return values


def _on(sets: list, device: torch.device) -> list:
    """``sets`` (host arrays, or tensors on the fingerprints' device) for values on ``device``."""
    return sets if all(isinstance(g, np.ndarray) or g.device == device for _, g in sets) else [
        (w if isinstance(w, (slice, int)) else torch.as_tensor(w, device=device), torch.as_tensor(g, device=device))
        for w, g in sets]


def _no_verdict(vectors: dict[str, list[float]], unjudged: np.ndarray) -> dict[str, list[float]]:
    """NaN in the per-rank fingerprint vectors of the ``unjudged`` ranks."""
    if unjudged.any():
        for name, values in vectors.items():
            if len(values) == len(unjudged):
                vectors[name] = np.where(unjudged, math.nan, values).tolist()
    return vectors


def _apart(x: torch.Tensor, ref: torch.Tensor, above: float) -> torch.Tensor:
    """Whether any value of ``x`` differs from ``ref`` (broadcast) by more than ``above``: equal
    values (NaN included: their difference is NaN, never above) do not, a NaN against a number
    does. Device values, without a branch (no sync)."""
    return (((x - ref).abs() > above) | (torch.isnan(x) ^ torch.isnan(ref))).any()


def _same_bits(x: np.ndarray, ref: np.ndarray) -> bool:
    """Whether ``x`` holds ``ref``'s (broadcast) float64 values bit for bit (NaN included)."""
    return bool((x.view(np.int64) == ref.view(np.int64)).all())


def _apart_host(x: np.ndarray, ref: np.ndarray, above: float) -> bool:
    """:func:`_apart` of host values: first by their bits (one pass: replicas in sync agree bit
    for bit), then value by value."""
    if _same_bits(x, ref):
        return False
    with np.errstate(invalid="ignore"):
        return bool(((np.abs(x - ref) > above) | (np.isnan(x) ^ np.isnan(ref))).any())
