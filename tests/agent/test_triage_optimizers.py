"""The update-size triage and the eps advice across optimizer families (``trainer_agent/measure/triage_stats.py``,
``trainer_agent/diagnostics/preflight.py``): torch's and Hugging Face's Adafactor, a trust-ratio optimizer
(LAMB, written out here as the paper states it), other libraries' Adam variants recognised by class
name, and an optimizer trainguard does not know, which it says so for."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import trainer_agent as ta
from trainer_agent.measure.triage_stats import update_rule


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3))


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al. 2019): an Adam step per tensor, rescaled by the trust ratio
    ||W|| / ||adam step + wd W||, so that each tensor moves by lr ||W||."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"], state["m"], state["v"] = 0, torch.zeros_like(p), torch.zeros_like(p)
                state["step"] += 1
                state["m"].mul_(b1).add_(p.grad, alpha=1 - b1)
                state["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                m_hat = state["m"] / (1 - b1 ** state["step"])
                v_hat = state["v"] / (1 - b2 ** state["step"])
                u = m_hat / (v_hat.sqrt() + group["eps"]) + group["weight_decay"] * p
                trust = p.norm() / u.norm()
                p.add_(u, alpha=-float(group["lr"] * trust))


class FusedAdam(torch.optim.Adam):
    """Stands for another library's fused Adam: recognised by its name, not its base class."""


class Sign(torch.optim.Optimizer):
    """An update rule trainguard has no prediction for."""

    def __init__(self, params, lr: float = 1e-3):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign() * p.abs(), alpha=-group["lr"])


def _measured_ratio(opt_factory, after_step=None):
    model = _model()
    opt = opt_factory(model.parameters())
    agent = ta.attach(model, opt, job="t", run="t-opt", config=ta.AgentConfig(metrics_port=None, report_every=1))
    before = [p.detach().double().clone() for p in model.parameters()]
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(3))
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    if after_step is not None:
        after_step(opt)
    agent.end_step(loss)
    got = agent.latest()
    agent.close()
    delta = math.sqrt(sum(float((p.detach().double() - b).square().sum()) for p, b in zip(model.parameters(), before)))
    return got.get("trainguard_update_size_ratio"), delta, before


def test_torch_adafactor_is_predicted_from_its_relative_step_and_update_clipping() -> None:
    lr = 1e-2
    ratio, delta, before = _measured_ratio(lambda ps: torch.optim.Adafactor(ps, lr=lr))
    # Step 1: rho = min(lr, 1/sqrt(1)) = lr; each tensor moves by at most rho x d x max(eps2 sqrt(n), ||W||).
    bound = math.sqrt(sum((lr * 1.0 * max(1e-3 * math.sqrt(b.numel()), float(b.norm()))) ** 2 for b in before))
    assert ratio == pytest.approx(delta / bound, rel=1e-6)
    assert 0.3 < ratio <= 1.0 + 1e-6  # the clip to RMS d bounds it (float32 steps); a first step is close to it


def test_torch_adafactor_is_predicted_from_the_lr_its_step_applied() -> None:
    # The scheduler sets the next step's LR before end_step (the last step of a cosine schedule: 0);
    # the prediction is the step's, made with the LR it applied (before: the next one's, x/0 = inf).
    lr = 1e-2

    def scheduled_to_zero(opt: torch.optim.Optimizer) -> None:
        for group in opt.param_groups:
            group["lr"] = 0.0

    ratio, delta, before = _measured_ratio(lambda ps: torch.optim.Adafactor(ps, lr=lr), scheduled_to_zero)
    bound = math.sqrt(sum((lr * 1.0 * max(1e-3 * math.sqrt(b.numel()), float(b.norm()))) ** 2 for b in before))
    assert ratio == pytest.approx(delta / bound, rel=1e-6)


def test_a_trust_ratio_optimizer_moves_each_tensor_by_lr_times_its_norm() -> None:
    lr = 1e-3
    ratio, delta, before = _measured_ratio(lambda ps: Lamb(ps, lr=lr))
    assert update_rule(Lamb(_model().parameters())) == "trust_ratio"
    expected = lr * math.sqrt(sum(float(b.square().sum()) for b in before))
    assert delta == pytest.approx(expected, rel=1e-5)  # the trust ratio's definition, measured
    assert ratio == pytest.approx(1.0, rel=1e-5)


