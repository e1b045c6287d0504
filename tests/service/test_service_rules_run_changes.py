"""The built-in rules on healthy runs that change what they train, the optimizer they train with, or
draw their batches from sources of different loss. A linear probe (the head alone), then the whole
model unfrozen: the gradient norm jumps tens of times at the unfreeze. Adam, then SGD at a hundred
times the LR (or back), the agent attached to the new optimizer. Batches drawn one at a time from an
easy and a hard corpus: the loss has two levels, and the hard batches, once they recur, are not
faults. Each is the run's own plan, and draws no finding of a rule that acts, no incident, no
change of the run's desired state and no step skipped by the agent. Made here as in
``test_service_rules_schedules.py``: a small byte-level GPT trained on the CPU, the agent attached
(``report_every=1``, the spike guard on), the reports replayed through the default rules
(``engine.simulate``).
"""

from __future__ import annotations


import random
import statistics
from typing import Any

import pytest
import torch
from torch import nn

import trainer_agent as ta
from tests.service.report_replay import RULES, acting, replay
from trainguard.demo.model import ByteCorpus, TinyGPT, next_byte_loss, phrase_bytes, stdlib_source_bytes
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


def _step(model: nn.Module, opt: torch.optim.Optimizer, agent: Any, corpus: ByteCorpus, k: int) -> dict[str, float]:
    """One training step on batch ``k`` of ``corpus``; the agent's report after it."""
    ids, mask = corpus.batch(k, 0)
    loss = next_byte_loss(model, ids, mask)
    loss.backward()
    opt.step()
    opt.zero_grad()
    agent.end_step(loss.detach(), tokens=ids.numel())
    return agent.latest()


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
        rows.append(_step(model, opt, agent, CORPUS, k))
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


@pytest.mark.parametrize("marker", ["trainguard_trainable_elements", "trainguard_optimizer_class"])
def test_the_spike_rules_compare_with_the_reports_since_the_run_changed(marker: str) -> None:
    """The controller alone (the agent's reports made by hand): a gradient norm 40x its median is
    a ``grad_norm_spike`` when the same elements train with the same optimizer, and no finding in
    the reports after either changed until the rule has ``min_history`` of them."""
    def reports(change: bool) -> list[Report]:
        out = []
        for i in range(40):
            after = i >= 30
            values = {"trainguard_grad_norm": 20.0 if after else 0.5, "trainguard_grad_norm_max": 20.0 if after else 0.5,
                      "trainguard_loss": 3.0, "trainguard_trainable_elements": 100.0, "trainguard_optimizer_class": 7.0,
                      marker: 9000.0 if after and change else 100.0}
            out.append(Report(job="probe", step_first=i + 1, step_last=i + 1, time=float(i), values=values))
        return out

    fired = {change: [(s.step_last, f.finding.rule.name) for s in simulate(RULES.base, reports(change), world_size=1,
                                                                          policy=RULES.file.recovery) for f in s.fired]
             for change in (False, True)}
    assert (31, "grad_norm_spike") in fired[False]
    assert not any(name == "grad_norm_spike" for _, name in fired[True])


def _switched(model: nn.Module, first: torch.optim.Optimizer, make_second: Any, load_state: bool) -> list[dict[str, float]]:
    """200 steps with ``first``, then 200 with the optimizer ``make_second(parameters)`` makes, the
    agent attached to it anew (as the docs say for a switch), the old agent's state loaded or not.
    The report after every step, numbered by the step of the whole run."""
    rows: list[dict[str, float]] = []
    opt, state = first, None
    for k0 in (0, 200):
        if k0:
            opt = make_second(list(model.parameters()))
        agent = ta.attach(model, opt, job="switch", run="r",
                          config=ta.AgentConfig(metrics_port=None, report_every=1, skip_spikes=True))
        if state is not None and load_state:
            agent.load_state_dict(state)
        for k in range(k0, k0 + 200):
            rows.append(dict(_step(model, opt, agent, CORPUS, k), trainguard_step=float(k + 1)))
        state = agent.state_dict()
        agent.close(1.0)
    return rows


