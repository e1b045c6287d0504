"""Element-wise fingerprints (``trainer_agent/fingerprint.py``): the projections against a naive
float64 reference, the cross-rank comparison, and a real 3-rank gloo DDP run whose last rank's
all-reduced gradient (or parameter) is perturbed in one element."""

from __future__ import annotations

import gc
import math
import os
from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.control.spawn import spawn_ranks
from trainer_agent.fingerprint import TILE, Fingerprinter, desync, findings


def _weights(fp: Fingerprinter, i: int, n: int) -> torch.Tensor:
    """The +-1 weights of tensor ``i`` (numel ``n``) as a dense (n, K) float64 matrix."""
    r = fp._r[torch.float32].double()
    s = fp._s[i]
    m = 0 if s is None else s.shape[0]
    w = torch.empty(n, fp.k, dtype=torch.float64)
    for j in range(n):
        w[j] = s[j // TILE].double() * r[j % TILE] if j < m * TILE else r[j - m * TILE]
    return w


def test_projection_matches_a_naive_sum_and_moves_by_the_perturbation() -> None:
    numels = [3, TILE, 2 * TILE + 17]
    fp = Fingerprinter(numels, torch.tensor([0, 1, 1]), 2, projections=2, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(n, generator=g) for n in numels]
    got = fp.project(xs)
    for i, (x, n) in enumerate(zip(xs, numels)):
        w = _weights(fp, i, n)
        assert set(w.unique().tolist()) == {-1.0, 1.0}
        ref = (x.double().unsqueeze(1) * w).sum(0)
        assert torch.allclose(got[i], ref, rtol=1e-5, atol=1e-4)
    # One element changed by d: every projection moves by exactly +-d.
    d = 0.5
    ys = [x.clone() for x in xs]
    ys[2][TILE + 5] += d
    moved = (fp.project(ys) - got).abs()
    assert torch.allclose(moved[2], torch.full((2,), d, dtype=torch.float64), rtol=1e-4)
    assert moved[:2].abs().max() == 0
    # Per layer: projections summed, and the layer's L2 norm.
    per_layer = fp.layer_values([xs])
    assert torch.allclose(per_layer[1, :2], got[1] + got[2])
    assert per_layer[1, 2] == pytest.approx(math.sqrt(float(xs[1].double().square().sum() + xs[2].double().square().sum())), rel=1e-6)
    # Two fingerprinters (two ranks, two processes) draw the same weights.
    again = Fingerprinter(numels, torch.tensor([0, 1, 1]), 2, projections=2, device=torch.device("cpu"))
    assert torch.equal(again.project(xs), got)


def _rows(values: list[list[float]], norms: list[float]) -> torch.Tensor:
    """Rows of one layer, one projection: grad fingerprint f, norm; params identical (1.0, 1.0)."""
    return torch.tensor([[f, n, 1.0, 1.0] for f, n in zip(values, norms)], dtype=torch.float64).reshape(len(norms), -1)


@pytest.mark.parametrize("fs, bad, expected", [
    ([[2.0], [2.0], [2.0]], (), 0.0),
    ([[2.0], [2.0], [2.0 + 4e-4]], (2,), 1e-4),      # rel. to the layer norm 4.0
    ([[2.0], [2.0], [2.0 + 4e-7]], (), 1e-7),         # below the tolerance
    ([[2.0], [2.0 + 4e-4]], (0, 1), 1e-4),            # two ranks: nothing says which is wrong
    ([[2.0], [math.nan], [2.0]], (1,), math.inf),      # non-finite against finite
    ([[math.nan], [math.nan]], (), 0.0),               # identical (e.g. no step taken anywhere)
])
def test_desync_names_the_differing_ranks(fs, bad, expected) -> None:
    world = len(fs)
    vec = desync(_rows([f[0] for f in fs], [4.0] * world), layers=1, k=1)
    vectors, found = findings(vec.tolist(), world, ["blocks.0"], 1e-5)
    worst = max(vectors["grad_desync"])
    assert worst == pytest.approx(expected, rel=1e-3, abs=1e-12) if math.isfinite(expected) else worst == math.inf
    assert max(vectors["param_desync"]) == 0.0
    if bad:
        assert [(d.kind, d.layer, d.ranks) for d in found] == [("grad", "blocks.0", bad)]
    else:
        assert found == []


def test_desync_compares_each_replica_group_only() -> None:
    """4 ranks, two units: unit 0 replicated as HSDP 2x2 (ranks {0, 2} and {1, 3} hold the same
    shards, the pairs different ones), unit 1 replicated on every rank."""
    groups = [(torch.tensor([0]), torch.tensor([[0, 2], [1, 3]])), (torch.tensor([1]), torch.arange(4).view(1, 4))]
    unit0 = [2.0, 7.0, 2.0, 7.0 + 4e-4]          # rank 3 differs from its replica, rank 1
    unit1 = [3.0, 3.0, 3.0 + 4e-7, 3.0]          # in tolerance
    rows = torch.tensor([[unit0[r], 4.0, unit1[r], 4.0, 1.0, 1.0, 1.0, 1.0] for r in range(4)], dtype=torch.float64)
    vec = desync(rows, layers=2, k=1, groups=groups)
    vectors, found = findings(vec.tolist(), 4, ["blocks.0", "norm"], 1e-5)
    assert [(d.kind, d.layer, d.ranks) for d in found] == [("grad", "blocks.0", (1, 3))]
    assert found[0].rel_diff == pytest.approx(1e-4, rel=1e-3)
    assert vectors["grad_desync"] == pytest.approx([0.0, 1e-4, 1e-7, 1e-4], rel=1e-3, abs=1e-12)
    assert vectors["grad_desync_layer"] == [0.0, 0.0, 1.0, 0.0]
    # Compared with the whole world instead, the pairs' different shards would be a desync.
    _, everyone = findings(desync(rows, layers=2, k=1).tolist(), 4, ["blocks.0", "norm"], 1e-5)
    assert everyone[0].rel_diff > 1.0


def test_left_out_tensors_are_neither_projected_nor_normed() -> None:
    fp = Fingerprinter([3, 5, 4], torch.tensor([0, -1, 0]), 1, projections=2, device=torch.device("cpu"))
    everything = Fingerprinter([3, 5, 4], torch.tensor([0, 1, 0]), 2, projections=2, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(n, generator=g) for n in (3, 5, 4)]
    assert torch.equal(fp.layer_values([xs]), everything.layer_values([xs])[:1])
    only_first = fp.layer_values([xs], skip={2})
    assert torch.equal(only_first[0, :2], everything.project([xs[0]] + [torch.zeros(())] * 2)[0])
    assert only_first[0, 2] == pytest.approx(float(xs[0].double().norm()), rel=1e-6)


WORLD = 3
# (step, what rank 2 perturbs, relative size): reports every 2 steps.
PLAN = {4: ("grad", 1e-7), 6: ("grad", 1e-4), 8: ("param", 1e-4)}


def _worker(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    import trainer_agent as ta

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(80, 64), nn.Tanh(), nn.Linear(64, 80))  # 5120 > TILE weights
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    agent = ta.attach(ddp, opt, job="fp", run="fp-1",
                      config=ta.AgentConfig(metrics_port=None, report_every=2, layer_depth=1))
    seen = {}
    for step in range(1, 9):
        x = torch.randn(4, 80, generator=torch.Generator().manual_seed(100 * step + rank))
        loss = ddp(x).square().mean()
        loss.backward()
        what = PLAN.get(step)
        if rank == WORLD - 1 and what is not None and what[0] == "grad":
            layer = [p.grad for p in model[2].parameters()]
            norm = math.sqrt(sum(float(g.double().square().sum()) for g in layer))
            model[2].weight.grad[7, 3] += what[1] * norm
        opt.step()
        if rank == WORLD - 1 and what is not None and what[0] == "param":
            with torch.no_grad():
                norm = math.sqrt(sum(float(p.double().square().sum()) for p in model[0].parameters()))
                model[0].weight[1, 2] += what[1] * norm
        opt.zero_grad()
        agent.end_step(loss)
        if step % 2 == 0:
            agent.latest()
            seen[step] = ([(d.kind, d.layer, d.ranks, d.rel_diff) for d in agent.desync],
                          {k: agent.rank_values[k] for k in ("grad_desync", "param_desync", "grad_fingerprint")})
    agent.close()
    del agent, ddp
    gc.collect()
    dist.destroy_process_group()
    torch.save(seen, f"{out}/rank{rank}.pt")


@pytest.mark.distributed
def test_ddp_perturbed_rank_and_layer_are_named(tmp_path) -> None:
    out = spawn_ranks(_worker, WORLD, tmp_path, timeout=120)
    for seen in out:  # every rank compares the gathered fingerprints alike
        assert seen == out[0]
    seen = out[0]
    assert seen[2][0] == []                                   # in sync: bit-identical
    assert set(seen[2][1]["grad_desync"]) == {0.0}
    assert len(set(seen[2][1]["grad_fingerprint"])) == 1
    assert seen[4][0] == []                                   # 1e-7 of the layer's norm: in tolerance
    assert 0 < max(seen[4][1]["grad_desync"]) < 1e-5
    (kind, layer, ranks, rel), *rest = seen[6][0]             # 1e-4: found, rank and layer named
    assert (kind, layer, ranks) == ("grad", "2", (2,))
    assert rel == pytest.approx(1e-4, rel=1e-2)
    assert [d for d in rest if d[0] == "grad"] == []
    params = [d for d in seen[8][0] if d[0] == "param"]
    assert params[0][:3] == ("param", "0", (2,))
    assert params[0][3] == pytest.approx(1e-4, rel=1e-2)


# ---------------------------------------------------------------- sharded parameters (DTensors)
# Under HSDP (mesh 2x2: replicate x shard) and tensor parallel (2 ranks) only the replicas of a
# shard are compared. The plan perturbs, on one rank, the local gradient of layer "3" (reduced
# over the replicas: the same on every replica) and then the local parameter of layer "0" (the
# LayerNorm), each by a size relative to the norm of the layer's replicated local tensors.
SHARDED_PLAN = {2: ("grad", 1e-7), 3: ("grad", 1e-4), 4: ("param", 1e-7), 5: ("param", 1e-4)}
# The perturbing rank and the ranks holding the same shards as it (the mesh's replicate groups).
SHARDED = {"hsdp": (4, 3, (1, 3)), "tp": (2, 1, (0, 1))}


def _sharded_model(mode: str, world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6))
    if mode == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        for layer in (model[0], model[1], model[3]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:  # the norm's weight and bias and the row-wise layer's bias are replicated DTensors
        mesh = init_device_mesh("cpu", (world,))
        parallelize_module(model, mesh, {"0": SequenceParallel(), "1": ColwiseParallel(input_layouts=Shard(1)),
                                         "3": RowwiseParallel()})
    return model


def _replicated_locals(mode: str, layer: nn.Module) -> list[torch.Tensor]:
    """The local tensors of ``layer`` that the ranks' replicas share: under HSDP every parameter
    (replicated along the replicate dimension), under TP those replicated on the whole mesh."""
    return [p._local_tensor for p in layer.parameters()
            if mode == "hsdp" or not any(pl.is_shard() for pl in p.placements)]


def _sharded_worker(mode: str, rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    world, bad_rank, _ = SHARDED[mode]
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    import trainer_agent as ta

    model = _sharded_model(mode, world)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = ta.attach(model, opt, job="fp", run=f"fp-{mode}",
                      config=ta.AgentConfig(metrics_port=None, report_every=1, layer_depth=1))
    # Pre-flight: the replicas start from the same parameters; then one rank's norm weight moved
    # by 1e-3 of the layer (restored afterwards) must fail the check, naming the layer.
    x0 = torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(rank))
    checks = {"clean": agent.preflight(x0, loss_fn=lambda m, b: m(b).square().mean(), clip_grad_norm=None)}
    weight = model[0].weight._local_tensor
    kept = weight[1].clone()
    if rank == bad_rank:
        norm = math.sqrt(sum(float(t.double().square().sum()) for t in _replicated_locals(mode, model[0])))
        with torch.no_grad():
            weight[1] += 1e-3 * norm
    checks["moved"] = agent.preflight(x0, loss_fn=lambda m, b: m(b).square().mean(), clip_grad_norm=None)
    with torch.no_grad():
        weight[1] = kept
    seen = {0: {k: next((c.status, c.values) for c in r.checks if c.name == "ranks_agree")
                for k, r in checks.items()}}
    for step in range(1, 6):
        # Each rank its own batch (data parallelism; under TP its own part of the sequence).
        x = torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(100 * step + rank))
        loss = model(x).square().mean()
        loss.backward()
        what = SHARDED_PLAN.get(step)
        with torch.no_grad():
            if rank == bad_rank and what is not None and what[0] == "grad":
                grads = [p.grad for p in model[3].parameters()
                         if mode == "hsdp" or not any(pl.is_shard() for pl in p.placements)]
                norm = math.sqrt(sum(float(g._local_tensor.double().square().sum()) for g in grads))
                model[3].bias.grad._local_tensor[1] += what[1] * norm
            opt.step()
            if rank == bad_rank and what is not None and what[0] == "param":
                norm = math.sqrt(sum(float(t.double().square().sum()) for t in _replicated_locals(mode, model[0])))
                model[0].weight._local_tensor[1] += what[1] * norm
        opt.zero_grad()
        agent.end_step(loss)
        latest = agent.latest()
        seen[step] = ([(d.kind, d.layer, d.ranks, d.rel_diff) for d in agent.desync],
                      {k: agent.rank_values[k] for k in ("grad_desync", "param_desync", "grad_fingerprint",
                                                         "param_fingerprint")},
                      latest["trainguard_agent_errors_total"])
    agent.close()
    del agent, model, opt
    gc.collect()
    dist.destroy_process_group()
    torch.save(seen, f"{out}/rank{rank}.pt")


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["tp", "hsdp"])
def test_sharded_replicas_perturbed_rank_and_layer_are_named(mode: str, tmp_path) -> None:
    world, bad_rank, group = SHARDED[mode]
    out = spawn_ranks(partial(_sharded_worker, mode), world, tmp_path, timeout=240)
    for seen in out:  # every rank compares the gathered fingerprints alike
        assert seen == out[0]
    seen = out[0]
    pre = seen.pop(0)
    assert pre["clean"][0] == "pass"
    assert pre["moved"][0] == "fail"
    assert [(d["kind"], d["layer"], tuple(d["ranks"])) for d in pre["moved"][1]["layers"]] == [("param", "0", group)]
    assert {errors for _, _, errors in seen.values()} == {0.0}
    found, vectors, _ = seen[1]                               # in sync: the replicas bit-identical
    assert found == []
    assert set(vectors["grad_desync"]) == set(vectors["param_desync"]) == {0.0}
    for kind in ("grad_fingerprint", "param_fingerprint"):
        assert len({vectors[kind][r] for r in group}) == 1
        if mode == "hsdp":  # the other replica pair holds the other shards: different values
            assert vectors[kind][0] != vectors[kind][1]
    assert seen[2][0] == []                                   # 1e-7 of the layer: in tolerance
    assert 0 < max(seen[2][1]["grad_desync"]) < 1e-5
    grads = [d for d in seen[3][0] if d[0] == "grad"]          # 1e-4: found, ranks and layer named
    assert [d[:3] for d in grads] == [("grad", "3", group)]   # two replicas: nothing says which
    assert grads[0][3] == pytest.approx(1e-4, rel=1e-2)
    assert bad_rank in group
    others = [r for r in range(world) if r not in group]
    assert all(seen[3][1]["grad_desync"][r] == 0.0 for r in others)
    assert [d for d in seen[4][0] if d[1] == "0"] == []       # the norm's 1e-7: in tolerance
    params = [d for d in seen[5][0] if d[:2] == ("param", "0")]
    assert [d[:3] for d in params] == [("param", "0", group)]
    assert params[0][3] == pytest.approx(1e-4, rel=1e-2)
    assert all(seen[5][1]["param_desync"][r] == 0.0 for r in others)
