"""The leader's job-level gauges of the replicas' agreement, from a resolved report's per-rank
fingerprint comparison (``grad_desync``/``param_desync`` and their ``*_desync_layer``:
``trainer_agent/report/fingerprint_rounds.py``): the largest relative difference across the
ranks and the rank and layer holding it. One series each whatever the world size (never one
per rank); none when the report carries no comparison.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from trainer_agent.report.exporter import sample_key

__all__ = ["agreement_gauges"]


def agreement_gauges(vectors: Mapping[str, list[float]], layer_names: Sequence[str]) -> dict[str, float]:
    """Sample keys -> values: per kind (``grad``, ``param``), ``trainguard_<kind>_desync_rel_diff``,
    the largest of the ranks' differences (ranks without a verdict, NaN, left out; NaN when no
    rank has one; Inf kept), and, when it is above 0, ``trainguard_<kind>_desync_rank`` with
    the layer of that rank (``layer_names`` by the ``*_desync_layer`` index; empty when no layer
    was compared). A kind whose vector is missing or empty gives nothing."""
    gauges: dict[str, float] = {}
    for kind in ("grad", "param"):
        diffs = np.asarray(vectors.get(f"{kind}_desync") or [], dtype=np.float64)
        if not diffs.size:
            continue
        judged = np.flatnonzero(~np.isnan(diffs))
        if not judged.size:
            gauges[f"trainguard_{kind}_desync_rel_diff"] = math.nan
            continue
        rank = int(judged[np.argmax(diffs[judged])])
        worst = float(diffs[rank])
        gauges[f"trainguard_{kind}_desync_rel_diff"] = worst
        if worst > 0:
            where = vectors.get(f"{kind}_desync_layer") or []
            at = float(where[rank]) if rank < len(where) else math.nan
            layer = layer_names[int(at)] if math.isfinite(at) and 0 <= at < len(layer_names) else ""
            gauges[sample_key(f"trainguard_{kind}_desync_rank", worst_layer=layer)] = float(rank)
    return gauges