@pytest.mark.parametrize("case", ["adam-to-sgd, state loaded", "sgd-to-adamw, new agent"])
def test_switching_optimizer_mid_run_draws_no_action(case: str) -> None:
    """Adam at 1e-3, then SGD with momentum at 0.1 (a hundred times the LR), the agent's state
    loaded into the new agent: the LR envelope was Adam's, and a 100x LR jump would cut the LR to
    1 %. SGD at 0.1, then AdamW at 3e-3 without the state: Adam's update per unit of LR is a
    hundred times SGD's, an ``update_ratio_spike`` against the reports before the switch. Both
    runs train on; nothing acts, nothing is skipped."""
    torch.manual_seed(0)
    model = TinyGPT(seq_len=64, d_model=32, n_layers=2, n_heads=2)
    if case.startswith("adam-to-sgd"):
        rows = _switched(model, torch.optim.Adam(model.parameters(), lr=1e-3),
                         lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), load_state=True)
    else:
        rows = _switched(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                         lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.01), load_state=False)
    assert rows[199]["trainguard_optimizer_class"] != rows[200]["trainguard_optimizer_class"]
    steps = replay(rows, "switch")
    assert acting(steps) == []
    assert all(s.desired.lr_scale == 1.0 and s.desired.generation == 0 and not s.incidents for s in steps)
    assert all(v.get("trainguard_consecutive_skipped_steps", 0) == 0 for v in rows)
    assert rows[-1]["trainguard_loss"] < rows[199]["trainguard_loss"]  # training went on


