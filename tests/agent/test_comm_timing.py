"""trainer_agent/measure/comm_timing.py: the interval arithmetic on given timestamps, and two gloo ranks with
DDP (several buckets, one rank slowed inside its backward, the other late to its first step) beside a
DDP model carrying the user's own communication hook."""

from __future__ import annotations

import gc
import math
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.control.spawn import spawn_ranks
from trainer_agent.measure.comm_timing import COMM_METRICS, CommTiming, step_comm

WORLD, STEPS, SLEEP = 2, 4, 0.2
LATE = 1.0  # rank 1 starts its first step this much later (a data loader or a compilation warming up)


def test_union_counts_overlapping_buckets_once() -> None:
    # [0, 3] and [1, 4] overlap in [1, 3]: in flight 0..4; [6, 7] after a gap.
    comm, exposed = step_comm([(1.0, 4.0), (0.0, 3.0), (6.0, 7.0)])
    assert comm == 4.0 + 1.0
    assert exposed == 7.0 - 6.0  # the last launch (6) to the last completion (7)


def test_bucket_inside_another_adds_nothing() -> None:
    assert step_comm([(0.0, 10.0), (2.0, 3.0)]) == (10.0, 10.0 - 2.0)


def test_exposed_from_the_given_backward_end_clipped_at_zero() -> None:
    assert step_comm([(0.0, 2.0), (1.0, 5.0)], backward_end=4.5) == (5.0, 0.5)
    assert step_comm([(0.0, 2.0)], backward_end=3.0) == (2.0, 0.0)  # hidden behind compute
    assert step_comm([]) == (0.0, 0.0)


def test_interval_that_ends_before_it_starts_is_refused() -> None:
    with pytest.raises(ValueError, match="ends"):
        step_comm([(2.0, 1.0)])


def test_not_ddp_reports_nan_without_an_error() -> None:
    errors: list[str] = []
    timing = CommTiming(nn.Linear(2, 2), on_error=lambda kind, exc: errors.append(kind), clock=time.perf_counter)
    timing.step_ended(0.1)
    assert all(math.isnan(v) for v in timing.take().values())
    assert set(timing.take()) == set(COMM_METRICS)
    assert errors == []


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(16, 64, generator=torch.Generator().manual_seed(100 * step + rank))


