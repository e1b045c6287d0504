"""This rank's row of the report step's exchange (``trainer_agent/ranks.py``), filled from the
per-rank values' declarations (``trainguard.protocol.rank_values.RANK_VALUES``): a row value is its
catalogue metric's report value on this rank (NaN when the report lacks it), or, for the few that
are no catalogue metric, computed by its getter in :data:`ROW_GETTERS`. A row value with neither,
or a getter of no row value, fails at import."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from trainguard.protocol.rank_values import ROW_VALUES, RankValueSpec
from trainer_agent.step_stats import StepState, unscale

__all__ = ["RowInputs", "ROW_GETTERS", "row_plan", "rank_row"]


@dataclass(frozen=True, slots=True)
class RowInputs:
    """What the computed row values are made of."""

    st: StepState
    gpu_xid: float
    """Last critical XID code of this rank's GPU in the interval (0: none; NaN: not watched)."""
    full: Callable[[float], torch.Tensor]
    """``full(x)``: a 0-dim float64 tensor of ``x`` on the report's device."""
    zero: torch.Tensor


Getter = Callable[[RowInputs], torch.Tensor]


def _micro_sq_sum(r: RowInputs) -> torch.Tensor:
    micro = r.st.micro_norms
    return unscale(torch.linalg.vector_norm(torch.stack(micro)).square() if micro else r.zero, r.st.scale, power=2)


#: The row values that are no catalogue metric's report value, computed here.
ROW_GETTERS: dict[str, Getter] = {
    "micro_sq_sum": _micro_sq_sum,
    "micro_count": lambda r: r.full(len(r.st.micro_norms)),
    "gpu_xid": lambda r: r.full(r.gpu_xid),
}


def row_plan(values: Sequence[RankValueSpec], getters: Mapping[str, Getter]) -> tuple[tuple[str | None, Getter | None], ...]:
    """(metric, getter) per row value, in order; ``ValueError`` for a row value with neither a
    catalogue metric nor a getter, and for a getter of no computed row value."""
    computed = {s.field for s in values if s.metric is None}
    missing, stray = sorted(computed - set(getters)), sorted(set(getters) - computed)
    if missing:
        raise ValueError(f"row values without a catalogue metric need a getter in ROW_GETTERS: {', '.join(missing)}")
    if stray:
        raise ValueError(f"ROW_GETTERS has getters for no computed row value: {', '.join(stray)}")
    return tuple((s.metric, getters.get(s.field)) for s in values)


_PLAN = row_plan(ROW_VALUES, ROW_GETTERS)


def rank_row(dev: Mapping[str, torch.Tensor], host: Mapping[str, float], inputs: RowInputs) -> torch.Tensor:
    """This rank's row values (float64 device vector in ``RANK_FIELDS`` order): ``dev`` holds the
    report's device values, ``host`` its host values, both by sample key."""
    full = inputs.full
    return torch.stack([getter(inputs) if getter is not None else dev[metric] if metric in dev  # type: ignore[index]
                        else full(host.get(metric, math.nan))  # type: ignore[arg-type]
                        for metric, getter in _PLAN])
