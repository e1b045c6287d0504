"""Pre-flight (``trainer_agent/diagnostics/preflight.py``): every check against a case that trips it and a
healthy one; nothing the loop owns changes (bit for bit); results reach the controller; a 2-rank
gloo run whose ranks start from different parameters."""

from __future__ import annotations

import gc
import math
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import trainer_agent as ta
from tests.control.fake_controller import FakeController
from tests.control.spawn import spawn_ranks


class Net(nn.Module):
    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(6, 8)
        self.norm = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(8, 2)
        self.unused = nn.Linear(3, 3) if unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(torch.tanh(self.norm(self.inp(x))))).square().mean()


def _batch(seed: int = 0) -> torch.Tensor:
    return torch.randn(16, 6, generator=torch.Generator().manual_seed(seed))


def _agent(model, opt, scaler=None, **cfg):
    cfg.setdefault("metrics_port", None)
    return ta.attach(model, opt, job="pf", run="pf-1", scaler=scaler, config=ta.AgentConfig(**cfg))


def _snapshot(model, opt):
    return ([p.detach().clone() for p in model.parameters()],
            [None if p.grad is None else p.grad.clone() for p in model.parameters()],
            [b.clone() for b in model.buffers()],
            {k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in s.items()} for k, s in opt.state_dict()["state"].items()},
            torch.get_rng_state())


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all() | (a.isnan() & b.isnan()).all())
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def test_preflight_changes_nothing_the_loop_owns_and_passes_a_healthy_setup() -> None:
    model = Net()
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-3)
    model(_batch(9)).backward()  # optimizer state and stale .grad exist before the pre-flight
    opt.step()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2000)
    agent = _agent(model, opt, scaler=scaler, metrics_port=0, report_every=1)
    before = _snapshot(model, opt)
    report = agent.preflight(_batch(), loss_fn=lambda m, b: m(b), clip_grad_norm=1.0)
    assert _same(_snapshot(model, opt), before)  # weights, .grad, buffers, optimizer state, RNG: bit for bit
    assert agent.step == 0
    status = {c.name: c.status for c in report.checks}
    assert status == {"nonfinite": "pass", "grad_values": "pass", "no_grad": "pass", "update_size": "pass",
                      "data": "skip", "adam_eps": "pass", "grad_clip": "pass", "weight_decay": "pass",
                      "grad_scaler": "pass", "ranks_agree": "skip", "metrics_endpoint": "pass", "controller": "skip",
                      "init_distribution": "pass", "loss_boundary": "skip", "amp_overflow": "pass",
                      "input_pipeline": "skip", "cuda_launch_blocking": "skip", "nccl_sockets": "skip",
                      "socket_buffers": "skip"}
    # Training goes on and is measured as usual after the pre-flight.
    opt.zero_grad()
    loss = model(_batch())
    loss.backward()
    opt.step()
    agent.end_step(loss.detach())
    assert agent.latest()["trainguard_step"] == 1.0
    agent.close()


def test_update_size_is_the_simulated_step_of_the_real_optimizer() -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=10.0)  # a step of 10x the gradient: far beyond 1e-2 of the weights
    agent = _agent(model, opt)
    report = agent.preflight(_batch())
    check = next(c for c in report.checks if c.name == "update_size")
    assert check.status == "warn" and "above 1e-2" in check.detail
    # Independent: plain SGD moves every layer by exactly lr x ||g||.
    model.train()
    grads = torch.autograd.grad(model(_batch()), [model.out.weight, model.out.bias])
    rows = check.values["layers"]
    assert rows["out"]["ratio"] == pytest.approx(1.0, rel=1e-6)
    assert rows["out"]["update"] == pytest.approx(10.0 * math.sqrt(sum(float(g.double().square().sum()) for g in grads)), rel=1e-5)
    agent.close()


@pytest.mark.parametrize("eps, declared, expect", [
    (1e-6, 13_000_000_000, "warn"),   # the 13B model with eps 1e-6
    (1e-8, 13_000_000_000, "pass"),
    (1e-6, None, "pass"),             # the small model as it is
])
def test_adam_eps_on_a_declared_13b_model(eps, declared, expect) -> None:
    model = Net()
    agent = _agent(model, torch.optim.Adam(model.parameters(), lr=1e-4, eps=eps))
    report = agent.preflight(_batch(), declared_params=declared)
    assert report.status("adam_eps") == expect
    agent.close()


