"""trainer_agent/report/pipeline.py: the leader's cross-rank part of a published report (RankVectors),
resolved once on the cross-rank worker thread (CrossRankWorker), and, on 3 gloo ranks with a
controller, the other ranks keeping only their own row."""

from __future__ import annotations

import math
import os
import threading
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.control.spawn import spawn_ranks
from trainer_agent.measure.fingerprint import DesyncFinding
from trainer_agent.report.exchange import RANK_FIELDS
from trainer_agent.report.pipeline import CrossRankWorker, RankVectors
from trainer_agent.measure.sketch import SKETCH_K, BottomK, overlaps

F = len(RANK_FIELDS)


def _sketch(values: np.ndarray) -> np.ndarray:
    s = BottomK(SKETCH_K)
    s.update(values)
    return s.take()


def test_rank_vectors_are_the_columns_the_decoded_fingerprints_and_the_overlap_resolved_once() -> None:
    world = 5
    rng = np.random.default_rng(0)
    matrix = rng.standard_normal((world, F))
    matrix[3, RANK_FIELDS.index("loss")] = math.nan
    shared = _sketch(rng.integers(1, 2**63, size=300, dtype=np.uint64))
    sketches = np.stack([shared, _sketch(rng.integers(1, 2**63, size=300, dtype=np.uint64)), shared,
                         BottomK(SKETCH_K).take(), _sketch(rng.integers(1, 2**63, size=10, dtype=np.uint64))])
    calls: list[str] = []
    finding = DesyncFinding("grad", "layer0", 0.5, (4,))

    def decode(flat: np.ndarray, rows: np.ndarray) -> tuple[dict[str, list[float]], list[DesyncFinding]]:
        calls.append(threading.current_thread().name)
        assert rows is matrix  # the rows as they arrived (a failed report's row is all NaN)
        return {"grad_desync": (flat * 2).tolist()}, [finding]

    compared = np.arange(world, dtype=np.float64)
    rv = RankVectors(matrix, sketches=sketches.view(np.float64), compared=compared, decode=decode)
    np.testing.assert_array_equal(rv.column("grad_norm"), matrix[:, RANK_FIELDS.index("grad_norm")])
    assert calls == []  # nothing resolved before a reader asks
    got: list[dict[str, list[float]]] = []
    readers = [threading.Thread(target=lambda: got.append(rv.resolve()), name=f"reader{i}") for i in range(4)]
    for t in readers:
        t.start()
    for t in readers:
        t.join()
    assert len(calls) == 1 and all(g is got[0] for g in got)  # resolved once, by one of the readers
    for i, name in enumerate(RANK_FIELDS):
        want = matrix[:, i].tolist()
        assert [x if x == x else "nan" for x in rv[name]] == [x if x == x else "nan" for x in want], name
    assert rv["grad_desync"] == [0.0, 2.0, 4.0, 6.0, 8.0]
    best, _ = overlaps(sketches, SKETCH_K)
    assert [x if x == x else "nan" for x in rv["data_overlap"]] == [x if x == x else "nan" for x in best.tolist()]
    assert rv["data_overlap"][0] == rv["data_overlap"][2] == 1.0 and math.isnan(rv["data_overlap"][3])
    assert rv.desync == [finding] and len(calls) == 1
    assert set(rv) == set(RANK_FIELDS) | {"grad_desync", "data_overlap"} and len(rv) == F + 2


def test_the_light_form_is_the_columns_alone_nan_kept_without_comparing() -> None:
    world = 4
    matrix = np.random.default_rng(1).standard_normal((world, F))
    matrix[2, RANK_FIELDS.index("loss")] = math.inf
    matrix[1, RANK_FIELDS.index("loss")] = math.nan

    def decode(flat: np.ndarray) -> tuple[dict[str, list[float]], list[DesyncFinding]]:
        raise AssertionError("the light form compares nothing")

    rv = RankVectors(matrix, compared=np.zeros(world), decode=decode)
    light = rv.light()
    assert set(light) == set(RANK_FIELDS) and light.desync == []
    loss = light["loss"]
    assert math.isnan(loss[1]) and loss[2] == math.inf and [loss[0], loss[3]] == matrix[[0, 3], RANK_FIELDS.index("loss")].tolist()
    resolved = RankVectors(matrix)
    resolved.resolve()
    assert resolved.light().keys() == resolved.resolve().keys()  # once resolved, its vectors as they are


def test_rank_vectors_without_data_have_no_overlap_vector() -> None:
    empty = np.stack([BottomK(SKETCH_K).take()] * 3).view(np.float64)
    rv = RankVectors(np.zeros((3, F)), sketches=empty)
    assert "data_overlap" not in rv and rv.desync == []
    assert "data_overlap" not in RankVectors(np.zeros((3, F)))


