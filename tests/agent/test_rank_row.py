"""trainer_agent/report/rank_row.py: this rank's row of the report step filled from the per-rank values'
declarations — each value its catalogue metric's report value (NaN when absent) or its getter's —
checked against a row written out by hand; a row value with neither a metric nor a getter, or a
getter of no row value, is refused (at import for the shipped declarations)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from trainguard.protocol.rank_values import ROW_VALUES, RankValueSpec
from trainer_agent.report.rank_row import ROW_GETTERS, RowInputs, rank_row, row_plan
from trainer_agent.report.exchange import RANK_FIELDS
from trainer_agent.measure.step_state import StepState

F64 = torch.float64


def _scalar(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


def test_the_row_is_each_values_metric_or_getter_in_rank_fields_order() -> None:
    st = StepState()
    st.micro_norms = [_scalar(3.0), _scalar(4.0)]
    st.scale = _scalar(2.0)  # the micro-batch norms carry the loss scale: the sum is divided by its square
    dev = {"trainguard_loss": _scalar(2.5), "trainguard_grad_norm": _scalar(7.0),
           "trainguard_nonfinite_steps_total": _scalar(1.0), "trainguard_param_norm": _scalar(11.0)}
    host = {"trainguard_step_duration_seconds": 0.25, "trainguard_forward_seconds": 0.125,
            "trainguard_tokens_per_second": 4096.0, "trainguard_comm_seconds": 0.5,
            "trainguard_comm_exposed_ratio": 0.0625}  # no input wait, no verify check in the interval
    row = rank_row(dev, host, RowInputs(st, 79.0, lambda x: torch.full((), x, dtype=F64), _scalar(0.0)))
    expected = {
        "step_duration_seconds": 0.25, "loss": 2.5, "grad_norm": 7.0, "forward_seconds": 0.125,
        "input_wait_seconds": math.nan, "verify_mismatch": math.nan, "verify_float32": math.nan, "gpu_xid": 79.0,
        "micro_sq_sum": (9.0 + 16.0) / 4.0, "micro_count": 2.0, "nonfinite_steps_total": 1.0,
        "tokens_per_second": 4096.0, "param_norm": 11.0, "comm_seconds": 0.5, "comm_exposed_ratio": 0.0625,
    }
    assert set(RANK_FIELDS) == set(expected)
    got = dict(zip(RANK_FIELDS, row.tolist()))
    for field, want in expected.items():
        assert got[field] == want or (math.isnan(want) and math.isnan(got[field])), field


def test_a_row_value_without_a_metric_needs_a_getter() -> None:
    new = RankValueSpec("new_value", "1", "a value computed by the agent", "row")
    with pytest.raises(ValueError, match="row values without a catalogue metric need a getter in ROW_GETTERS: new_value"):
        row_plan(ROW_VALUES + (new,), ROW_GETTERS)
    with pytest.raises(ValueError, match="ROW_GETTERS has getters for no computed row value: gone"):
        row_plan(ROW_VALUES, {**ROW_GETTERS, "gone": ROW_GETTERS["micro_count"]})
    plan = row_plan(ROW_VALUES + (new,), {**ROW_GETTERS, "new_value": ROW_GETTERS["micro_count"]})
    assert len(plan) == len(RANK_FIELDS) + 1 and plan[-1] == (None, ROW_GETTERS["micro_count"])


def test_importing_the_row_fails_for_a_declared_row_value_without_a_getter() -> None:
    code = ("import trainguard.protocol.rank_values as rv\n"
            "rv.ROW_VALUES += (rv.RankValueSpec('new_value', '1', 'computed by the agent', 'row'),)\n"
            "import trainer_agent.report.rank_row\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().endswith(
        "ValueError: row values without a catalogue metric need a getter in ROW_GETTERS: new_value")
