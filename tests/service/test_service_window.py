"""RunWindow against a naive reference: every report kept in a Python list, read back by loops."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from trainguard.service.window import VECTORS, RunWindow


def _same(a: list[float], b: np.ndarray) -> bool:
    return len(a) == len(b) and all((math.isnan(x) and math.isnan(y)) or x == y for x, y in zip(a, b.tolist()))


@pytest.mark.parametrize("capacity, rank_capacity, skip", [(8, 3, 0.0), (8, 3, 0.3), (5, 1, 0.5), (16, 4, 0.1)])
def test_window_reads_match_a_naive_history(capacity: int, rank_capacity: int, skip: float) -> None:
    rng = random.Random(capacity * 100 + rank_capacity)
    world = 3
    w = RunWindow(capacity=capacity, rank_capacity=rank_capacity, world_size=world, created=0.0)
    history: list[dict[str, float]] = []
    rank_history: list[dict[str, list[float]]] = []
    rank_steps: list[int] = []  # the step of each of rank_history's reports
    names = [f"m{i}" for i in range(20)]  # more than the initial 16 columns: the buffers grow
    for step in range(60):
        values = {n: rng.choice([rng.gauss(0, 1), math.nan, math.inf]) for n in names if rng.random() >= skip}
        ranks = {v: [rng.gauss(0, 1) for _ in range(world)] for v in VECTORS if rng.random() >= skip}
        w.append_raw(values, {k: np.asarray(v) for k, v in ranks.items()}, step, float(step))
        history.append(values)
        if ranks:
            rank_history.append(ranks)
            rank_steps.append(step)
        recent = history[-capacity:]
        assert w.size == len(recent) and w.last_step == step and w.last_received == float(step)
        for n in names + ["never"]:
            want_latest = history[-1].get(n)
            got = w.latest(n)
            assert (got is None and want_latest is None) or _same([want_latest], np.asarray([got]))
            carried = [r[n] for r in recent if n in r]
            for last in (0, 1, 2, 3, capacity, capacity + 5):
                want = carried[max(0, len(carried) - last):] if last else []
                series = w.series(n, last)
                assert _same(want, series), (n, last, want, series)
                assert not series.flags.writeable  # rules read views of the buffers: never write through them
        rrecent = rank_history[-rank_capacity:]
        rsteps = rank_steps[-rank_capacity:]
        for v in VECTORS:
            for last in (1, 2, rank_capacity, rank_capacity + 2):
                held = range(len(rrecent) - min(last, len(rrecent)), len(rrecent))
                rows = [rrecent[i][v] for i in held if v in rrecent[i]]
                got = w.rank_history(v, last)
                assert got.shape == (len(rows), world)
                assert all(_same(a, b) for a, b in zip(rows, got))
                # each row's step, while the window still holds that report (its newest ``capacity``)
                steps = [float(rsteps[i]) if step - rsteps[i] < capacity else math.nan for i in held if v in rrecent[i]]
                got_steps, ids = w.rank_history_index(v, last)
                assert _same(steps, np.array(got_steps)) and len(set(ids)) == len(ids)
                assert all(_same(a, b) for a, b in zip(rows, w.rank_values_of(v, ids)))
        assert w.latest_values().keys() == history[-1].keys()


@pytest.mark.parametrize("capacity, rank_capacity, skip", [(8, 3, 0.0), (8, 3, 0.4), (5, 1, 0.5)])
def test_rows_and_rank_rows_give_each_held_report_with_its_sequence_number_and_step(capacity: int, rank_capacity: int, skip: float) -> None:
    rng = random.Random(7 + capacity + rank_capacity)
    world = 2
    w = RunWindow(capacity=capacity, rank_capacity=rank_capacity, world_size=world, created=0.0)
    history: list[tuple[int, int, float, dict[str, float]]] = []  # (seq, step, received, values)
    rank_history: list[tuple[int, dict[str, list[float]]]] = []
    for seq in range(1, 41):
        step = 10 * seq + rng.randrange(3)
        values = {n: rng.choice([rng.gauss(0, 1), math.nan, -math.inf]) for n in ("a", "b", "c") if rng.random() >= skip}
        ranks = {v: [rng.gauss(0, 1) for _ in range(world)] for v in VECTORS if rng.random() >= skip}
        w.append_raw(values, {k: np.asarray(v) for k, v in ranks.items()}, step, seq + 0.5)
        history.append((seq, step, seq + 0.5, values))
        if ranks:
            rank_history.append((seq, ranks))
        for after in (0, seq - 3, seq - 1, seq, seq + 2):
            want = [h for h in history[-capacity:] if h[0] > after]
            got = w.rows(after)
            assert [g[:3] for g in got] == [h[:3] for h in want]
            for (_, _, _, gv), (_, _, _, hv) in zip(got, want):
                assert sorted(gv) == sorted(hv) and _same([hv[k] for k in sorted(hv)], np.asarray([gv[k] for k in sorted(hv)]))
            want_ranks = [r for r in rank_history[-rank_capacity:] if r[0] > after]
            assert w.rank_rows(after) == want_ranks


def test_rows_keep_their_sequence_numbers_across_a_reload() -> None:
    # the controller reloads a window by setting count to the first reloaded report's seq - 1
    w = RunWindow(capacity=4, rank_capacity=2, world_size=1, created=0.0)
    w.count = 100
    for i in range(3):
        w.append_raw({"loss": float(i)}, {"loss": np.asarray([float(i)])}, 7 + i, 1.0 + i)
    assert [(seq, step) for seq, step, _, _ in w.rows()] == [(101, 7), (102, 8), (103, 9)]
    assert [seq for seq, _ in w.rank_rows()] == [102, 103]
    assert w.rows(102) == [(103, 9, 3.0, {"loss": 2.0})]


@pytest.mark.parametrize("capacity, rank_capacity, reload_at", [(8, 3, 0), (6, 2, 50), (16, 5, 0)])
def test_reads_match_a_naive_history_through_gaps_rollbacks_and_a_reload(capacity: int, rank_capacity: int, reload_at: int) -> None:
    # Metrics and vectors that every report carries, with runs of reports that lack some of them (a
    # metric logged every k steps, one that appears late), and appends taken back (a failed commit):
    # the reads that skip the presence mask when every recent report carried the name must agree
    # with a naive history in each of these cases.
    rng = random.Random(capacity + 31 * rank_capacity + reload_at)
    world = 2
    w = RunWindow(capacity=capacity, rank_capacity=rank_capacity, world_size=world, created=0.0)
    w.count = reload_at
    history: list[dict[str, float]] = []
    rank_history: list[dict[str, list[float]]] = []
    gap_until = {"every": -1, "bursty": -1, "late": 40, "rare": -1}
    vec_gap_until = {v: -1 for v in VECTORS}
    for i in range(160):
        for name in ("bursty", "rare"):
            if i > gap_until[name] and rng.random() < (0.08 if name == "bursty" else 0.5):
                gap_until[name] = i + rng.randrange(1, capacity + 2)
        for v in VECTORS[:3]:
            if i > vec_gap_until[v] and rng.random() < 0.1:
                vec_gap_until[v] = i + rng.randrange(1, rank_capacity + 2)
        values = {n: rng.choice([rng.gauss(0, 1), rng.gauss(0, 1), math.nan]) for n, until in gap_until.items() if i > until}
        ranks = {v: [rng.gauss(0, 1) for _ in range(world)] for v in VECTORS[:4] if i > vec_gap_until[v]}
        if i % 7 == 3:
            ranks = {}  # a report without per-rank vectors
        saved = w.save_next(ranks=bool(ranks))
        w.append_raw(values, {k: np.asarray(v) for k, v in ranks.items()}, i, float(i))
        if rng.random() < 0.15:  # its commit failed: the append is taken back
            assert w.rollback(saved)
        else:
            history.append(values)
            if ranks:
                rank_history.append(ranks)
        recent = history[-capacity:]
        for n in gap_until:
            carried = [r[n] for r in recent if n in r]
            for last in (1, 2, 3, capacity - 1, capacity, capacity + 1):
                got = w.series(n, last)
                assert _same(carried[max(0, len(carried) - last):], got), (i, n, last)
        rrecent = rank_history[-rank_capacity:]
        for v in VECTORS[:5]:
            for last in (1, 2, rank_capacity, rank_capacity + 1):
                rows = [r[v] for r in rrecent[len(rrecent) - min(last, len(rrecent)):] if v in r]
                got = w.rank_history(v, last)
                assert got.shape == (len(rows), world) and all(_same(a, b) for a, b in zip(rows, got)), (i, v, last)
