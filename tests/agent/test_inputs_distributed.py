"""Two real gloo ranks and a real controller (``trainguard serve``): the shared-seed failure
(both ranks' loaders configured as rank 0) is caught and the ranks named; a rank whose loader is
slowed on purpose is named as waiting for its data; a healthy run raises neither; the accumulation
command is applied at one step on every rank with the LR following its rule."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.control.procs import TRAINGUARD, ControllerProcess, Ranks, until
from trainer_agent.dataset import write_shards

pytestmark = pytest.mark.distributed

WORKER = str(Path(__file__).with_name("inputs_rank_worker.py"))
VOCAB = 64


@pytest.fixture(scope="module")
def controller(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    ctl = ControllerProcess(tmp_path_factory.mktemp("ctl") / "trainguard.db").start()
    yield ctl
    ctl.kill()


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(0)
    write_shards(root, (rng.integers(0, VOCAB, size=int(rng.integers(8, 24))) for _ in range(2000)),
                 vocab_size=VOCAB, tokens_per_shard=8000)
    return str(root)


def _run(controller: ControllerProcess, shards: str, tmp_path: Path, run: str, steps: int = 30, **cfg: object) -> tuple[list[dict], list[dict]]:
    ranks = Ranks(2, {"scenario": run, "run": run, "shards": shards, "controller": controller.url,
                      "vocab": VOCAB, "steps": steps, **cfg}, tmp_path, worker=WORKER)
    codes = ranks.wait(180)
    assert codes == [0, 0], ranks.output()
    logs = [json.loads((tmp_path / f"{run}-rank{r}.json").read_text()) for r in range(2)]
    alerts = httpx.get(f"{controller.url}/v1/alerts", params={"run": run}, timeout=10).json()
    return logs, alerts


def _named(alerts: list[dict], rule: str) -> list[dict]:
    return [a for a in alerts if a["rule"] == rule]


def test_shared_seed_failure_is_caught_and_the_ranks_named(controller, shards, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    logs, alerts = _run(controller, shards, tmp_path, "shared-seed", sampler_rank=0)
    shared = _named(alerts, "data_shared_across_ranks")
    assert shared, alerts
    assert shared[0]["values"]["ranks"] == [0, 1]
    assert all(v > 0.5 for v in shared[0]["values"]["values"].values())


def test_a_data_slow_rank_is_named_and_a_healthy_run_raises_nothing(controller, shards, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    healthy, quiet = _run(controller, shards, tmp_path, "healthy")
    assert not _named(quiet, "data_shared_across_ranks") and not _named(quiet, "input_wait_straggler"), quiet
    slowed, alerts = _run(controller, shards, tmp_path, "slow-rank", slow_rank=1, slow_s=0.1)
    straggler = _named(alerts, "input_wait_straggler")
    assert straggler and straggler[0]["values"]["rank"] == 1, alerts
    # the slowed rank's wait rose against the same rank unslowed (the sleep bounds it below)
    slow_wait = [w for w in slowed[1]["waits"][5:] if not math.isnan(w)]
    base_wait = [w for w in healthy[1]["waits"][5:] if not math.isnan(w)]
    assert min(slow_wait) >= 0.1 and np.median(slow_wait) > np.median(base_wait) + 0.05
    # the gathered per-rank vector on the leader: rank 1 waits, rank 0 does not (much); rank 1
    # holds its own value only
    waits = slowed[0]["rank_values"]["input_wait_seconds"]
    assert waits[1] >= 0.1 and waits[0] < waits[1]
    assert slowed[1]["rank_values"]["input_wait_seconds"] == [waits[1]]


def test_accumulation_command_applies_at_one_step_on_every_rank_with_the_lr_rule(controller, shards, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ranks = Ranks(2, {"scenario": "accum", "run": "accum", "shards": shards, "controller": controller.url,
                      "vocab": VOCAB, "steps": 3000, "accumulate": True}, tmp_path, worker=WORKER)
    try:
        assert until(lambda: ranks.exited() or ((controller.run_detail("accum") or {}).get("last_step") or 0) >= 10, 120)
        cli = subprocess.run([TRAINGUARD, "accumulation", "accum", "8", "--lr-rule", "sqrt", "--url", controller.url,
                              "--json"], capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0, cli.stderr
        assert json.loads(cli.stdout)["desired"]["accumulation_steps"] == 8
        assert ranks.wait(180) == [0, 0], ranks.output()
    finally:
        ranks.kill()
    logs = [json.loads((tmp_path / f"accum-rank{r}.json").read_text()) for r in range(2)]
    assert logs[0]["steps"] == logs[1]["steps"]  # same micro-batches and LR at every step, every rank
    (switch,) = [h[1] for h in logs[0]["history"] if h[2] == 8]
    assert [h for h in logs[1]["history"]] == logs[0]["history"]
    for step, micro, lr in logs[0]["steps"]:
        if step <= switch:  # applied at the end of step `switch`: the next step uses it
            assert (micro, lr) == (2, 0.01), step
        else:
            assert micro == 8 and lr == pytest.approx(0.01 * math.sqrt(8 / 2)), step
    assert switch % 5 == 0  # an agreement step (sync_every=5)