def test_failures_and_warnings_name_what_is_wrong() -> None:
    model = Net(unused=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)  # decays biases and BatchNorm too
    scaler = torch.amp.GradScaler("cpu")  # PyTorch's defaults: 65536 and 2000
    agent = _agent(model, opt, scaler=scaler)
    report = agent.preflight(_batch(), loss_fn=lambda m, b: m(b) * 1e6, clip_grad_norm=None)
    by = {c.name: c for c in report.checks}
    assert by["grad_values"].status == "fail" and set(by["grad_values"].values["layers"]) >= {"out"}
    assert by["no_grad"].status == "warn" and by["no_grad"].values["no_gradient"] == ["unused.weight", "unused.bias"]
    assert by["weight_decay"].status == "warn" and "norm.weight" in by["weight_decay"].values["decayed"]
    assert by["grad_scaler"].status == "warn" and "65536" in by["grad_scaler"].detail
    assert by["grad_clip"].status == "warn"
    with pytest.raises(RuntimeError, match="grad_values"):
        agent.preflight(_batch(), loss_fn=lambda m, b: m(b) * 1e6, fatal=True)
    agent.preflight(_batch(), loss_fn=lambda m, b: m(b) * 1e6, fatal=("nonfinite",))  # not that one: no raise
    agent.close()


def test_nonfinite_loss_fails_and_can_be_fatal_by_configuration() -> None:
    model = Net()
    agent = _agent(model, torch.optim.SGD(model.parameters(), lr=0.1), preflight_fatal=("nonfinite",))
    with pytest.raises(RuntimeError, match="nonfinite"):
        agent.preflight(_batch(), loss_fn=lambda m, b: m(b) * math.nan)
    assert all(p.grad is None for p in model.parameters())
    agent.close()


def test_a_fatal_check_name_the_pre_flight_does_not_run_is_warned_about(caplog) -> None:
    model = Net()
    agent = _agent(model, torch.optim.SGD(model.parameters(), lr=0.1), preflight_fatal=("nonfinte",))
    with caplog.at_level("WARNING", logger="trainer_agent.diagnostics.preflight_report"):
        report = agent.preflight(_batch(), loss_fn=lambda m, b: m(b) * math.nan)  # fails, but names no fatal check
    assert report.status("nonfinite") == "fail"
    assert "preflight_fatal names nonfinte, which this pre-flight did not run" in caplog.text
    assert "nonfinite" in caplog.text.split("it ran: ")[1]
    agent.close()


def test_data_check_reads_the_batch_token_ids() -> None:
    class Lm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(50, 4)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.emb(ids.clamp(0, 49)).square().mean()

    model = Lm()
    agent = _agent(model, torch.optim.SGD(model.parameters(), lr=0.1), vocab_size=50, special_ids=(0,))
    good = torch.arange(40).reshape(4, 10) + 1
    assert agent.preflight({"input_ids": good}, loss_fn=lambda m, b: m(b["input_ids"])).status("data") == "pass"
    repeated = good.clone()
    repeated[1] = repeated[0]
    check = next(c for c in agent.preflight(repeated).checks if c.name == "data")
    assert check.status == "warn" and check.values["repeated_sequence_ratio"] == 0.25
    outside = good.clone()
    outside[2, 3] = 50
    assert agent.preflight(outside).status("data") == "fail"
    agent.close()


def test_results_reach_the_controller() -> None:
    with FakeController() as ctl:
        model = Net()
        agent = _agent(model, torch.optim.SGD(model.parameters(), lr=0.1), controller=ctl.url)
        report = agent.preflight(_batch())
        assert report.status("controller") == "pass"
        assert ctl.wait_for(lambda: len(ctl.preflights) == 1)
        sent = ctl.preflights[0]
        assert [(c.name, c.status) for c in sent.checks] == [(c.name, c.status) for c in report.checks]
        agent.close(1.0)


def test_bad_arguments_are_refused() -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = _agent(model, opt)
    with pytest.raises(ValueError, match="declared_params"):
        agent.preflight(_batch(), declared_params=-3)
    with pytest.raises(ValueError, match="scalar loss"):
        agent.preflight(_batch(), loss_fn=lambda m, b: torch.ones(3))
    model(_batch()).backward()
    opt.step()
    agent.end_step(1.0)
    with pytest.raises(ValueError, match="before the first training step"):
        agent.preflight(_batch())
    agent.close()


def _worker(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 1))
    agent = ta.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), job="pf", run="pf-2",
                      config=ta.AgentConfig(metrics_port=None, layer_depth=1))
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    first = agent.preflight(x, loss_fn=lambda m, b: m(b).square().mean())
    if rank == 1:
        with torch.no_grad():
            model[2].weight[0, 3] += 1e-3 * float(torch.cat([p.reshape(-1) for p in model[2].parameters()]).norm())
    second = agent.preflight(x, loss_fn=lambda m, b: m(b).square().mean())
    agent.close()
    dist.destroy_process_group()
    gc.collect()
    torch.save({"first": first.status("ranks_agree"),
                "second": next(c for c in second.checks if c.name == "ranks_agree")}, f"{out}/rank{rank}.pt")


@pytest.mark.distributed
def test_ranks_that_start_from_different_parameters_fail(tmp_path) -> None:
    out = spawn_ranks(_worker, 2, tmp_path, timeout=120)
    for r in out:
        assert r["first"] == "pass"
        check = r["second"]
        assert check.status == "fail" and "'2'" in check.detail
        (layer,) = check.values["layers"]
        assert layer["layer"] == "2" and layer["ranks"] == (0, 1) and layer["rel_diff"] == pytest.approx(1e-3, rel=1e-3)
