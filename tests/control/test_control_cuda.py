"""The control plane with fused/foreach optimizers: the non-finite guard with fused and foreach
Adam (bit-identical; on CUDA exactly one host-device sync per optimizer step), lr_scale with a
tensor LR, and reports built from the agent's asynchronously copied values.

Every test runs on the CPU (the same code paths: fused/foreach kernels, tensor LR, the guard's
device-side flag) and again on CUDA where a GPU is present; only the sync count needs CUDA.
``TRAINGUARD_TEST_DEVICE=cpu`` or ``cuda`` runs one device only."""

from __future__ import annotations

import copy
import math
import os
import warnings

import pytest
import torch

import trainer_agent as ta
from tests.control.procs import ControllerProcess, module_controller, until

_ONLY = os.environ.get("TRAINGUARD_TEST_DEVICE")
_NEEDS_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = [pytest.param(d, marks=[_NEEDS_GPU] if d == "cuda" else [])
           for d in ("cpu", "cuda") if _ONLY in (None, d)]


def _model(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)).to(device)


def _x(step: int, device: str) -> torch.Tensor:
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(step)).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_skip_nonfinite_bit_identical_with_one_sync_per_step(impl: str, device: str) -> None:
    model = _model(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, **{impl: True})
    agent = ta.attach(model, opt, job="cuda", run=f"skip-{impl}",
                      config=ta.AgentConfig(skip_nonfinite=True, report_every=1000, update_ratio="off",
                                            grad_noise=False, per_layer="off", metrics_port=None))
    for step in range(1, 7):
        handle = None
        if step == 4:
            handle = model[2].weight.register_hook(lambda g: g * math.nan)
        loss = model(_x(step, device)).pow(2).mean()
        loss.backward()
        if handle is not None:
            handle.remove()
        params = [p.detach().clone() for p in model.parameters()]
        state = copy.deepcopy(opt.state_dict()["state"])
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        if device == "cuda":
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


@pytest.fixture(scope="module")
def ctl(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    yield from module_controller(tmp_path_factory)


@pytest.mark.integration
@pytest.mark.parametrize("device", DEVICES)
def test_lr_scale_with_a_tensor_lr_and_reports_from_async_copies(ctl: ControllerProcess, device: str) -> None:
    run = f"lr-tensor-{device}"
    model = _model(device)
    lr = torch.tensor(0.01, device=device)  # fused Adam takes a tensor LR on the CPU too
    opt = torch.optim.Adam(model.parameters(), lr=lr, fused=True)
    agent = ta.attach(model, opt, job="cuda", run=run,
                      config=ta.AgentConfig(controller=ctl.url, report_every=2, metrics_port=None))
    assert until(lambda: ctl.run_detail(run) is not None, 30.0)
    original = opt.param_groups[0]["lr"]
    used: list[float] = []
    opt.register_step_pre_hook(lambda o, a, k: used.append(float(o.param_groups[0]["lr"])))
    for step in range(1, 13):
        loss = model(_x(step, device)).pow(2).mean()
        loss.backward()
        opt.step()
        assert opt.param_groups[0]["lr"] is original  # the scheduler's object, restored
        opt.zero_grad()
        agent.end_step(loss)
        if step == 4:
            ctl.command(run, "lr-scale", scale=0.5)
            assert until(lambda: agent.control.client.desired.generation == 1, 30.0)
    at = [a.step for a in agent.control.history]
    assert at == [5]  # the next agreement (sync_every=1) after the command
    assert used == [pytest.approx(0.01, rel=1e-6)] * 5 + [pytest.approx(0.005, rel=1e-6)] * 7
    assert until(lambda: (reps := ctl.reports(run)) and reps[-1]["steps"][1] >= 12, 30.0)
    reports = ctl.reports(run)
    assert [r["steps"] for r in reports] == [(1, 1), (2, 2), *((s, s + 1) for s in range(3, 13, 2))]  # step 1 reports too
    assert all(math.isfinite(r["values"]["trainguard_loss"]) and r["ranks"]["loss"] == [r["values"]["trainguard_loss"]]
               for r in reports)
    assert ctl.acks(run) == [(1, 5)]
    agent.close(2.0)
