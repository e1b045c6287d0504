"""The whole-model fingerprint that every report step's row carries, in place of one per layer.

A rank's per-layer fingerprints (``trainer_agent/measure/fingerprint.py``: ``K`` projections and
the norm of every unit) grow with the model's depth: 131 layers put 393 float64 slots in every
rank's row of the report step's gather, 128 MB received by every rank of a 32,768-rank job. The
*screen* folds them into ``K`` values per kind (gradients, parameters) and per replica layout (a
set of units compared by the same groups of ranks; one under data parallelism)::

    screen_k(set) = sum over the set's units u of  a_k(u) * f_k(u) / ||x_u||

    screen_K(set) = sum over the set's units u of  a_K(u) * log ||x_u||

with fixed signs ``a_k(u)`` in {-1, +1} (drawn alike on every rank). Each unit's projection is
divided by its own norm first, so a difference confined to one unit moves the screen by that
unit's relative difference (``f_k`` moves by exactly the perturbation, see fingerprint.py; the
norm's own change adds a term of the order of the perturbed element's share of the norm, about
1 % in the tests). A unit scaled as a whole (a gradient multiplied by a wrong factor on one rank)
leaves ``f_k / ||x||`` as it is and moves its log-norm term by the relative scale. The
screen's difference between two ranks is thus about the per-layer comparison's value whenever
one layer differs, and two differing layers would have to cancel in every one of the ``K + 1``
independently signed sums to go unseen. Replicas in sync compute the same kernels on the same
values and agree on it bit for bit, as on the per-layer values it is made of.

The leader compares the screens with :func:`~trainer_agent.measure.desync.desync` (each set one
*unit* of ``K + 1`` projections and norm 1), for the report's per-rank ``*_desync`` and ``*_fingerprint`` vectors; the
per-layer values of a report step are gathered only when a screen differs
(``trainer_agent/report/fingerprint_rounds.py``), which names the layers.
"""

from __future__ import annotations

import torch

from trainer_agent.measure.desync import desync
from trainer_agent.measure.fingerprint import SEED, Fingerprinter

__all__ = ["Screen", "screen_width"]


def screen_width(fp: Fingerprinter) -> int:
    """float64 values of one rank's screen of ``fp``'s units: ``2 * sets * (K + 1)``."""
    return 2 * (len(fp.groups) if fp.groups is not None else 1) * (fp.k + 1)


class Screen:
    """The screen of one :class:`Fingerprinter`'s units (see the module docstring).

    ``sets``: how many replica layouts (one per group set of ``fp.groups``; one without groups);
    ``groups``: the ranks compared in each set, in :func:`desync`'s form (None: every rank)."""

    def __init__(self, fp: Fingerprinter) -> None:
        self.k = fp.k
        device = fp.device
        unit_sets = [units.tolist() for units, _ in fp.groups] if fp.groups is not None else [list(range(fp.layers))]
        self.sets = len(unit_sets)
        signs = torch.randint(0, 2, (fp.layers, fp.k + 1), generator=torch.Generator().manual_seed(SEED - 1),
                              dtype=torch.int8).to(torch.float64).mul_(2).sub_(1)
        pairs = [(s, u) for s, units in enumerate(unit_sets) for u in units]  # a unit may serve several sets
        #: per (set, unit) pair: the unit, its signs (K + 1), its set; summed without a product by 0 (a
        #: non-finite unit stays in its own sets)
        self._unit = torch.tensor([u for _, u in pairs], dtype=torch.long, device=device)
        self._signs = signs[[u for _, u in pairs]].to(device)
        self._set = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=device)
        #: one set of every unit in order (data parallelism): summed without an index
        self._whole = unit_sets == [list(range(fp.layers))]
        self._zeros = torch.zeros(2, self.sets, fp.k + 1, dtype=torch.float64, device=device)  # never written
        self.groups = None if fp.groups is None else [
            (torch.tensor([s], dtype=torch.long, device=ranks.device), ranks) for s, (_, ranks) in enumerate(fp.groups)]
        #: each set's groups of ranks as host arrays (G, c) (the check of host rows)
        self.host_groups = [] if fp.groups is None else [ranks.cpu().numpy() for _, ranks in fp.groups]

    def width(self) -> int:
        """float64 values of one rank's screen (:meth:`row`): ``2 * sets * (K + 1)``."""
        return 2 * self.sets * (self.k + 1)

    def row(self, values: torch.Tensor) -> torch.Tensor:
        """This rank's screen from ``values`` (2, units, K + 1): the gradients' and the parameters'
        :meth:`Fingerprinter.layer_values`, stacked: (2, sets, K + 1) float64, flattened."""
        k = self.k
        norms = values[..., k:].clamp_min(1e-30)  # (2, units, 1); a unit of norm 0 (no tensor there): 0 / 1e-30
        terms = values / norms  # (2, units, K + 1): the projections over the norm, then 1 ...
        torch.log(norms, out=terms[..., k:])  # ... where the log-norm goes
        if self._whole:
            return (terms * self._signs).sum(dim=1).view(-1)  # (2, 1, K + 1) flattened
        terms = terms.index_select(1, self._unit) * self._signs  # (2, pairs, K + 1)
        return torch.index_add(self._zeros, 1, self._set, terms).view(-1)  # (2, sets, K + 1): out of place

    def compare(self, rows: torch.Tensor) -> torch.Tensor:
        """The leader's comparison of the gathered screens ``rows`` (world, :meth:`width`):
        :func:`desync`'s vector over the sets, each a unit of ``K + 1`` projections of norm 1
        (per rank the largest difference and its set, and projection 0 summed over the sets: the
        rank's whole-model fingerprint)."""
        values = rows.reshape(rows.shape[0], 2, self.sets, self.k + 1)
        ones = torch.ones(*values.shape[:3], 1, dtype=values.dtype, device=values.device)
        return desync(torch.cat([values, ones], dim=3).reshape(rows.shape[0], -1), self.sets, self.k + 1, self.groups)
