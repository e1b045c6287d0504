"""The control plane with CUDA parameters (skipped without a GPU): the non-finite guard with fused
and foreach Adam (bit-identical, exactly one host-device sync per optimizer step), lr_scale with a
tensor LR, and reports built from the agent's asynchronously copied values."""

from __future__ import annotations

import copy
import math
import os
import warnings

import pytest
import torch

import trainer_agent as ta
from tests.control.fake_controller import FakeController
from tests.control.procs import until

DEVICE = os.environ.get("TRAINGUARD_TEST_DEVICE", "cuda")  # 'cpu' exercises the same code paths here
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)).to(DEVICE)


def _x(step: int) -> torch.Tensor:
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(step)).to(DEVICE)


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_skip_nonfinite_bit_identical_with_one_sync_per_step(impl: str) -> None:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, **{impl: True})
    agent = ta.attach(model, opt, job="cuda", run=f"skip-{impl}",
                      config=ta.AgentConfig(skip_nonfinite=True, report_every=1000, update_ratio="off",
                                            grad_noise=False, per_layer="off", metrics_port=None))
    for step in range(1, 7):
        handle = None
        if step == 4:
            handle = model[2].weight.register_hook(lambda g: g * math.nan)
        loss = model(_x(step)).pow(2).mean()
        loss.backward()
        if handle is not None:
            handle.remove()
        params = [p.detach().clone() for p in model.parameters()]
        state = copy.deepcopy(opt.state_dict()["state"])
        if DEVICE == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        if DEVICE == "cuda":
            torch.cuda.set_sync_debug_mode("default")
            syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
            assert len(syncs) == 1, [str(w.message) for w in caught]  # the guard's one read
        changed = [not torch.equal(a, p) for a, p in zip(params, model.parameters())]
        if step == 4:
            assert not any(changed)
            after = opt.state_dict()["state"]
            for k in state:
                for name, t in state[k].items():
                    assert torch.equal(t, after[k][name]), (k, name)
        else:
            assert all(changed)
        opt.zero_grad()
        agent.end_step(loss)
    assert agent.latest()['trainguard_skipped_steps_total{reason="nonfinite"}'] == 1.0
    agent.close(2.0)


def test_lr_scale_with_a_tensor_lr_and_reports_from_async_copies() -> None:
    with FakeController() as ctl:
        model = _model()
        lr = torch.tensor(0.01, device=DEVICE) if DEVICE == "cuda" else 0.01
        opt = torch.optim.Adam(model.parameters(), lr=lr, fused=DEVICE == "cuda")
        agent = ta.attach(model, opt, job="cuda", run="lr-cuda",
                          config=ta.AgentConfig(controller=ctl.url, report_every=2, metrics_port=None))
        original = opt.param_groups[0]["lr"]
        used: list[float] = []
        opt.register_step_pre_hook(lambda o, a, k: used.append(float(o.param_groups[0]["lr"])))
        for step in range(1, 13):
            loss = model(_x(step)).pow(2).mean()
            loss.backward()
            opt.step()
            assert opt.param_groups[0]["lr"] is original  # the scheduler's object, restored
            opt.zero_grad()
            agent.end_step(loss)
            if step == 4:
                ctl.command("lr-cuda", lr_scale=0.5)
                assert until(lambda: agent.control.client.desired.generation == 1)
        at = [a.step for a in agent.control.history]
        assert at == [5]  # the next agreement (sync_every=1) after the command
        assert used == [pytest.approx(0.01, rel=1e-6)] * 5 + [pytest.approx(0.005, rel=1e-6)] * 7
        assert until(lambda: ctl.reports and ctl.reports[-1].step_last >= 10)
        ranges = [(r.step_first, r.step_last) for r in ctl.reports]
        assert all(b[0] == a[1] + 1 for a, b in zip(ranges, ranges[1:])) and ranges[0][0] == 1
        assert all(math.isfinite(r.values["trainguard_loss"]) and r.ranks.loss == [r.values["trainguard_loss"]]
                   for r in ctl.reports)
        agent.close(2.0)
