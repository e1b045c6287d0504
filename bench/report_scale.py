"""The report pipeline's cost against the world size: training-thread CPU per report on the leader
and on another rank, with synthetic gathered rows of W ranks fed to the report code.

    .venv/bin/python bench/report_scale.py                       # W = 512, 4,096, 32,768 (~1 min)
    .venv/bin/python bench/report_scale.py --world 512 4096 --reports 5
    PYTHONPATH=<checkout of another commit> .venv/bin/python bench/report_scale.py   # that code

One process attaches the agent to a small model (``report_every=1``, a controller's state part in
the rows, no fingerprints) and replaces the report step's all-gather by a synthetic one: W rows of
``RankExchange``'s layout, random fields, the leader's state in row 0, and sketches of ranks that
share data in tensor-parallel groups of 8 (each group one sketch of 200 sequences, the groups
disjoint). The rank plays the leader (rank 0) or another rank (rank 1). Per case it prints the
medians over ``--reports`` report steps of

- ``train ms``: the training thread's CPU time (``time.thread_time``) of ``end_step`` on a report
  step, with this W minus with W = 2 (what the world size adds to a report step; the W = 2 figure
  itself in the header line);
- ``off-thread ms``: the leader's cross-rank work done elsewhere (the per-rank vectors and the
  data overlap, resolved on the cross-rank worker: thread CPU time there); ``-`` where the code
  does it on the training thread (it is then in ``train ms``);
- ``overlaps ms``: ``sketch.overlaps`` alone on the W synthetic sketches (wherever it runs).

Thread CPU time is what another process on the machine does not move, unlike wall time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import numpy as np
import torch
from torch import nn

import trainer_agent as ta
from trainer_agent.report import exchange as ranks, pipeline as report
from trainer_agent.measure.sketch import SKETCH_K, BottomK, overlaps

GROUP = 8  # ranks that share data (tensor parallelism)


def synthetic_rows(ex: ranks.RankExchange, world: int, seed: int = 0) -> torch.Tensor:
    """W gathered rows in ``ex``'s layout: the leader's (empty) state part, random fields, each
    group of ``GROUP`` ranks one sketch."""
    rng = np.random.default_rng(seed)
    rows = torch.from_numpy(rng.standard_normal((world, ex.width)))
    rows[:, :ranks.STATE_LEN] = 0.0  # a state of zeros: the run's initial desired state
    if ex.with_state:
        sketches = np.empty((world, SKETCH_K), dtype=np.int64)
        for g in range(0, world, GROUP):
            s = BottomK(SKETCH_K)
            s.update(rng.integers(1, 2**63, size=200, dtype=np.uint64))
            sketches[g:g + GROUP] = s.take()
        rows[:, ex.sketch_at:] = torch.from_numpy(sketches.view(np.float64))
    return rows


def _exchange(world: int, rank: int) -> ranks.RankExchange:
    try:
        return ranks.RankExchange(world, rank=rank, with_state=True)
    except TypeError:  # code from before the exchange knew its rank: every rank does the same
        return ranks.RankExchange(world, with_state=True)


def measure(world: int, rank: int, reports: int) -> tuple[float, float | None]:
    """(train ms, off-thread ms or None) medians over ``reports`` report steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    agent = ta.attach(model, opt, job="report-scale", run=f"report-scale-{world}-{rank}",
                      config=ta.AgentConfig(metrics_port=None, report_every=1))
    ex = _exchange(world, rank)
    rows = synthetic_rows(ex, world)
    ex.gather = lambda row: rows  # type: ignore[method-assign]
    agent.reports.exchange, agent.rank = ex, rank  # the pipeline's world_size is its exchange's
    off: list[float] = []
    resolve = getattr(report, "RankVectors", None)
    if resolve is not None:
        plain = resolve.resolve

        def timed(self):  # type: ignore[no-untyped-def]
            t0 = time.thread_time()
            try:
                return plain(self)
            finally:
                if threading.current_thread() is not threading.main_thread():
                    off.append((time.thread_time() - t0) * 1e3)

        resolve.resolve = timed
    x = torch.randn(16, 32)
    train: list[float] = []
    try:
        for i in range(reports + 1):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            t0 = time.thread_time()
            agent.end_step(loss)
            dt = (time.thread_time() - t0) * 1e3
            if i:  # the first report: caches, the worker's start
                train.append(dt)
            flush = getattr(agent.reports, "flush", None)
            if flush is not None:
                flush(60)
    finally:
        if resolve is not None:
            resolve.resolve = plain
        agent.close()
    return statistics.median(train), (statistics.median(off[1:] or off) if off else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, nargs="+", default=[512, 4096, 32768])
    ap.add_argument("--reports", type=int, default=3, help="report steps measured per case")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"report pipeline against the world size (synthetic gathered rows, TP groups of {GROUP} sharing data; "
          f"torch {torch.__version__}; trainer_agent from {report.__file__})")
    base = {rank: measure(2, rank, args.reports)[0] for rank in (0, 1)}
    print(f"at W = 2: leader {base[0]:.2f} ms, other rank {base[1]:.2f} ms of training-thread CPU per report step")
    print("W | leader train ms | leader off-thread ms | other rank train ms | overlaps ms")
    for world in args.world:
        lead, off = measure(world, 0, args.reports)
        other, _ = measure(world, 1, args.reports)
        ex = _exchange(world, 0)
        sketches = synthetic_rows(ex, world)[:, ex.sketch_at:].contiguous().view(torch.int64).numpy()
        t0 = time.thread_time()
        overlaps(sketches, SKETCH_K)
        alone = (time.thread_time() - t0) * 1e3
        print(" | ".join([f"{world:,}", f"{lead - base[0]:.2f}", "-" if off is None else f"{off:.1f}",
                          f"{other - base[1]:.2f}", f"{alone:.1f}"]), flush=True)


if __name__ == "__main__":
    sys.exit(main())