def test_the_worker_runs_jobs_in_order_off_the_calling_thread_and_drops_the_oldest_when_full() -> None:
    errors: list[tuple[str, str]] = []
    worker = CrossRankWorker(max_queued=2, light_queued=3, on_error=lambda kind, exc: errors.append((kind, str(exc))))
    ran: list[tuple[int | str, str]] = []
    release = threading.Event()
    started = threading.Event()

    def hold() -> None:
        started.set()
        release.wait(30)

    def job(i: int | str):
        return lambda: ran.append((i, threading.current_thread().name))

    def fail() -> None:
        raise RuntimeError("job failed")

    worker.submit(hold)
    assert started.wait(30)  # the worker is busy: the next jobs wait in the queue
    for i in range(4):  # room for two whole jobs: jobs 0 and 1 become their light forms, oldest first
        worker.submit(job(i), job(f"light {i}"))
    assert (worker.lightened, worker.dropped) == (2, 0)
    worker.submit(fail)  # job 2 goes light
    worker.submit(job(4))  # job 3 goes light: four light ones, one past light_queued: light 0 is dropped
    assert (worker.lightened, worker.dropped) == (4, 1)
    worker.submit(job(5))  # the oldest whole job (fail) has no light form: dropped
    assert (worker.lightened, worker.dropped) == (4, 2)
    release.set()
    assert worker.flush(30)
    assert ran == [(f"light {i}", "trainguard-ranks") for i in (1, 2, 3)] + [(i, "trainguard-ranks") for i in (4, 5)]
    worker.submit(fail)
    assert worker.flush(30)
    assert errors == [("cross_rank", "job failed")]  # the failure was passed on; the next job ran
    worker.submit(job(5))
    assert worker.flush(30, stop=True) and ran[-1][0] == 5
    worker.submit(job(6))  # after stop: ignored
    assert worker.flush(1) and ran[-1][0] == 5


def test_what_the_leader_hands_over_is_freed_on_the_worker_one_report_later() -> None:
    """A published report's per-rank vectors are freed on the worker, not by the training thread
    that replaced them: at 32,768 ranks that is ~5 ms of CPU (bench/report_scale.py)."""
    freed: list[tuple[str, str]] = []

    class Vectors:
        def __init__(self, name: str) -> None:
            self.name = name

        def __del__(self) -> None:
            freed.append((self.name, threading.current_thread().name))

    worker = CrossRankWorker()
    worker.submit(lambda: None)
    worker.release(Vectors("report 1"))
    worker.submit(lambda: None)
    assert worker.flush(30) and freed == []  # the newest handed over is kept: its caller may still hold it
    worker.release(Vectors("report 2"))
    worker.submit(lambda: None)
    assert worker.flush(30) and freed == [("report 1", "trainguard-ranks")]
    for i in (3, 4):  # no job comes to drop them: at most two wait, the oldest goes on the caller's thread
        worker.release(Vectors(f"report {i}"))
    assert freed[1:] == [("report 2", threading.current_thread().name)]
    assert worker.flush(30, stop=True)
    assert sorted(name for name, _ in freed) == ["report 1", "report 2", "report 3", "report 4"]


# ---------------------------------------------------------------- 3 gloo ranks, a controller

WORLD, STEPS = 3, 3


def _loss(rank: int, step: int) -> float:
    return 10.0 * rank + step + 0.25


def _worker(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    import trainer_agent as ta
    from trainer_agent.report import pipeline as report

    resolved: list[str] = []  # the thread of every RankVectors resolution that computed
    rows_read: list[tuple[int, bool]] = []  # per published report: rows in its buffer, leader's vectors
    resolve, read = report.RankVectors.resolve, report.InFlight.read

    def resolve_recorded(self):  # type: ignore[no-untyped-def]
        if self._vectors is None:
            resolved.append(threading.current_thread().name)
        return resolve(self)

    def read_recorded(self):  # type: ignore[no-untyped-def]
        values, ranks = read(self)
        rows_read.append((self.ranks, isinstance(ranks, report.RankVectors)))
        return values, ranks

    report.RankVectors.resolve = resolve_recorded  # type: ignore[method-assign]
    report.InFlight.read = read_recorded  # type: ignore[method-assign]
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = ta.attach(model, opt, job="ranks", run="ranks-1",
                      config=ta.AgentConfig(metrics_port=None, report_every=1, controller=os.environ["TG_FAKE_CONTROLLER"]))
    for step in range(1, STEPS + 1):
        model(torch.randn(8, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        agent.end_step(_loss(rank, step))
    agent.close(timeout=20.0)
    torch.save({"resolved": resolved, "rows_read": rows_read, "rank_values": agent.rank_values,
                "errors": agent.latest().get("trainguard_agent_errors_total")}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.distributed
def test_the_leader_resolves_every_ranks_vectors_off_the_training_thread_and_the_others_keep_their_own(
        tmp_path, monkeypatch) -> None:
    from tests.control.fake_controller import FakeController

    with FakeController() as fake:
        monkeypatch.setenv("TG_FAKE_CONTROLLER", fake.url)
        out = spawn_ranks(_worker, WORLD, tmp_path)
        reports = sorted(fake.reports, key=lambda r: r.step_last)
    assert [r.step_last for r in reports] == list(range(1, STEPS + 1))
    for report in reports:  # the controller got every rank's values of each step
        assert list(report.ranks.loss) == [_loss(r, report.step_last) for r in range(WORLD)]
    leader, others = out[0], out[1:]
    assert leader["errors"] == 0.0
    assert leader["rows_read"] == [(WORLD, True)] * STEPS
    assert leader["resolved"] == ["trainguard-ranks"] * STEPS  # every report's, on the worker
    assert leader["rank_values"]["loss"] == [_loss(r, STEPS) for r in range(WORLD)]
    for rank, got in enumerate(others, start=1):
        assert got["errors"] == 0.0
        assert got["rows_read"] == [(1, False)] * STEPS  # its own row only, whatever the world size
        assert got["resolved"] == []
        assert got["rank_values"]["loss"] == [_loss(rank, STEPS)]
        assert set(got["rank_values"]) == set(RANK_FIELDS)
