"""trainer_agent/measure/optim.py: optimizers as frameworks hand them out (unwrapped to the real one, or a
ValueError naming what was passed), and optimizer steps driven by a closure (``step(closure)``,
as Lightning and LBFGS call it): the skip decision and the LR scale use the gradients the closure
produced, a skipped step runs the closure exactly once."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import trainer_agent as ta
from trainguard.protocol.commands import DesiredState
from trainer_agent.measure.optim import state_age, unwrap_optimizer


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)


def _attach(model, opt, **cfg):  # type: ignore[no-untyped-def]
    cfg.setdefault("metrics_port", None)
    cfg.setdefault("report_every", 1)
    return ta.attach(model, opt, job="job-optim", run="run-optim", config=ta.AgentConfig(**cfg))


# ---------------------------------------------------------------------------- unwrapping


class _Wrapper:
    """A framework-style wrapper: not an Optimizer, the real one in ``.optimizer``."""

    def __init__(self, inner) -> None:  # type: ignore[no-untyped-def]
        self.optimizer = inner

    def step(self, closure=None):  # type: ignore[no-untyped-def]
        return self.optimizer.step(closure)


class _HalfBuilt(torch.optim.Optimizer):
    """Passes ``isinstance(x, Optimizer)`` but never ran ``Optimizer.__init__`` (no step hooks),
    like accelerate's AcceleratedOptimizer; holds the real optimizer in ``.optimizer``."""

    def __init__(self, inner) -> None:  # type: ignore[no-untyped-def]
        self.optimizer = inner

    @property
    def param_groups(self):  # type: ignore[no-untyped-def]
        return self.optimizer.param_groups


def test_unwrap_returns_the_real_optimizer_through_nested_wrappers() -> None:
    opt = torch.optim.SGD(_model().parameters(), lr=0.1)
    assert unwrap_optimizer(opt) is opt
    assert unwrap_optimizer(_Wrapper(opt)) is opt
    assert unwrap_optimizer(_HalfBuilt(_Wrapper(opt))) is opt
    opt.optimizer = "a setting that is not an optimizer"  # an optimizer with an unrelated .optimizer
    assert unwrap_optimizer(opt) is opt and unwrap_optimizer(_Wrapper(opt)) is opt


@pytest.mark.parametrize(
    ("bad", "named"),
    [
        (None, "NoneType"),
        ("adam", "str"),
        (_Wrapper("sgd"), "_Wrapper"),
        (_HalfBuilt(None), "_HalfBuilt"),
        (nn.Linear(2, 2), "Linear"),
    ],
)
def test_anything_else_is_a_value_error_naming_the_type(bad, named) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=named):
        unwrap_optimizer(bad)
    with pytest.raises(ValueError, match=named):
        ta.attach(_model(), bad, job="j", run="r", config=ta.AgentConfig(metrics_port=None))


def test_a_wrapper_that_wraps_itself_is_refused_not_looped() -> None:
    w = _Wrapper(None)
    w.optimizer = w
    with pytest.raises(ValueError, match="_Wrapper"):
        unwrap_optimizer(w)


def test_attach_through_accelerates_and_lightnings_wrappers_hooks_the_real_optimizer() -> None:
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from lightning.pytorch.core.optimizer import LightningOptimizer

    accelerator = Accelerator(cpu=True)
    for wrap in (accelerator.prepare_optimizer, LightningOptimizer):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        wrapped = wrap(opt)
        assert isinstance(wrapped, (AcceleratedOptimizer, LightningOptimizer))
        agent = _attach(model, wrapped)
        assert agent.optimizer is opt and opt._optimizer_step_pre_hooks
        x, y = _batch(0)
        loss = (model(x) - y).square().mean()
        loss.backward()
        ref = math.sqrt(sum(p.grad.double().square().sum().item() for p in model.parameters()))
        # a LightningOptimizer steps only inside a Lightning Trainer (test_lightning.py does that)
        (wrapped if isinstance(wrapped, AcceleratedOptimizer) else opt).step()
        agent.end_step(loss)
        assert agent.latest()["trainguard_grad_norm"] == pytest.approx(ref, rel=1e-6)  # float32 per-tensor norms
        agent.close(1.0)
        assert not opt._optimizer_step_pre_hooks


# ---------------------------------------------------------------------------- closures


