"""Element-wise fingerprints (``trainer_agent/fingerprint.py``): the projections against a naive
float64 reference, the cross-rank comparison, and a real 3-rank gloo DDP run whose last rank's
all-reduced gradient (or parameter) is perturbed in one element."""

from __future__ import annotations

import gc
import math
import os

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