@pytest.mark.parametrize("marked", [True, False], ids=["marked", "not-marked"])
def test_a_new_loss_weight_marked_as_a_run_change_draws_no_action(marked: bool) -> None:
    """The loss multiplied by 4 from step 200 (a new loss weight): AdamW's steps do not change, the
    reported loss and gradient norm jump 4x. Marked with ``Agent.run_changed()`` at that step, it
    draws no action; unmarked, the rules cannot tell it from a fault and act (what the docs say)."""
    torch.manual_seed(0)
    model = TinyGPT(seq_len=64, d_model=32, n_layers=2, n_heads=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    agent = ta.attach(model, opt, job="weight", run="r",
                      config=ta.AgentConfig(metrics_port=None, report_every=1, skip_spikes=True))
    rows = []
    for k in range(320):
        if k == 200 and marked:
            agent.run_changed()
        ids, mask = CORPUS.batch(k, 0)
        loss = next_byte_loss(model, ids, mask) * (4.0 if k >= 200 else 1.0)
        loss.backward()
        opt.step()
        opt.zero_grad()
        agent.end_step(loss.detach())
        rows.append(agent.latest())
    agent.close(1.0)
    assert rows[-1]["trainguard_run_changes_total"] == (1.0 if marked else 0.0)
    assert rows[200]["trainguard_loss"] > 3 * rows[199]["trainguard_loss"]
    steps = replay(rows, "weight")
    skipped = [v.get("trainguard_consecutive_skipped_steps", 0) for v in rows]
    if marked:
        assert acting(steps) == []
        assert all(s.desired.lr_scale == 1.0 and s.desired.generation == 0 and not s.incidents for s in steps)
        assert max(skipped) == 0
    else:
        assert any(" loss_spike:" in line for line in acting(steps))


def test_batches_drawn_from_two_sources_of_different_loss_draw_no_action() -> None:
    """One batch in five from the hard corpus, chosen at random per batch, a report every step:
    the hard batches' loss stands 10-30 robust sigma above the easy majority's median, and once the
    window has seen that level come and go 3 times it is the run's, not a fault."""
    torch.manual_seed(0)
    model = TinyGPT(seq_len=64, d_model=32, n_layers=2, n_heads=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    easy, hard = ByteCorpus(phrase_bytes(1 << 18), seq_len=32, batch_size=8), CORPUS
    pick = torch.Generator().manual_seed(1)
    agent = ta.attach(model, opt, job="mix", run="r",
                      config=ta.AgentConfig(metrics_port=None, report_every=1, skip_spikes=True))
    rows, hard_steps = [], []
    for k in range(600):
        corpus = hard if torch.rand((), generator=pick).item() < 0.2 else easy
        if corpus is hard:
            hard_steps.append(k)
        rows.append(_step(model, opt, agent, corpus, k))
    agent.close(1.0)
    losses = [v["trainguard_loss"] for v in rows]
    late_easy = [losses[k] for k in range(500, 600) if k not in hard_steps]
    late_hard = [losses[k] for k in hard_steps if k >= 500]
    assert min(late_hard) > 1.5 * max(late_easy)  # two levels: what the rules must not take for faults
    steps = replay(rows, "mix")
    assert acting(steps) == []
    assert all(s.desired.lr_scale == 1.0 and s.desired.generation == 0 and not s.incidents for s in steps)
    assert all(v.get("trainguard_consecutive_skipped_steps", 0) == 0 for v in rows)


def _rare_source(torch_seed: int, steps: int) -> list[dict[str, float]]:
    """A small one-layer GPT (its initial weights drawn with ``torch_seed``) that learns the easy
    corpus fast, one batch in ten from the hard corpus (drawn at random per batch, the same draws
    for every call), a report every step: the agent's report after each step."""
    torch.manual_seed(torch_seed)
    model = TinyGPT(seq_len=32, d_model=32, n_layers=1, n_heads=2)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    easy, pick = ByteCorpus(phrase_bytes(1 << 18), seq_len=32, batch_size=8), random.Random(3)
    agent = ta.attach(model, opt, job="mix", run="r",
                      config=ta.AgentConfig(metrics_port=None, report_every=1, skip_spikes=True))
    rows = [_step(model, opt, agent, CORPUS if pick.random() < 0.1 else easy, k) for k in range(steps)]
    agent.close(1.0)
    return rows


def test_a_rare_harder_source_whose_batch_stands_out_is_one_batch_not_an_lr_cut() -> None:
    """One batch in ten from the hard corpus (chosen at random per batch), a report every step, a
    small one-layer GPT that learns the easy corpus fast: the easy batches' gradient norm falls
    below a third of its early level, and a hard batch at step 185 reads 5.8x the median of the
    last 32 (``grad_norm_spike``), its loss 22 robust sigma above its neighbours', Adam's step on
    it 2.1x the healthy update ratio. That is one batch's gradient through the optimizer's step:
    the incident's cause is data, and the LR is not cut (the verdict was ``optimizer``, and the LR
    was halved for 10 steps)."""
    steps = replay(_rare_source(0, 200), "mix")
    assert "185 grad_norm_spike: trainguard_grad_norm_max = 4.49739 is 5.79x its rolling median 0.776402 (limit 5x)" in acting(steps)
    incidents = {i["id"]: i for s in steps for i in s.incidents}
    assert incidents and all(i["cause"] == "data" and i["rungs"] == [] for i in incidents.values())
    assert all(s.desired.lr_scale == 1.0 and s.desired.generation == 0 for s in steps)


def test_a_second_hard_batch_after_the_norm_came_back_leaves_the_one_batch_verdict_standing() -> None:
    """One batch in ten from the hard corpus (another draw than above), a report every step: a hard
    batch at step 66 stands out alone (cause data), the easy batches bring the gradient norm back to
    its level, and a second hard batch 10 reports later is again 5x the level before the onset. That
    is another batch, not a norm that stayed up: the verdict stays data (it was revised to unknown
    at step 76, whose ladder may cut the LR)."""
    rows = _rare_source(1, 120)
    norm = {int(v["trainguard_step"]): v["trainguard_grad_norm_max"] for v in rows}
    level = statistics.median(norm[k] for k in range(34, 66))  # the 32 reports before the onset
    assert norm[66] >= 5 * level and norm[76] >= 5 * level  # two jumps ...
    assert min(norm[k] for k in range(67, 76)) <= 2 * level  # ... the norm back at its level in between
    incidents = {i["id"]: i for s in replay(rows, "mix") for i in s.incidents}
    first = next(i for i in incidents.values() if i["onset_step"] == 66)
    assert first["cause"] == "data" and "revised" not in first["verdict"]
    assert all(i["cause"] == "data" and not {"adaptive_lr", "rollback"} & set(i["rungs"]) for i in incidents.values())


def _losses_window(losses: list[float]) -> Any:
    from trainguard.service.window import RunWindow

    w = RunWindow(capacity=128, rank_capacity=8, world_size=1, created=0.0)
    for i, loss in enumerate(losses):
        w.append(Report(job="j", step_first=i + 1, step_last=i + 1, time=float(i), values={"trainguard_loss": loss}), float(i))
    return w


def test_loss_spike_lets_a_level_visited_and_left_three_times_pass_and_keeps_finding_bursts() -> None:
    """``recurring: 3``: a loss at a level its window rose to and came back from 3 separate times is
    no spike; 2 visits are not enough; a burst that has not come back counts for nothing, and the
    fall from a high start of training once."""
    from trainguard.service.evaluate import evaluate

    rule = next(r for r in RULES.base if r.name == "loss_spike")
    assert rule.recurring == 3
    noise = [1.0 + 0.01 * ((7 * i) % 5) for i in range(70)]

    def found(losses: list[float]) -> bool:
        return evaluate((rule,), _losses_window(losses), float(len(losses)))[0].active

    def visited(times: int) -> list[float]:
        out = list(noise[:69])
        for k in range(times):
            out[10 + 15 * k] = 3.1  # up, and back to the baseline on the next report
        return out + [3.0]

    assert found(visited(0)) and found(visited(2))
    assert not found(visited(3)) and not found(visited(4))
    assert found(visited(3)[:-1] + [9.0])  # far above the level visited: half-way to it was never reached
    burst = noise[:60] + [3.1] * 9 + [3.0]  # nine reports up, still up: no visit has ended
    assert found(burst)
    falling = noise[:5] + [3.2, 3.0, 2.8] + noise[8:69] + [3.0]  # one fall from a high start: one visit
    assert found(falling)