def _worker(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    import trainer_agent as ta

    cfg = ta.AgentConfig(metrics_port=None, report_every=STEPS, comm_timing=True)
    torch.manual_seed(0)
    timed_model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    if rank == 1:  # the first layer's gradient comes last: rank 1 is late with the last bucket
        timed_model[0].weight.register_hook(lambda g: time.sleep(SLEEP))
    # ~17 KB per layer, buckets of at most ~20 KB: one bucket per layer or so.
    timed = nn.parallel.DistributedDataParallel(timed_model, bucket_cap_mb=0.02)
    torch.manual_seed(0)
    own = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 1)))
    own.register_comm_hook(None, allreduce_hook)  # the user's own hook: the agent's cannot go in
    runs = []
    for ddp in (timed, own):
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        runs.append((ddp, opt, ta.attach(ddp, opt, job="comm", run=f"comm-{len(runs)}", config=cfg)))
    timing = runs[0][2].comm
    seen: list[list[tuple[float, float]]] = []  # each step's bucket timestamps, as the agent closes it
    step_ended = timing.step_ended
    timing.step_ended = lambda *args: (seen.append(list(timing._bucket_times)), step_ended(*args))
    losses, reports = [], []
    for step in range(STEPS):
        if step == 0 and rank == 1:
            time.sleep(LATE)
        for ddp, opt, agent in runs:
            loss = ddp(_batch(step, rank)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            agent.end_step(loss)
        losses.append(float(loss))
        reports.append((dict(runs[0][2].latest()), dict(runs[0][2].rank_values)))
    result = {"seen": seen, "losses": losses, "reports": reports,
              "own_weight": [p.detach().clone() for p in own.parameters()]}
    for name, (_, _, agent) in zip(("timed", "own"), runs):
        result[name] = {"latest": agent.latest(), "rank_values": agent.rank_values}
        agent.close()
    del runs, timed, own
    gc.collect()
    dist.destroy_process_group()
    torch.save(result, f"{out}/rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return spawn_ranks(_worker, WORLD, tmp_path_factory.mktemp("comm"))


@pytest.mark.distributed
def test_two_gloo_ranks_ddp_comm_times_and_users_own_hook(ranks) -> None:
    out = ranks
    for rank, got in enumerate(out):
        seen = got["seen"]
        assert len(seen) == STEPS and all(len(times) >= 3 for times in seen[1:])  # several buckets
        timed = got["timed"]["latest"]
        comm, exposed = timed["trainguard_comm_seconds"], timed["trainguard_comm_exposed_seconds"]
        # The report's values are the mean per step over the interval's steps (after step 1's report).
        per_step = [step_comm(times) for times in seen[1:]]
        assert comm == pytest.approx(sum(c for c, _ in per_step) / (STEPS - 1), rel=1e-9)
        assert exposed == pytest.approx(sum(e for _, e in per_step) / (STEPS - 1), rel=1e-9)
        assert comm > 0, rank
        assert 0 <= exposed <= comm, rank
        assert 0 <= timed["trainguard_comm_exposed_ratio"] <= 1
        assert timed["trainguard_agent_errors_total"] == 0
        # The gathered per-rank vectors carry each rank's own value: the leader holds every
        # rank's (its own first), the other rank only its own.
        assert len(got["timed"]["rank_values"]["comm_seconds"]) == (WORLD if rank == 0 else 1)
        assert got["timed"]["rank_values"]["comm_seconds"][0] == pytest.approx(comm, rel=1e-12)
        assert got["timed"]["rank_values"]["comm_exposed_ratio"][0] == pytest.approx(
            timed["trainguard_comm_exposed_ratio"], rel=1e-12)
    assert out[0]["timed"]["rank_values"]["comm_seconds"][1] == out[1]["timed"]["rank_values"]["comm_seconds"][0]
    # Rank 0 finished its backward first and waited for rank 1's late last bucket, every step.
    exposed0 = out[0]["timed"]["latest"]["trainguard_comm_exposed_seconds"]
    exposed1 = out[1]["timed"]["latest"]["trainguard_comm_exposed_seconds"]
    assert exposed0 >= SLEEP / 2
    assert exposed1 < exposed0
    # The user's own hook: NaN, one agent error, training went on and kept the replicas equal.
    for got in out:
        own = got["own"]["latest"]
        assert all(math.isnan(own[name]) for name in COMM_METRICS)
        assert own["trainguard_agent_errors_total"] == 1
        assert own["trainguard_step"] == STEPS
        assert all(math.isnan(v) for v in got["own"]["rank_values"]["comm_seconds"])
    for a, b in zip(out[0]["own_weight"], out[1]["own_weight"]):
        assert torch.equal(a, b)


@pytest.mark.distributed
def test_the_first_step_s_communication_is_left_out(ranks) -> None:
    """Rank 1 comes to its first step a second late: rank 0's first all-reduce waits for it (and,
    on the first step, for the communicator's setup), a second of exposed communication that is
    the warm-up's, not the network's. The report of step 1 has no communication values (NaN in
    the rank's row), and the report of step 4 is the mean of steps 2-4 only."""
    first_step = step_comm(ranks[0]["seen"][0])
    assert first_step[1] >= LATE / 2  # what the first report showed: the wait for rank 1's start
    for got in ranks:
        (first, first_ranks), *_, (last, _) = got["reports"]
        assert first["trainguard_step"] == 1 and last["trainguard_step"] == STEPS
        assert [name for name in COMM_METRICS if name in first] == []
        assert math.isnan(first_ranks["comm_seconds"][0]) and math.isnan(first_ranks["comm_exposed_ratio"][0])
        per_step = [step_comm(times) for times in got["seen"][1:]]
        assert last["trainguard_comm_exposed_seconds"] == pytest.approx(
            sum(e for _, e in per_step) / (STEPS - 1), rel=1e-9)
