"""Data parallelism: two real processes (gloo), DistributedDataParallel, one micro-batch each.

The noise scale then comes from the ranks' local gradients (before the all-reduce) against the
all-reduced one; the global gradient norm is the all-reduced gradient's; the leader holds every
rank's gathered values, the other rank its own.
"""

from __future__ import annotations

import gc
import math
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.control.spawn import spawn_ranks

pytestmark = pytest.mark.distributed

WORLD, TOKENS = 2, 24


def _worker(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    import trainer_agent as ta

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    local: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        p.register_hook(lambda g, name=name: local.__setitem__(name, g.detach().double().clone()))
    agent = ta.attach(ddp, opt, job="ddp", run="ddp-1",
                      config=ta.AgentConfig(metrics_port=0, report_every=2, layer_depth=1))
    results = []
    for step in range(2):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(8, 6, generator=g)
        loss = ddp(x).square().mean()
        loss.backward()
        reduced = {n: p.grad.double().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        agent.end_step(loss, tokens=TOKENS)
        gathered: list[dict[str, torch.Tensor]] = [None] * WORLD  # type: ignore[list-item]
        dist.all_gather_object(gathered, local)
        results.append({"loss": float(loss), "reduced": reduced, "locals": gathered})
    latest = agent.latest()
    rank_values = agent.rank_values
    url = agent.metrics_url
    agent.close()
    del agent, ddp  # DDP holds the process group: free it before the group goes (clean exit)
    gc.collect()
    dist.destroy_process_group()
    torch.save({"latest": latest, "rank_values": rank_values, "url": url, "results": results},
               f"{out}/rank{rank}.pt")


def _sq(tensors) -> float:
    return sum(float((t * t).sum()) for t in tensors)


def test_ddp_noise_scale_and_rank_values(tmp_path) -> None:
    out = spawn_ranks(_worker, WORLD, tmp_path)
    last = out[0]["results"][-1]
    reduced = last["reduced"]
    # DDP averages: the reduced gradient is the mean of the ranks' local gradients.
    for name, g in reduced.items():
        assert torch.allclose(g, sum(loc[name] for loc in last["locals"]) / WORLD, rtol=1e-6)
    got = out[0]["latest"]
    assert got["trainguard_grad_norm"] == pytest.approx(math.sqrt(_sq(reduced.values())), rel=1e-5)
    # McCandlish, appendix A.1: B_small = one rank's batch, B_big = both ranks'.
    b_small, b_big = TOKENS, WORLD * TOKENS
    g_small = sum(_sq(loc.values()) for loc in last["locals"]) / WORLD
    g_big = _sq(reduced.values())
    g2 = (b_big * g_big - b_small * g_small) / (b_big - b_small)
    s = (g_small - g_big) / (1 / b_small - 1 / b_big)
    assert got["trainguard_grad_noise_scale"] == pytest.approx(s / g2, rel=1e-5)
    assert got["trainguard_grad_variance"] == pytest.approx(s, rel=1e-5)
    # The leader holds every rank's values of the report, the other ranks their own; ports are
    # base + local rank.
    losses = [o["results"][-1]["loss"] for o in out]
    for r in range(WORLD):
        rv = out[r]["rank_values"]
        assert rv["loss"] == pytest.approx(losses if r == 0 else [losses[r]], rel=1e-6)
        assert rv["micro_count"] == ([1.0] * WORLD if r == 0 else [1.0])
        assert out[r]["latest"]["trainguard_step"] == 2
    assert out[0]["url"] != out[1]["url"]
    assert 'trainguard_layer_grad_norm{layer="0"}' in got  # "module." of DDP is not a layer
    assert not any("layer=" in k for k in out[1]["latest"])  # per_layer="rank0" by default


ACCUM, STEPS, LR = 3, 4, 0.1


def _accum_worker(rank: int, init: str, out: str) -> None:
    """DDP with gradient accumulation: ACCUM micro-batches per step, all but the last under
    ``no_sync()``, each loss divided by ACCUM. Saves, per step, what a reference needs: the
    parameters before and after, the accumulated all-reduced gradient, every rank's incoming
    micro-batch gradients (seen by tensor hooks), the loss given to end_step."""
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    import trainer_agent as ta

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    micro: list[dict[str, torch.Tensor]] = []
    for name, p in model.named_parameters():
        p.register_hook(lambda g, name=name: micro[-1].__setitem__(name, g.detach().double().clone()))
    agent = ta.attach(ddp, opt, job="ddp", run="ddp-accum",
                      config=ta.AgentConfig(metrics_port=None, report_every=2, layer_depth=1, update_ratio="every"))
    steps = []
    for step in range(1, STEPS + 1):
        micro.clear()
        before = {n: p.detach().double().clone() for n, p in model.named_parameters()}
        loss_sum = 0.0
        for k in range(ACCUM):
            g = torch.Generator().manual_seed(1000 * step + 10 * rank + k)
            x = torch.randn(8, 6, generator=g)
            micro.append({})
            if k < ACCUM - 1:
                with ddp.no_sync():
                    loss = ddp(x).square().mean() / ACCUM
                    loss.backward()
            else:
                loss = ddp(x).square().mean() / ACCUM
                loss.backward()
            loss_sum += float(loss)
        reduced = {n: p.grad.double().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        agent.end_step(torch.tensor(loss_sum), tokens=TOKENS)
        after = {n: p.detach().double().clone() for n, p in model.named_parameters()}
        gathered: list[list[dict[str, torch.Tensor]]] = [None] * WORLD  # type: ignore[list-item]
        dist.all_gather_object(gathered, list(micro))
        steps.append({"loss": loss_sum, "before": before, "after": after, "reduced": reduced, "micro": gathered})
    latest, rank_values = agent.latest(), agent.rank_values
    agent.close()
    del agent, ddp
    gc.collect()
    dist.destroy_process_group()
    torch.save({"latest": latest, "rank_values": rank_values, "steps": steps}, f"{out}/rank{rank}.pt")


def _norm(tensors) -> float:
    return math.sqrt(_sq(tensors))


def test_ddp_with_gradient_accumulation_every_metric_against_a_float64_reference(tmp_path) -> None:
    out = spawn_ranks(_accum_worker, WORLD, tmp_path)
    steps = out[0]["steps"]
    got = out[0]["latest"]
    last = steps[-1]
    names = list(last["reduced"])
    # DDP's accumulated, averaged gradient: the mean over ranks of the sum of the micro-batch gradients
    for n in names:
        expected = sum(m[n] for rank_micro in last["micro"] for m in rank_micro) / WORLD
        assert torch.allclose(last["reduced"][n], expected, rtol=1e-6, atol=1e-9), n
    grad_norms = [_norm(s["reduced"].values()) for s in steps]
    assert got["trainguard_grad_norm"] == pytest.approx(grad_norms[-1], rel=1e-6)
    assert got["trainguard_grad_norm_max"] == pytest.approx(max(grad_norms[-2:]), rel=1e-6)  # the report's 2 steps
    w_after, w_before = list(last["after"].values()), list(last["before"].values())
    delta = [a - b for a, b in zip(w_after, w_before)]
    n_params = sum(t.numel() for t in w_after)
    assert got["trainguard_param_norm"] == pytest.approx(_norm(w_after), rel=1e-6)
    assert got["trainguard_param_scale"] == pytest.approx(_norm(w_after) / math.sqrt(n_params), rel=1e-6)
    assert got["trainguard_update_ratio"] == pytest.approx(_norm(delta) / _norm(w_before), rel=1e-5)
    assert got["trainguard_effective_lr"] == pytest.approx(_norm(delta) / grad_norms[-1], rel=1e-5)
    assert got["trainguard_effective_lr"] == pytest.approx(LR, rel=1e-5)  # plain SGD moves lr x g
    assert got['trainguard_learning_rate{group="0"}'] == LR
    for layer, prefix in (("0", "0."), ("2", "2.")):
        layer_names = [n for n in names if n.startswith(prefix)]
        assert got[f'trainguard_layer_grad_norm{{layer="{layer}"}}'] == pytest.approx(
            _norm(last["reduced"][n] for n in layer_names), rel=1e-6)
        assert got[f'trainguard_layer_param_norm{{layer="{layer}"}}'] == pytest.approx(
            _norm(last["after"][n] for n in layer_names), rel=1e-6)
        assert got[f'trainguard_layer_update_ratio{{layer="{layer}"}}'] == pytest.approx(
            _norm(last["after"][n] - last["before"][n] for n in layer_names)
            / _norm(last["before"][n] for n in layer_names), rel=1e-5)
    # McCandlish, appendix A.1, with the ACCUM x WORLD micro-batches as the small batches: each
    # micro-batch's own gradient is ACCUM x its incoming one (the loss was divided by ACCUM).
    smalls = [[ACCUM * m[n] for n in names] for rank_micro in last["micro"] for m in rank_micro]
    assert len(smalls) == ACCUM * WORLD
    b_small = TOKENS / ACCUM
    b_big = len(smalls) * b_small
    g_small = sum(_sq(s) for s in smalls) / len(smalls)
    g_big = _sq(last["reduced"].values())
    g2 = (b_big * g_big - b_small * g_small) / (b_big - b_small)
    s = (g_small - g_big) / (1 / b_small - 1 / b_big)
    assert got["trainguard_grad_variance"] == pytest.approx(s, rel=1e-5)
    assert got["trainguard_grad_noise_scale"] == pytest.approx(s / g2, rel=1e-5)
    assert got["trainguard_loss"] == pytest.approx(last["loss"], rel=1e-6)
    assert got["trainguard_step"] == STEPS
    assert got["trainguard_nonfinite_grads"] == 0 and got["trainguard_nonfinite_steps_total"] == 0
    for r in range(WORLD):
        rv = out[r]["rank_values"]
        held = list(range(WORLD)) if r == 0 else [r]  # the leader: every rank's values; the others: their own
        assert rv["loss"] == pytest.approx([out[q]["steps"][-1]["loss"] for q in held], rel=1e-6)
        assert rv["grad_norm"] == pytest.approx([grad_norms[-1]] * len(held), rel=1e-6)
        assert rv["micro_count"] == [float(ACCUM)] * len(held)
        # each rank's sum of squared micro-batch gradient norms (as incoming: loss / ACCUM)
        assert rv["micro_sq_sum"] == pytest.approx(
            [sum(_sq(m.values()) for m in last["micro"][q]) for q in held], rel=1e-5)


def _scaler_worker(rank: int, init: str, out: str) -> None:
    """The same two DDP runs under a GradScaler, once passed to attach and once found by the agent
    at its first step: every report's values, per run."""
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    import trainer_agent as ta

    runs = {}
    for passed in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        agent = ta.attach(ddp, opt, job="ddp", run=f"ddp-{passed}", scaler=scaler if passed else None,
                          config=ta.AgentConfig(metrics_port=None, report_every=1, layer_depth=1))
        seen = []
        for step in range(3):
            x = torch.randn(8, 6, generator=torch.Generator().manual_seed(100 * step + rank))
            loss = ddp(x).square().mean()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            reduced = sum(float(p.grad.double().square().sum()) for p in model.parameters()) ** 0.5
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            agent.end_step(loss, tokens=TOKENS)
            seen.append((reduced, agent.latest()))
        runs[passed] = (seen, agent.scaler is scaler)
        agent.close()
        del agent, ddp
        gc.collect()
    dist.destroy_process_group()
    torch.save(runs, f"{out}/rank{rank}.pt")


def test_ddp_with_a_grad_scaler_found_at_its_first_step_measures_as_with_it_passed(tmp_path) -> None:
    for rank, runs in enumerate(spawn_ranks(_scaler_worker, WORLD, tmp_path)):
        (passed, known), (found, adopted) = runs[True], runs[False]
        assert known and adopted
        noise = [step for step, (_, a) in enumerate(passed) if "trainguard_grad_noise_scale" in a]
        assert noise == ([0, 1, 2] if rank == 0 else []), noise  # the leader's, the step the scaler was found in too
        for step, ((reduced, a), (_, b)) in enumerate(zip(passed, found)):
            assert a["trainguard_grad_norm"] == pytest.approx(reduced, rel=1e-6)
            keys = ("trainguard_grad_norm", "trainguard_grad_noise_scale", "trainguard_grad_variance",
                    "trainguard_loss_scale", 'trainguard_layer_grad_norm{layer="0"}')
            assert [k in b for k in keys] == [k in a for k in keys], (step, [k in a for k in keys])
            for key in (k for k in keys if k in a):
                # The first step's norms were summed in float32 (with the scaler known: in float64).
                assert b[key] == (a[key] if step else pytest.approx(a[key], rel=1e-6)), (step, key)
            assert b["trainguard_agent_errors_total"] == 0