def _closure_loop(model, opt, agent, steps, nan_at=(), lr_probe=None):  # type: ignore[no-untyped-def]
    """A hand-written ``opt.step(closure)`` loop; returns per step (weights before, weights after,
    closure calls)."""
    out = []
    for step in range(1, steps + 1):
        x, y = _batch(step)
        if step in nan_at:
            x = x.clone()
            x[0, 0] = math.nan
        calls = []

        def closure(x=x, y=y, calls=calls):  # type: ignore[no-untyped-def]
            calls.append(1)
            opt.zero_grad()
            loss = (model(x) - y).square().mean()
            loss.backward()
            return loss

        before = [p.detach().clone() for p in model.parameters()]
        loss = opt.step(closure)
        after = [p.detach().clone() for p in model.parameters()]
        agent.end_step(loss)
        out.append((before, after, len(calls)))
    return out


def test_skip_nonfinite_decides_on_the_gradients_the_closure_produced() -> None:
    model = _model(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    agent = _attach(model, opt, skip_nonfinite=True)
    steps = _closure_loop(model, opt, agent, 5, nan_at={3})
    for step, (before, after, calls) in enumerate(steps, start=1):
        assert calls == 1, step  # the closure ran exactly once, skipped or not
        if step == 3:
            assert all(torch.equal(a, b) for a, b in zip(before, after))  # bitwise unchanged
        else:
            assert all(not torch.equal(a, b) for a, b in zip(before, after)), step
            assert all(torch.isfinite(a).all() for a in after)
    latest = agent.latest()
    assert latest['trainguard_skipped_steps_total{reason="nonfinite"}'] == 1.0
    assert latest["trainguard_nonfinite_steps_total"] == 1.0
    agent.close(1.0)


def _reference_sgd(model, steps, lr, momentum):  # type: ignore[no-untyped-def]
    """The same loop without an agent, the LR of each step given: float64-free plain torch."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    out = []
    for step in range(1, steps + 1):
        x, y = _batch(step)
        opt.param_groups[0]["lr"] = lr(step) if callable(lr) else lr

        def closure(x=x, y=y):  # type: ignore[no-untyped-def]
            opt.zero_grad()
            loss = (model(x) - y).square().mean()
            loss.backward()
            return loss

        opt.step(closure)
        out.append([p.detach().clone() for p in model.parameters()])
    return out


def test_lr_scale_applies_to_closure_steps() -> None:
    model = _model(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    agent = _attach(model, opt, skip_nonfinite=True)
    seen_lr = []
    opt.register_step_pre_hook(lambda o, a, k: seen_lr.append(o.param_groups[0]["lr"]))
    agent.control._set(DesiredState(generation=1, lr_scale=0.5), 0)  # as an applied generation leaves it (tests/control cover the agreement)
    steps = _closure_loop(model, opt, agent, 3)
    assert seen_lr == [0.025, 0.025, 0.025] and opt.param_groups[0]["lr"] == 0.05
    ref = _reference_sgd(_model(2), 3, 0.025, 0.9)
    for (_, after, _), want in zip(steps, ref):
        assert all(torch.equal(a, b) for a, b in zip(after, want))
    agent.close(1.0)


@pytest.mark.parametrize("skip_nonfinite", [True, False])
def test_lbfgs_metrics_are_those_of_the_first_evaluation(skip_nonfinite: bool) -> None:
    """LBFGS evaluates its closure several times per step; the agent's step is the first
    evaluation (the gradient the step starts from), not the line search's."""
    model = _model(3)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, history_size=4)
    agent = _attach(model, opt, skip_nonfinite=skip_nonfinite)
    x, y = _batch(0)
    calls = []

    def closure():  # type: ignore[no-untyped-def]
        calls.append(1)
        opt.zero_grad()
        loss = (model(x) - y).square().mean()
        loss.backward()
        return loss

    # the reference gradient norm at the starting point, float64
    ref_model = _model(3)
    ref_loss = (ref_model(x) - y).square().mean()
    ref_loss.backward()
    ref_norm = math.sqrt(sum(p.grad.double().square().sum().item() for p in ref_model.parameters()))
    loss = opt.step(closure)
    agent.end_step(loss)
    latest = agent.latest()
    assert len(calls) > 1  # the line search did evaluate again
    assert latest["trainguard_grad_norm"] == pytest.approx(ref_norm, rel=1e-6)
    # every gradient statistic is the first evaluation's too (there were none at the pre-step hook)
    _assert_gradient_values(latest, {n: p.grad.double() for n, p in ref_model.named_parameters()})
    assert latest["trainguard_loss"] == pytest.approx(ref_loss.item(), rel=1e-6)
    assert "trainguard_grad_noise_scale" not in latest  # one gradient, no micro-batches
    assert latest["trainguard_agent_errors_total"] == 0.0
    agent.close(1.0)


