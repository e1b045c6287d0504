"""The diagnoses the alerts carry (``service/diagnosis.py``), checked against what real training
shows through the controller's API."""

from __future__ import annotations

import math
from typing import Any

import torch

import trainer_agent as ta
from tests.service.conftest import register
from trainguard.demo.model import ByteCorpus, TinyGPT, next_byte_loss, stdlib_source_bytes

CORPUS = ByteCorpus(stdlib_source_bytes(1 << 18), seq_len=32, batch_size=8)
LOST = 200  # the step before which the optimizer's second moments are lost


def _second_moments_lost(steps: int) -> list[dict[str, float]]:
    """A small GPT trained for real with AdamW at a steady LR (the agent attached, a report every
    step); before step ``LOST + 1`` Adam's second moments are scaled by 1e-8, as a bad load of
    the optimizer's state leaves them."""
    torch.manual_seed(0)
    model = TinyGPT(seq_len=32, d_model=32, n_layers=1, n_heads=2)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    agent = ta.attach(model, opt, job="job-a", run="run-1", config=ta.AgentConfig(metrics_port=None, report_every=1))
    rows = []
    try:
        for k in range(steps):
            if k == LOST:
                for state in opt.state.values():
                    state["exp_avg_sq"].mul_(1e-8)
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


def test_an_update_that_jumps_with_the_lr_unchanged_is_told_to_reset_the_optimizer_state(app_factory) -> None:  # type: ignore[no-untyped-def]
    """The symptom table: a loss that rises after falling comes from an abnormal optimizer state,
    and its remedy is to reset the optimizer (or roll back). Lost second moments make the update
    per unit of LR jump with the LR and the gradient as they were: the alert on the update must
    name that cause and remedy, not only an LR too high."""
    rows = _second_moments_lost(LOST + 3)
    before, after = rows[LOST - 1], rows[LOST]
    assert after["trainguard_scheduler_lr"] == before["trainguard_scheduler_lr"]  # the LR unchanged
    assert after["trainguard_grad_norm"] < 2 * before["trainguard_grad_norm"]  # the gradient too
    assert after["trainguard_update_ratio_per_lr"] > 20 * before["trainguard_update_ratio_per_lr"]
    with app_factory() as c:
        register(c, world_size=1)
        for i, values in enumerate(rows):
            step = int(values["trainguard_step"])
            body = {"job": "job-a", "step_first": step, "step_last": step, "time": 1000.0 + i,
                    "values": {k: ("NaN" if isinstance(v, float) and math.isnan(v) else v) for k, v in values.items()}}
            assert c.post("/v1/runs/run-1/reports", json=body).status_code == 200
        alerts: list[dict[str, Any]] = c.get("/v1/alerts", params={"run": "run-1"}).json()
        incidents = c.get("/v1/runs/run-1/incidents").json()["incidents"]
    (spike,) = [a for a in alerts if a["rule"] == "update_ratio_spike"]
    causes, actions = spike["diagnosis"]["likely_causes"], spike["diagnosis"]["suggested_actions"]
    assert any(c.startswith("Abnormal optimizer state") for c in causes), causes
    assert any("reset the optimizer state" in a for a in actions), actions
    (incident,) = incidents
    assert incident["cause"] == "optimizer" and incident["onset_step"] == LOST + 1
    lr = [e for e in incident["verdict"]["evidence"] if e["signal"] == "trainguard_scheduler_lr"]
    assert lr and lr[0]["points_to"] == "none"  # the verdict's own reading: the LR where it was