def test_other_libraries_variants_are_recognised_by_class_name_and_unknown_rules_are_said_to_be() -> None:
    ps = list(_model().parameters())
    assert update_rule(FusedAdam(ps)) == "adaptive"
    assert update_rule(torch.optim.AdamW(ps, fused=False, foreach=True)) == "adaptive"
    assert update_rule(torch.optim.SGD(ps, lr=0.1)) == "sgd"
    assert update_rule(Sign(ps)) is None
    ratio, _, _ = _measured_ratio(lambda p: FusedAdam(p, lr=1e-3, eps=1e-12))
    assert ratio == pytest.approx(1.0, rel=1e-3)  # Adam's first step moves every weight by lr
    ratio, _, _ = _measured_ratio(lambda p: Sign(p))
    assert ratio is None
    model = _model()
    agent = ta.attach(model, Sign(model.parameters()), job="t", run="t-sign", config=ta.AgentConfig(metrics_port=None))
    report = agent.preflight(torch.randn(4, 7), loss_fn=lambda m, b: m(b).square().mean(), clip_grad_norm=1.0)
    check = next(c for c in report.checks if c.name == "update_size")
    assert check.status == "skip" and "Sign's update rule is not one trainguard knows" in check.detail
    assert "Adafactor, LAMB" in check.detail
    agent.close()


def _eps_check(net: nn.Module, opt, declared: int):
    agent = ta.attach(net, opt, job="t", run=f"t-eps-{id(opt)}", config=ta.AgentConfig(metrics_port=None))
    try:
        report = agent.preflight(torch.randn(4, 7, dtype=next(net.parameters()).dtype),
                                 loss_fn=lambda m, b: m(b).float().square().mean(), declared_params=declared,
                                 clip_grad_norm=1.0)
    finally:
        agent.close()
    return next(c for c in report.checks if c.name == "adam_eps")


@pytest.mark.parametrize("make, dtype, declared, status, eps", [
    # torch's Adafactor clamps v at eps1^2; None means the parameters' dtype epsilon.
    (lambda ps: torch.optim.Adafactor(ps), torch.float32, 20 * 10**9, "warn", float(torch.finfo(torch.float32).eps)),
    (lambda ps: torch.optim.Adafactor(ps), torch.bfloat16, 20 * 10**9, "warn", float(torch.finfo(torch.bfloat16).eps)),
    (lambda ps: torch.optim.Adafactor(ps, eps=(1e-9, 1e-3)), torch.float32, 20 * 10**9, "pass", 1e-9),
    (lambda ps: torch.optim.Adafactor(ps), torch.float32, 10**6, "pass", float(torch.finfo(torch.float32).eps)),
    # The guide's production example: LAMB's eps 1e-6 becomes 1e-8 above 10B parameters.
    (lambda ps: Lamb(ps, eps=1e-6), torch.float32, 20 * 10**9, "warn", 1e-6),
    (lambda ps: Lamb(ps, eps=1e-8), torch.float32, 20 * 10**9, "pass", 1e-8),
    (lambda ps: torch.optim.SGD(ps, lr=0.1), torch.float32, 20 * 10**9, "skip", None),
])
def test_the_eps_advice_reads_each_optimizers_eps_where_it_acts(make, dtype, declared, status, eps) -> None:
    net = _model().to(dtype)
    check = _eps_check(net, make(net.parameters()), declared)
    assert check.status == status
    if eps is not None:
        assert check.values["eps"] == pytest.approx(eps, rel=1e-9)


def test_hugging_face_adafactor_eps_is_read_on_the_gradient_scale() -> None:
    from transformers.optimization import Adafactor

    net = _model()
    opt = Adafactor(net.parameters(), lr=None, relative_step=True, scale_parameter=True, warmup_init=False)
    assert update_rule(opt) == "adafactor"
    check = _eps_check(net, opt, 20 * 10**9)
    assert check.status == "pass" and check.values["eps"] == pytest.approx(math.sqrt(1e-30))
    ratio, delta, before = _measured_ratio(lambda ps: Adafactor(ps, lr=None, relative_step=True, scale_parameter=True,
                                                                warmup_init=False))
    # relative step at t = 1: min(1e-2, 1) = 1e-2, times max(eps2, RMS(W)), clipped to RMS 1.
    bound = math.sqrt(sum((1e-2 * max(1e-3 * math.sqrt(b.numel()), float(b.norm()))) ** 2 for b in before))
    assert ratio == pytest.approx(delta / bound, rel=1e-6) and ratio <= 1.0 + 1e-6