def _assert_gradient_values(latest: dict[str, float], grads: dict[str, torch.Tensor]) -> None:
    """Every gradient value of a report of ``_model`` (layers "0" and "2" at ``layer_depth=1``)
    equals its float64 reference from ``grads`` (parameter name -> the step's gradient)."""
    every = torch.cat([g.reshape(-1) for g in grads.values()])
    assert latest["trainguard_grad_norm"] == pytest.approx(float(every.norm()), rel=1e-6)
    assert latest["trainguard_grad_max_abs"] == pytest.approx(float(every.abs().max()), rel=1e-6)
    assert latest["trainguard_nonfinite_grads"] == 0.0
    for layer in ("0", "2"):
        g = torch.cat([grads[f"{layer}.weight"].reshape(-1), grads[f"{layer}.bias"]])
        ref = {"norm": g.norm(), "mean": g.mean(), "std": g.std(unbiased=False), "max_abs": g.abs().max(),
               "min_abs": g.abs().min()}
        for stat, want in ref.items():
            got = latest[f'trainguard_layer_grad_{stat}{{layer="{layer}"}}']
            assert got == pytest.approx(float(want), rel=1e-4, abs=1e-9), (layer, stat)


@pytest.mark.parametrize("skip_nonfinite", [False, True])
@pytest.mark.parametrize("report_every", [1, 3])
def test_closure_steps_report_the_statistics_of_their_own_gradients(report_every: int, skip_nonfinite: bool) -> None:
    """``opt.step(closure)``: the optimizer's pre-step hook runs before the closure, while
    ``.grad`` holds the last step's gradients (none at step 1). Each report's per-layer statistics,
    largest |g| and update size are those of the gradients its own closure made (they were the
    last step's: step 2's layer "0" mean read step 1's, and step 1 had none)."""
    model = _model(5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # delta W = lr g: an update-size ratio of 1
    agent = _attach(model, opt, skip_nonfinite=skip_nonfinite, report_every=report_every, layer_depth=1)
    checked = []
    for step in range(1, 7):
        x, y = _batch(step)
        grads: dict[str, torch.Tensor] = {}

        def closure(x=x, y=y, grads=grads):  # type: ignore[no-untyped-def]
            opt.zero_grad()
            loss = (model(x) - y).square().mean()
            loss.backward()
            grads.update({n: p.grad.double().clone() for n, p in model.named_parameters()})
            return loss

        agent.end_step(opt.step(closure).detach())
        latest = agent.latest()
        if latest["trainguard_step"] == step:
            _assert_gradient_values(latest, grads)
            assert latest["trainguard_update_size_ratio"] == pytest.approx(1.0, rel=1e-5)
            checked.append(step)
    assert checked == ([1, 2, 3, 4, 5, 6] if report_every == 1 else [1, 3, 6])
    assert agent.latest()["trainguard_agent_errors_total"] == 0.0
    agent.close(1.0)


def test_lbfgs_skips_a_nonfinite_step_and_evaluates_once() -> None:
    model = _model(4)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    agent = _attach(model, opt, skip_nonfinite=True)
    steps = _closure_loop(model, opt, agent, 3, nan_at={2})
    before, after, calls = steps[1]
    assert calls == 1 and all(torch.equal(a, b) for a, b in zip(before, after))
    assert steps[2][2] > 1 and all(torch.isfinite(p).all() for p in steps[2][1])
    assert not all(torch.equal(a, b) for a, b in zip(steps[2][0], steps[2][1]))
    assert agent.latest()['trainguard_skipped_steps_total{reason="nonfinite"}'] == 1.0
    agent.close(1.0)


def test_a_closure_without_a_backward_pass_has_no_gradient_norm_not_the_last_steps() -> None:
    """Lightning's skipped batch: ``step(closure)`` whose closure zeroes the gradients and runs no
    backward pass. The pre-step hook runs before the closure, while ``.grad`` still holds the last
    step's gradients: those are not this step's (they read 1.10, the last step's norm, before)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = ta.attach(model, opt, job="j", run="r-closure", config=ta.AgentConfig(metrics_port=None, report_every=1))

    def closure(skip: bool):  # type: ignore[no-untyped-def]
        opt.zero_grad()
        if skip:
            return None
        loss = model(torch.randn(8, 4)).square().mean()
        loss.backward()
        return loss

    norms = []
    for skip in (False, True):
        loss = opt.step(lambda skip=skip: closure(skip))
        norms.append(agent.meter.grad_norm)
        agent.end_step(None if loss is None else loss.detach())
        latest = agent.latest()
        assert ("trainguard_grad_norm" in latest) == (not skip) and ("trainguard_loss" in latest) == (not skip)
    agent.close()
    assert norms[0] is not None and norms[1] is None


# ---------------------------------------------------------------------------- the state's age


def _steps(model: nn.Module, opt: torch.optim.Optimizer, agent, first: int, count: int) -> list[dict[str, float]]:  # type: ignore[no-untyped-def]
    reports = []
    for k in range(first, first + count):
        x, y = _batch(k)
        loss = (model(x) - y).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        agent.end_step(loss.detach())
        reports.append(agent.latest())
    return reports


@pytest.mark.parametrize("make", [torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop])
def test_the_state_age_is_the_steps_of_the_youngest_parameters_state(make) -> None:  # type: ignore[no-untyped-def]
    """Every parameter's state counts the steps taken (3); the last layer's, dropped as a
    reset_optimizer drops it, counts from its next step: the age is the youngest's."""
    model = _model()
    opt = make(model.parameters(), lr=1e-3)
    agent = _attach(model, opt)
    ages = [r.get("trainguard_optimizer_state_steps") for r in _steps(model, opt, agent, 0, 3)]
    for p in model[2].parameters():
        opt.state.pop(p)
    ages += [r.get("trainguard_optimizer_state_steps") for r in _steps(model, opt, agent, 3, 2)]
    agent.close()
    assert ages == [1.0, 2.0, 3.0, 1.0, 2.0]
    assert sorted(float(s["step"]) for s in opt.state.values()) == [2.0, 2.0, 5.0, 5.0]


def test_an_optimizer_without_a_step_count_reports_no_state_age() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    agent = _attach(model, opt)
    reports = _steps(model, opt, agent, 0, 2)
    agent.close()
    assert all("momentum_buffer" in s for s in opt.state.values())
    assert ["trainguard_optimizer_state_steps" in r for r in reports] == [False, False]


def test_state_age_reads_host_counts_and_leaves_device_counts_on_their_device() -> None:
    """A count in a host tensor or a Python number is read; counts on a device (a fused Adam's
    on CUDA: here the meta device, which has no values to read) stay a device tensor, the smaller
    host count folded in on the device."""
    opt = torch.optim.Adam([torch.zeros(1, requires_grad=True) for _ in range(4)])
    a, b, c, d = (p for group in opt.param_groups for p in group["params"])
    assert state_age(opt) is None  # before the first step
    opt.state[a] = {"step": torch.tensor(7.0)}
    opt.state[b] = {"step": 5}
    opt.state[c] = {"exp_avg": torch.zeros(1)}  # no count: left out
    assert state_age(opt) == 5.0
    opt.state[d] = {"step": torch.tensor(9.0, device="meta")}
    age = state_age(opt)
    assert isinstance(age, torch.Tensor) and age.device.type == "meta" and age.shape == ()


def test_the_state_age_of_many_tensors_finds_a_state_started_afresh() -> None:
    """Of 2,000 states a report reads the 64 created last and 64 spread over the rest: a state
    dropped (as reset_optimizer drops it) and created again at the next step is among the newest,
    and the count of a fresh optimizer's states is read whatever the parameter count (reading all 2,000 would cost
    about 1.5 ms of each report step)."""
    params = [torch.zeros(2, requires_grad=True) for _ in range(2000)]
    opt = torch.optim.Adam(params, lr=1e-3)
    for _ in range(4):
        for p in params:
            p.grad = torch.ones(2)
        opt.step()
    assert state_age(opt) == 4.0
    opt.state.pop(params[777])
    opt.step()
    assert float(opt.state[params[777]]["step"]) == 1.0 and state_age(opt) == 1.0
    fresh = torch.optim.Adam(params, lr=1e-3)
    fresh.step()
    assert state_age(fresh) == 1.0
