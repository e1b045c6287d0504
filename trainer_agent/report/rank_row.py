"""This rank's row of the report step's exchange (``trainer_agent/report/exchange.py``), filled from the
per-rank values' declarations (``trainguard.protocol.rank_values.RANK_VALUES``): a row value is its
catalogue metric's report value on this rank (NaN when the report lacks it), or, for the few that
are no catalogue metric, computed by its getter in :data:`ROW_GETTERS`. A row value with neither,
or a getter of no row value, fails at import.

The row costs a constant few operators whatever its width: the device values stacked once, the
host values (a getter may return a host float) in one small host tensor, and one gather that puts
each in its place."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from trainguard.protocol.rank_values import ROW_VALUES, RankValueSpec
from trainer_agent.measure.step_state import StepState, unscale

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


#: A row value from the inputs: a 0-dim device tensor, or a host float.
Getter = Callable[[RowInputs], "torch.Tensor | float"]


def _micro_sq_sum(r: RowInputs) -> torch.Tensor:
    micro = r.st.micro_norms
    if not micro:
        return unscale(r.zero, r.st.scale, power=2)
    norms = torch.stack(micro)
    return unscale(torch.dot(norms, norms), r.st.scale, power=2)  # the sum of squares: one operator


#: The row values that are no catalogue metric's report value, computed here.
ROW_GETTERS: dict[str, Getter] = {
    "micro_sq_sum": _micro_sq_sum,
    "micro_count": lambda r: float(len(r.st.micro_norms)),
    "gpu_xid": lambda r: r.gpu_xid,
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
    values = [getter(inputs) if getter is not None else dev[metric] if metric in dev  # type: ignore[index]
              else host.get(metric, math.nan)  # type: ignore[arg-type]
              for metric, getter in _PLAN]
    on_device = tuple(isinstance(v, torch.Tensor) for v in values)
    device = inputs.zero.device
    parts = []
    if any(on_device):
        parts.append(torch.stack([v for v, d in zip(values, on_device) if d]).to(torch.float64))  # type: ignore[misc]
    if not all(on_device):
        floats = torch.tensor([float(v) for v, d in zip(values, on_device) if not d], dtype=torch.float64)
        # non_blocking: a copy from pageable memory is staged at once; no wait on the device
        parts.append(floats.to(device, non_blocking=True))
    if len(parts) == 1:
        return parts[0]  # one kind only: already in order
    return torch.cat(parts).index_select(0, _placement(on_device, device))


_PLACEMENTS: dict[tuple[tuple[bool, ...], torch.device], torch.Tensor] = {}


def _placement(on_device: tuple[bool, ...], device: torch.device) -> torch.Tensor:
    """Where each row value is in ``cat([device values, host values])`` (cached per layout)."""
    key = (on_device, device)
    at = _PLACEMENTS.get(key)
    if at is None:
        dev_at, host_at = iter(range(sum(on_device))), iter(range(sum(on_device), len(on_device)))
        order = [next(dev_at) if d else next(host_at) for d in on_device]
        at = _PLACEMENTS[key] = torch.tensor(order, dtype=torch.long, device=device)
    return at
