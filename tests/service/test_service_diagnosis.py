"""The diagnoses the alerts carry (``service/diagnosis.py``), checked against what real training
shows through the controller's API."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

import trainer_agent as ta
from tests.service.conftest import register
from trainguard.demo.model import ByteCorpus, TinyGPT, next_byte_loss, stdlib_source_bytes

CORPUS = ByteCorpus(stdlib_source_bytes(1 << 18), seq_len=32, batch_size=8)
LOST = 200  # the step before which the optimizer's second moments are lost


def _train(steps: int, lr: float, fault: Callable[[int, torch.optim.Optimizer], None]) -> list[dict[str, float]]:
    """A small GPT trained for real with AdamW at a steady LR (the agent attached, a report every
    step), ``fault(k, opt)`` called before each step ``k``; the agent's report after every step."""
    torch.manual_seed(0)
    model = TinyGPT(seq_len=32, d_model=32, n_layers=1, n_heads=2)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    agent = ta.attach(model, opt, job="job-a", run="run-1", config=ta.AgentConfig(metrics_port=None, report_every=1))
    rows = []
    try:
        for k in range(steps):
            fault(k, opt)
            ids, mask = CORPUS.batch(k, 0)
            loss = next_byte_loss(model, ids, mask)
            loss.backward()
            opt.step()
            opt.zero_grad()
            agent.end_step(loss.detach())
            rows.append({n: v for n, v in agent.latest().items() if "{" not in n})
    finally:
        agent.close(1.0)
    return rows


def _second_moments_lost(k: int, opt: torch.optim.Optimizer) -> None:
    """Before step ``LOST + 1`` Adam's second moments are scaled by 1e-8, as a bad load of the
    optimizer's state leaves them."""
    if k == LOST:
        for state in opt.state.values():
            state["exp_avg_sq"].mul_(1e-8)


def _alerts_and_incidents(app_factory, rows: list[dict[str, float]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:  # type: ignore[no-untyped-def]
    """``rows`` sent to a controller as the reports of a one-rank run; its alerts and incidents."""
    with app_factory() as c:
        register(c, world_size=1)
        for i, values in enumerate(rows):
            step = int(values["trainguard_step"])
            body = {"job": "job-a", "step_first": step, "step_last": step, "time": 1000.0 + i,
                    "values": {k: ("NaN" if isinstance(v, float) and math.isnan(v) else v) for k, v in values.items()}}
            assert c.post("/v1/runs/run-1/reports", json=body).status_code == 200
        return (c.get("/v1/alerts", params={"run": "run-1"}).json(), c.get("/v1/runs/run-1/incidents").json()["incidents"])


def test_an_update_that_jumps_with_the_lr_unchanged_is_told_to_reset_the_optimizer_state(app_factory) -> None:  # type: ignore[no-untyped-def]
    """The symptom table: a loss that rises after falling comes from an abnormal optimizer state,
    and its remedy is to reset the optimizer (or roll back). Lost second moments make the update
    per unit of LR jump with the LR and the gradient as they were: the alert on the update must
    name that cause and remedy, not only an LR too high."""
    rows = _train(LOST + 3, 2e-3, _second_moments_lost)
    before, after = rows[LOST - 1], rows[LOST]
    assert after["trainguard_scheduler_lr"] == before["trainguard_scheduler_lr"]  # the LR unchanged
    assert after["trainguard_grad_norm"] < 2 * before["trainguard_grad_norm"]  # the gradient too
    assert after["trainguard_update_ratio_per_lr"] > 20 * before["trainguard_update_ratio_per_lr"]
    alerts, incidents = _alerts_and_incidents(app_factory, rows)
    (spike,) = [a for a in alerts if a["rule"] == "update_ratio_spike"]
    causes, actions = spike["diagnosis"]["likely_causes"], spike["diagnosis"]["suggested_actions"]
    assert any(c.startswith("Abnormal optimizer state") for c in causes), causes
    assert any("reset the optimizer state" in a for a in actions), actions
    (incident,) = incidents
    assert incident["cause"] == "optimizer" and incident["onset_step"] == LOST + 1
    lr = [e for e in incident["verdict"]["evidence"] if e["signal"] == "trainguard_scheduler_lr"]
    assert lr and lr[0]["points_to"] == "none"  # the verdict's own reading: the LR where it was


def test_a_loss_that_rises_again_after_falling_is_not_told_to_raise_the_lr(app_factory) -> None:  # type: ignore[no-untyped-def]
    """The weight decay raised 1000x mid-run (an optimizer setting gone wrong): the loss, which
    fell for 150 steps, climbs back for the rest of the run without a spike. The plateau rule is
    the one that fires; its alert must say the loss rose and point at the optimizer's state, as
    the symptom table does for a loss that rises after falling, not only at an LR too small."""
    def decay_raised(k: int, opt: torch.optim.Optimizer) -> None:
        if k == 150:
            for group in opt.param_groups:
                group["weight_decay"] = 10.0

    rows = _train(300, 3e-3, decay_raised)
    loss = [r["trainguard_loss"] for r in rows]
    low = min(sum(loss[i:i + 25]) / 25 for i in range(0, 150, 25))
    assert sum(loss[-25:]) / 25 > 1.3 * low  # it fell, then climbed back
    alerts, _ = _alerts_and_incidents(app_factory, rows)
    (plateau,) = [a for a in alerts if a["rule"] == "loss_not_decreasing"]
    assert plateau["values"]["fitted_drop"] < 0
    assert plateau["summary"].startswith(f"trainguard_loss rose by {-plateau['values']['fitted_drop']:.6g} over 100 reports")
    causes, actions = plateau["diagnosis"]["likely_causes"], plateau["diagnosis"]["suggested_actions"]
    assert any("abnormal optimizer state" in c for c in causes), causes
    assert any(a.startswith("If the loss rose: reset the optimizer state") for a in actions), actions
