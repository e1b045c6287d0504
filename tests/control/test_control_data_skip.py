"""A data fault end to end: two gloo ranks training a small byte-level GPT from a ``TokenLoader``,
the agent's data monitor attached, a real ``trainguard serve`` with the built-in rules. For 20
steps the batches are corrupted bytes. The controller's verdict is ``data``; every rank skips the
optimizer steps of those batches at the same steps, the LR stays the scheduler's, the ranks'
weights stay identical, nothing pauses, and each rank's loader quarantines exactly the samples of
the batches whose steps were skipped for their data, which the incident names by shard.

And a job restarted from a checkpoint taken before a data skip skips the steps of the bad batches
only, not every step from its restored one up to the skip's end."""

from __future__ import annotations

import json
import math
import os
import sqlite3
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed as dist

from trainguard.protocol.wire import DesiredState
from tests.control.procs import ROOT, ControllerProcess, Ranks, module_controller
from tests.control.spawn import spawn_ranks

pytestmark = pytest.mark.distributed

WORLD = 2
STEPS, ONSET, BURST = 110, 50, 20
RUN = "data-skip-e2e"


def _worker(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    import trainer_agent as ta
    from trainer_agent.dataset import TokenBatches, TokenLoader
    from trainguard.demo.model import TinyGPT, next_byte_loss

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(TinyGPT(seq_len=32, d_model=32, n_layers=1, n_heads=2))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    loader = TokenLoader(TokenBatches(os.environ["TG_TEST_SHARDS"], batch_size=8, seq_len=33, seed=1), num_workers=0)
    monitor = ta.DataMonitor(256, window=64, reference_tokens=4000)
    agent = ta.attach(model, opt, job="data-skip", run=RUN, lr_scheduler=sched, data_monitor=monitor,
                      controller=os.environ["TG_TEST_URL"],
                      config=ta.AgentConfig(metrics_port=None, report_every=1, request_timeout_s=5.0))
    agent.watch_loader(loader)
    used: list[float] = []
    opt.register_step_pre_hook(lambda o, a, k: used.append(float(o.param_groups[0]["lr"])))
    g = torch.Generator().manual_seed(100 + rank)
    rows = []  # step, skipped for data, lr used (nan: no step), scheduler lr
    it = iter(loader)
    for step in range(1, STEPS + 1):
        batch = next(it)
        ids, mask = batch["input_ids"], batch["attention_mask"]
        if ONSET <= step < ONSET + BURST:
            ids = torch.randint(1, 256, ids.shape, generator=g)  # a corrupted stretch of the data
        agent.observe_batch(ids, mask)
        loss = next_byte_loss(model, ids, mask)
        loss.backward()
        before = agent.control.skip.skipped_by_reason["data"]
        used.clear()
        sched_lr = sched.get_last_lr()[0]
        opt.step()
        opt.zero_grad()
        sched.step()
        agent.end_step(loss.detach())
        rows.append([step, agent.control.skip.skipped_by_reason["data"] > before, used[0] if used else math.nan, sched_lr])
    history = [[h.generation, h.step, h.paused, h.lr_scale] for h in agent.control.history]
    agent.close(5.0)
    torch.save({"rows": rows, "history": history, "skip": sorted(loader.dataset.skip),
                "state": loader.state_dict(), "params": [p.detach().clone() for p in model.parameters()]},
               Path(out) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def controller(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    yield from module_controller(tmp_path_factory)


def test_a_corrupted_burst_is_skipped_on_every_rank_with_the_lr_untouched(controller, tmp_path, monkeypatch) -> None:
    from trainer_agent.dataset import TokenBatches, write_shards
    from trainguard.demo.model import stdlib_source_bytes

    text = stdlib_source_bytes(1 << 18)
    seqs = [list(text[i:i + 33]) for i in range(0, len(text) - 33, 33)][:4096]
    write_shards(tmp_path / "shards", seqs, vocab_size=256, tokens_per_shard=33 * 1500)
    monkeypatch.setenv("TG_TEST_SHARDS", str(tmp_path / "shards"))
    monkeypatch.setenv("TG_TEST_URL", controller.url)
    logs = spawn_ranks(_worker, WORLD, tmp_path, timeout=300.0)

    skipped = [[r[0] for r in log["rows"] if r[1]] for log in logs]
    assert skipped[0] == skipped[1] and skipped[0], skipped  # the same steps on every rank
    first = skipped[0][0]
    # never before the fault; from the step after the one at whose end the ranks applied the first
    # data-skip request (every rank applies a generation at the same step; the history records it). How
    # many corrupted batches trained before that is the round trip in steps: 3 on an idle machine
    # here, 6 with the cores taken by other work (the agent never waits for the controller).
    applied = [h[1] for h in logs[0]["history"] if h[1] >= ONSET]
    assert applied and first == applied[0] + 1 and ONSET < first < ONSET + BURST // 2, (first, applied)
    assert set(range(first, ONSET + BURST)) <= set(skipped[0])  # every corrupted batch after that
    assert max(skipped[0]) < ONSET + BURST + 20  # and it ends once the data is back
    for log in logs:
        assert all(h[3] == 1.0 and not h[2] for h in log["history"])  # never an LR cut or a pause
        for step, data_skip, lr, sched_lr in log["rows"]:
            if not math.isnan(lr):
                assert lr == sched_lr, step  # every step taken used the scheduler's own LR
            assert not (data_skip and not math.isnan(lr)), step  # a data-skipped step took no step
    for a, b in zip(logs[0]["params"], logs[1]["params"]):
        assert torch.equal(a, b)

    (incident,) = httpx.get(f"{controller.url}/v1/runs/{RUN}/incidents", timeout=10).json()["incidents"]
    assert incident["cause"] == "data" and "data_skip" in [r["rung"] for r in incident["rungs"]]
    assert any(e["points_to"] == "data" for e in incident["verdict"]["evidence"])
    # the steps the controller asked to skip: from the step after the report it decided on, to the
    # last one every rank skipped (the ranks start at the step they apply the request at: its ack)
    assert ONSET < incident["data_skipped"][0] <= first and incident["data_skipped"][1] == max(skipped[0])

    # each rank's loader quarantined exactly the samples of its batches of the data-skipped steps
    # (step s read batch s - 1 of epoch 0), and keeps them in its state for a resume
    for rank, log in enumerate(logs):
        ds = TokenBatches(tmp_path / "shards", batch_size=8, seq_len=33, seed=1, rank=rank, world_size=WORLD)
        expected = sorted({int(i) for s in skipped[0] for i in ds.sequence_ids(0, s - 1).tolist()})
        assert log["skip"] == expected and log["state"]["skip"] == expected
    # the incident names them all, every rank's, by shard and index within it (the leader's report)
    everywhere = sorted({int(i) for log in logs for i in log["skip"]})
    assert incident["quarantined"] == TokenBatches(tmp_path / "shards", batch_size=8, seq_len=33, seed=1, rank=0,
                                                   world_size=WORLD).locate(everywhere)


def _set_data_skip(db: Path, run: str, first: int, until: int) -> int:
    """Write the data skip a data incident's ladder gives (steps ``first``-``until``) into the
    desired state of ``run`` in a stopped controller's database; its generation."""
    with sqlite3.connect(db) as con:
        (text,) = con.execute("SELECT desired FROM runs WHERE run=?", (run,)).fetchone()
        d = DesiredState.model_validate_json(text) if text is not None else DesiredState()  # none given yet
        d = d.model_copy(update={"generation": d.generation + 1, "data_skip_from": first, "data_skip_until": until,
                                 "reason": "a data incident's data_skip rung"})
        con.execute("UPDATE runs SET desired=?, generation=? WHERE run=?", (d.model_dump_json(), d.generation, run))
    return d.generation


def test_a_job_restarted_before_a_data_skip_skips_only_the_bad_batches(tmp_path: Path) -> None:
    """The job checkpoints at step 10 and dies at step 40, after the controller asked every rank to
    skip the batches of steps 25-30; restarted from step 10, it trains on steps 11-24 and 31-40."""
    ctl, run, worker = ControllerProcess(tmp_path / "tg.db"), "rewound-skip", str(ROOT / "tests/control/dist_worker.py")
    try:
        ctl.start()
        first = Ranks(WORLD, {"scenario": "first", "phase": "first", "run": run, "controller": ctl.url, "ckpt_step": 10,
                              "crash_step": 40, "max_steps": 40}, tmp_path, worker=worker)
        assert first.wait(180) == [1, 1], first.output()  # died at step 40
        ctl.kill()
        gen = _set_data_skip(ctl.db, run, 25, 30)
        ctl.start()
        again = Ranks(WORLD, {"scenario": "resume", "phase": "resume", "run": run, "controller": ctl.url,
                              "max_steps": 40}, tmp_path, worker=worker)
        try:
            assert again.wait(180) == [0, 0], again.output()
        finally:
            again.kill()
        logs = [json.loads((tmp_path / f"resume-rank{r}.json").read_text()) for r in range(WORLD)]
        assert [h[0] for h in logs[0]["history"]] == [gen] and logs[0]["history"][0][1] < 25  # applied before step 25
        assert logs[0]["data_skipped"] == logs[1]["data_skipped"] == list(range(25, 31))
    finally:
        ctl.kill()
