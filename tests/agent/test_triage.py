"""Triage statistics (``trainer_agent/measure/triage_stats.py``) through a real agent: per-layer gradient
statistics against a naive float64 reference, the update-size ratio against the optimizers'
update rules, and a real GradScaler driven to its floor, fed into the controller's default rules."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import trainer_agent as ta
from trainer_agent.diagnostics import preflight_gradients
from trainguard.protocol.wire import Report
from trainguard.service.engine import simulate
from trainguard.service.rules import default_rules_text, load_rules


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3))


def _step(model, opt, agent, seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(seed))
    loss = model(x).square().mean() * scale
    loss.backward()
    grads = {n: p.grad.double().clone() for n, p in model.named_parameters()}
    opt.step()
    opt.zero_grad()
    agent.end_step(loss)
    return grads


@pytest.mark.parametrize("chunk", [None, 8])
def test_layer_gradient_statistics_match_a_naive_reference(monkeypatch, chunk: int | None) -> None:
    """With ``chunk``, the weights (35 and 15 elements) are measured chunk by chunk on the CPU
    (``trainer_agent/measure/chunked_moments.py``) and the biases by the fused passes."""
    if chunk is not None:
        from trainer_agent.measure import chunked_moments, stats

        monkeypatch.setattr(chunked_moments, "MOMENT_CHUNK", chunk)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = ta.attach(model, opt, job="t", run="t-1",
                      config=ta.AgentConfig(metrics_port=None, report_every=1, layer_depth=1))
    grads = _step(model, opt, agent, 1)
    got = agent.latest()
    agent.close()
    for layer in ("0", "2"):
        g = torch.cat([grads[f"{layer}.weight"].reshape(-1), grads[f"{layer}.bias"]])
        key = lambda m: f'{m}{{layer="{layer}"}}'  # noqa: E731
        assert got[key("trainguard_layer_grad_mean")] == pytest.approx(float(g.mean()), rel=1e-5, abs=1e-9)
        assert got[key("trainguard_layer_grad_std")] == pytest.approx(float(g.std(unbiased=False)), rel=1e-4)
        assert got[key("trainguard_layer_grad_max_abs")] == pytest.approx(float(g.abs().max()), rel=1e-6)
        assert got[key("trainguard_layer_grad_min_abs")] == pytest.approx(float(g.abs().min()), rel=1e-6)
    every = torch.cat([g.reshape(-1) for g in grads.values()])
    assert got["trainguard_grad_max_abs"] == pytest.approx(float(every.abs().max()), rel=1e-6)


@pytest.mark.parametrize("make, expected", [
    (lambda ps: torch.optim.SGD(ps, lr=0.1), 1.0),                    # delta W = lr g exactly
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 0.1),      # first step: (1 - momentum) of the bound
    (lambda ps: torch.optim.Adam(ps, lr=1e-3, eps=1e-12), 1.0),       # first step: every weight moves by lr
    (lambda ps: torch.optim.Adam(ps, lr=1e-3, eps=1e3), None),        # eps dominates: the update nearly vanishes
])
def test_update_size_ratio_follows_the_update_rule(make, expected) -> None:
    model = _model()
    opt = make(model.parameters())
    agent = ta.attach(model, opt, job="t", run="t-1",
                      config=ta.AgentConfig(metrics_port=None, report_every=1))
    before = [p.detach().double().clone() for p in model.parameters()]
    grads = _step(model, opt, agent, 2)
    ratio = agent.latest()["trainguard_update_size_ratio"]
    agent.close()
    delta = math.sqrt(sum(float((p.detach().double() - b).square().sum()) for p, b in zip(model.parameters(), before)))
    g = math.sqrt(sum(float(v.square().sum()) for v in grads.values()))
    n = sum(p.numel() for p in model.parameters())
    if isinstance(opt, torch.optim.SGD):
        independent = delta / (0.1 * g / (1 - opt.param_groups[0]["momentum"]))
    else:
        independent = delta / (1e-3 * math.sqrt(n))
    assert ratio == pytest.approx(independent, rel=1e-4)
    if expected is not None:
        assert ratio == pytest.approx(expected, rel=1e-3)
    else:
        assert ratio < 1e-3


def _reports(values: list[dict[str, float]]) -> list[Report]:
    return [Report(job="amp", step_first=int(v["trainguard_step"]), step_last=int(v["trainguard_step"]), time=float(i),
                   values={k: x for k, x in v.items() if "{" not in k}) for i, v in enumerate(values)]


@pytest.mark.parametrize("overflow", [False, True])
def test_a_grad_scaler_driven_to_its_floor_trips_the_amp_rules(overflow) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=2000)
    agent = ta.attach(model, opt, job="amp", run="amp-1", scaler=scaler,
                      config=ta.AgentConfig(metrics_port=None, report_every=1))
    seen = []
    for step in range(8):
        x = torch.randn(4, 7, generator=torch.Generator().manual_seed(step))
        loss = model(x).square().mean()
        if overflow:
            loss = loss * math.inf  # inf gradients: the scaler skips the step and halves its scale
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        agent.end_step(loss)
        seen.append(agent.latest())
    agent.close()
    scales = [v["trainguard_loss_scale"] for v in seen]
    rules = load_rules(default_rules_text()).for_job("amp")
    fired = {f.finding.rule.name for s in simulate(rules, _reports(seen), world_size=1) for f in s.fired}
    if overflow:
        assert scales[:5] == [8.0, 4.0, 2.0, 1.0, 0.5]  # the scale after each step: halved per overflow
        assert seen[-1]["trainguard_amp_skipped_steps_total"] == 8.0
        # every step skipped from the first: amp_loss_scale_floor's to find (amp_skip_rate measures
        # 100 steps or more, from the first step the scaler took)
        assert "amp_loss_scale_floor" in fired and "amp_skip_rate" not in fired
    else:
        assert set(scales) == {16.0} and seen[-1]["trainguard_amp_skipped_steps_total"] == 0.0
        assert not fired & {"amp_loss_scale_floor", "amp_skip_rate"}


def test_update_size_ratio_of_muon_follows_its_orthogonalised_update() -> None:
    # torch.optim.Muon on matrices (it takes nothing else): each update is the momentum
    # orthogonalised (singular values about 1), scaled by the LR adjusted to the matrix's shape.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 16, bias=False), nn.Tanh(), nn.Linear(16, 32, bias=False))
    for how, factor in ((None, lambda a, b: max(1.0, a / b) ** 0.5), ("match_rms_adamw", lambda a, b: 0.2 * max(a, b) ** 0.5)):
        opt = torch.optim.Muon(model.parameters(), lr=0.02, weight_decay=0.1, adjust_lr_fn=how)
        agent = ta.attach(model, opt, job="t", run="t-1", config=ta.AgentConfig(metrics_port=None, report_every=1))
        model(torch.randn(4, 7)).square().mean().backward()  # the pre-flight's simulated step: near its bound
        check = preflight_gradients.update_check(agent.parts, [p.grad for p in agent.parts.params.params])
        rows = check.values["layers"]
        assert set(rows) == {"0", "2"} and all(0.3 < r["ratio"] < 1.2 for r in rows.values()), check
        opt.zero_grad()
        for seed in range(3):
            before = [p.detach().double().clone() for p in model.parameters()]
            _step(model, opt, agent, seed)
            ratio = agent.latest()["trainguard_update_size_ratio"]
            delta = math.sqrt(sum(float((p.detach().double() - b).square().sum()) for p, b in zip(model.parameters(), before)))
            w = math.sqrt(sum(float(b.square().sum()) for b in before))
            shapes = [tuple(p.shape) for p in model.parameters()]  # (16, 7) and (32, 16)
            predicted = 0.02 * math.sqrt(sum(factor(a, b) ** 2 * min(a, b) for a, b in shapes)) + 0.02 * 0.1 * w
            assert ratio == pytest.approx(delta / predicted, rel=1e-6)
            assert 0.5 < ratio < 1.2  # about 1: singular values of the orthogonalised update near 1
        agent.close()


@pytest.mark.parametrize("passed", [True, False], ids=["scaler_passed", "scaler_found"])
def test_a_fused_optimizer_under_a_grad_scaler_is_measured_unscaled_and_its_skips_counted(passed: bool) -> None:
    # A fused AdamW unscales inside its kernel: in its step hooks the gradients still carry the
    # scale (GradScaler sets optimizer.grad_scale for the step), and a non-finite step is skipped
    # by the kernel, not by the scaler (optimizer.found_inf). Every value equals the unfused run's.
    def run(fused: bool) -> list[dict[str, float]]:
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        agent = ta.attach(model, opt, job="t", run="t-1", scaler=scaler if passed else None,
                          config=ta.AgentConfig(metrics_port=None, report_every=1, layer_depth=1))
        seen = []
        for step in range(4):
            x = torch.randn(4, 7, generator=torch.Generator().manual_seed(step))
            loss = model(x).square().mean() * (math.inf if step == 2 else 1.0)  # step 3 overflows
            scaler.scale(loss).backward()
            g_max = max(float(p.grad.double().abs().max()) for p in model.parameters()) / scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            agent.end_step(loss)
            seen.append({**agent.latest(), "reference_max_abs": g_max})
        agent.close()
        return seen

    fused, plain = run(True), run(False)
    keys = ("trainguard_grad_max_abs", 'trainguard_layer_grad_max_abs{layer="0"}', 'trainguard_layer_grad_std{layer="2"}',
            "trainguard_amp_skipped_steps_total", "trainguard_loss_scale")
    for step, (f, p) in enumerate(zip(fused, plain), start=1):
        # (on step 3 the fused step ran, on non-finite gradients; the scaler skipped the unfused one)
        compared = keys if step != 3 else keys[3:]
        assert [f.get(k) for k in compared] == [p.get(k) for k in compared], step
        assert f["trainguard_agent_errors_total"] == 0
        if step != 3:
            assert f["trainguard_grad_max_abs"] == pytest.approx(f["reference_max_abs"], rel=1e-6)
    assert [f["trainguard_amp_skipped_steps_total"] for f in fused] == [0.0, 0.0, 1.0, 1.0]


def _zero_worker(rank: int, init: str, out: str) -> None:
    import os

    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=1)
    model = _model()
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3, eps=1e-12,
                                  weight_decay=0.0)
    agent = ta.attach(model, opt, job="t", run="t-1", config=ta.AgentConfig(metrics_port=None, report_every=1))
    _step(model, opt, agent, 2)
    ratio = agent.latest().get("trainguard_update_size_ratio")
    agent.close()
    dist.destroy_process_group()
    torch.save({"ratio": ratio}, os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.distributed
def test_update_size_ratio_of_a_zero_redundancy_optimizer_follows_its_local_optimizers_rule(tmp_path) -> None:
    # torch.distributed.optim.ZeroRedundancyOptimizer steps each rank's partition with AdamW (then
    # broadcasts it): Adam's first step moves every weight by lr, a ratio of 1 (as for AdamW alone).
    from tests.control.spawn import spawn_ranks

    (result,) = spawn_ranks(_zero_worker, 1, tmp_path, timeout=120)
    assert result["ratio"] == pytest.approx(1.0, rel=1e-3)
