"""The built-in rules on a healthy run that changes what it trains: a linear probe (the head alone),
then the whole model unfrozen. The gradient norm jumps tens of times at the unfreeze; that is the
run's own plan, and draws no finding of a rule that acts, no incident, no change of the run's
desired state and no step skipped by the agent. Made here as in ``test_service_rules_schedules.py``:
a small byte-level GPT trained on the CPU with AdamW, the agent attached (``report_every=1``, the
spike guard on), the reports replayed through the default rules (``engine.simulate``).
"""

from __future__ import annotations


import pytest
import torch
from torch import nn

import trainer_agent as ta
from tests.service.report_replay import RULES, acting, replay
from trainguard.demo.model import ByteCorpus, TinyGPT, next_byte_loss, stdlib_source_bytes
from trainguard.protocol.wire import Report
from trainguard.service.engine import simulate

CORPUS = ByteCorpus(stdlib_source_bytes(1 << 18), seq_len=32, batch_size=8)
STEPS, UNFREEZE = 320, 160


class ProbedGPT(nn.Module):
    """A byte-level GPT body under a head of its own: the head trains alone first."""

    def __init__(self) -> None:
        super().__init__()
        self.body = TinyGPT(seq_len=32, d_model=32, n_layers=2, n_heads=2)
        self.head = nn.Linear(32, 256)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b = self.body
        x = b.tok(ids) + b.pos(torch.arange(ids.shape[1]))
        for block in b.blocks:
            x = block(x)
        return self.head(b.ln_f(x))


def _train(freeze_after_attach: bool) -> list[dict[str, float]]:
    """The agent's report after every step: the body frozen (after ``attach``, or before it),
    unfrozen at ``UNFREEZE``."""
    torch.manual_seed(0)
    model = ProbedGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    if not freeze_after_attach:
        model.body.requires_grad_(False)
    agent = ta.attach(model, opt, job="probe", run="r",
                      config=ta.AgentConfig(metrics_port=None, report_every=1, skip_spikes=True))
    model.body.requires_grad_(False)
    rows = []
    for k in range(STEPS):
        if k == UNFREEZE:
            model.body.requires_grad_(True)
        ids, mask = CORPUS.batch(k, 0)
        loss = next_byte_loss(model, ids, mask)
        loss.backward()
        opt.step()
        opt.zero_grad()
        agent.end_step(loss.detach())
        rows.append(agent.latest())
    agent.close(1.0)
    return rows


@pytest.mark.parametrize("freeze_after_attach", [True, False], ids=["frozen-after-attach", "frozen-before-attach"])
def test_unfreezing_the_body_after_a_linear_probe_draws_no_action(freeze_after_attach: bool) -> None:
    rows = _train(freeze_after_attach)
    norms = [v["trainguard_grad_norm"] for v in rows]
    counts = [v["trainguard_trainable_elements"] for v in rows]
    head, whole = 32 * 256 + 256, sum(p.numel() for p in ProbedGPT().parameters())
    if freeze_after_attach:  # the body is measured: its elements count from the unfreeze on
        assert counts[UNFREEZE - 1] == head and counts[UNFREEZE] == whole
        # what the unfreeze does to the gradient norm: the run's own jump, tens of times
        assert norms[UNFREEZE] > 20 * max(norms[UNFREEZE - 20:UNFREEZE])
    else:  # frozen at attach: left out of every measurement
        assert set(counts) == {head}
    steps = replay(rows, "probe")
    assert acting(steps) == []
    assert all(s.desired.lr_scale == 1.0 and s.desired.generation == 0 for s in steps)
    assert all(v.get("trainguard_consecutive_skipped_steps", 0) == 0 for v in rows)


def test_the_spike_rules_compare_with_the_reports_since_the_trained_elements_changed() -> None:
    """The controller alone (the agent's reports made by hand): a gradient norm 40x its median is
    a ``grad_norm_spike`` when the same elements train, and no finding in the reports after they
    changed until the rule has ``min_history`` of them."""
    def reports(change: bool) -> list[Report]:
        out = []
        for i in range(40):
            after = i >= 30
            values = {"trainguard_grad_norm": 20.0 if after else 0.5, "trainguard_grad_norm_max": 20.0 if after else 0.5,
                      "trainguard_loss": 3.0, "trainguard_trainable_elements": 9000.0 if after and change else 100.0}
            out.append(Report(job="probe", step_first=i + 1, step_last=i + 1, time=float(i), values=values))
        return out

    fired = {change: [(s.step_last, f.finding.rule.name) for s in simulate(RULES.base, reports(change), world_size=1,
                                                                          policy=RULES.file.recovery) for f in s.fired]
             for change in (False, True)}
    assert (31, "grad_norm_spike") in fired[False]
    assert not any(name == "grad_norm_spike" for _, name in fired[True])
