"""Multi-process control tests: gloo ranks (``dist_worker.py``) and a real ``trainguard serve``.

- 50 trials (30 on 2 ranks, 20 on 4) of pause / resume / lr-scale / checkpoint / stop at random
  moments, with random per-rank step-time jitter: every rank applies every generation at the same
  step, calls on_checkpoint at the same steps, stops at the same step, and the LR each rank used is
  the scheduler's LR (recomputed here from its formula) times the scale it had applied.
- End to end with a deliberately short process-group timeout (2 s): a NaN loss makes the
  controller's default rule pause the run; the pause lasts 3x the timeout; ``trainguard resume``
  lets it continue. Negative control: the same wait done in a collective fails with the timeout.
- A paused run restarted on two ranks: every rank (the non-leader on the store) waits in attach,
  longer than the group's timeout, until an operator resumes it; both start from the same state.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.control.dist_worker import BASE_LR, lr_lambda
from tests.control.procs import TRAINGUARD, ControllerProcess, Ranks, module_controller, operator_only_rules, until

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def controller(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    yield from module_controller(tmp_path_factory)


def _check_same_on_every_rank(logs: list[dict]) -> None:
    ref = logs[0]
    for log in logs[1:]:
        tag = f"{log['run']} rank {log['rank']}"
        # generation, step, paused, lr_scale, checkpoint_seq, stop (not the wall time)
        assert [h[:6] for h in log["history"]] == [h[:6] for h in ref["history"]], tag
        assert log["checkpoints"] == ref["checkpoints"], tag
        assert len(log["steps"]) == len(ref["steps"]) and log["stopped"] == ref["stopped"], tag


def _check_lr(log: dict) -> list[int]:
    """LR used at step s = LambdaLR's LR (recomputed) x the lr_scale applied before step s.
    Returns the steps at which the optimizer did not step at all (no LR used)."""
    applied = [(h[1], h[3]) for h in log["history"]]  # (step applied at, lr_scale)
    not_stepped = []
    for step, used, sched_lr, epoch, *_ in log["steps"]:
        scale = 1.0
        for at, s in applied:
            if at < step:
                scale = s
        assert sched_lr == BASE_LR * lr_lambda(int(epoch)), (log["run"], step)
        if math.isnan(used):
            not_stepped.append(int(step))
            continue
        assert used == sched_lr * scale, (log["run"], log["rank"], step, used, sched_lr, scale)
    return not_stepped


def _drive(ctl: ControllerProcess, ranks: Ranks, run: str, rng: random.Random) -> list[str]:
    """Random commands at random moments, then stop. Returns what was sent."""
    until(lambda: ranks.exited() or ctl.run_detail(run) is not None, 300.0, 0.02)
    assert ctl.run_detail(run) is not None, f"{run} never registered:\n{ranks.output()}"
    sent = []
    for _ in range(rng.randint(2, 5)):
        time.sleep(rng.uniform(0.0, 0.04))
        what = rng.choice(["pause", "lr-scale", "checkpoint"])
        if what == "pause":
            ctl.command(run, "pause")
            time.sleep(rng.uniform(0.0, 0.08))
            ctl.command(run, "resume")
            sent += ["pause", "resume"]
        elif what == "lr-scale":
            ctl.command(run, "lr-scale", scale=rng.choice([0.25, 0.5, 2.0]))
            sent.append("lr-scale")
        else:
            ctl.command(run, "checkpoint")
            sent.append("checkpoint")
    time.sleep(rng.uniform(0.0, 0.03))
    ctl.command(run, "stop")
    return sent + ["stop"]


@pytest.mark.timeout(900)  # a deadline for a loaded machine; ~1 minute on an idle one
@pytest.mark.parametrize("world,trials", [(2, 30), (4, 20)])
def test_random_commands_apply_at_the_same_step_on_every_rank(
    controller: ControllerProcess, tmp_path: Path, world: int, trials: int
) -> None:
    prefix = f"trials{world}"
    ranks = Ranks(world, {"scenario": "trials", "controller": controller.url, "prefix": prefix, "trials": trials,
                          "max_steps": 4000, "jitter_s": 0.004}, tmp_path)
    rng = random.Random(world)
    try:
        for k in range(trials):
            _drive(controller, ranks, f"{prefix}-{k}", rng)
        codes = ranks.wait(600)
    finally:
        ranks.kill()
    assert codes == [0] * world, ranks.output()
    per_rank = [json.loads((tmp_path / f"trials-rank{r}.json").read_text()) for r in range(world)]
    paused_somewhere = checkpoints = 0
    for k in range(trials):
        logs = [per_rank[r][k] for r in range(world)]
        _check_same_on_every_rank(logs)
        for log in logs:
            assert _check_lr(log) == []
            assert log["stopped"] and log["history"][-1][5], log["run"]  # stopped by the controller
            gens = [h[0] for h in log["history"]]
            assert gens == sorted(set(gens))  # each generation once, never backwards
            assert log["close_s"] < 3.0 + 2.0  # close(3.0); one more request timeout means it waited past it
        detail = controller.run_detail(logs[0]["run"])
        assert detail is not None
        assert until(lambda r=logs[0]["run"]: controller.run_detail(r)["applied_generation"]
                     == logs[0]["history"][-1][0], 30.0)  # the leader acked the last generation
        paused_somewhere += any(h[2] for h in logs[0]["history"])
        checkpoints += len(logs[0]["checkpoints"])
    assert paused_somewhere > 0 and checkpoints > 0  # the random commands did exercise both


@pytest.mark.timeout(600)
def test_nan_pauses_run_longer_than_the_group_timeout_until_an_operator_resumes(tmp_path: Path) -> None:
    # A controller whose rules pause on a NaN loss (the built-in ones roll back, or let the
    # agent's skip stand): the pause is what this test holds longer than the group's timeout.
    controller = ControllerProcess(tmp_path / "trainguard.db", rules=operator_only_rules(tmp_path)).start()
    try:
        _nan_pause(controller, tmp_path)
    finally:
        controller.kill()


def _nan_pause(controller: ControllerProcess, tmp_path: Path) -> None:
    timeout_s, run, nan_step = 2.0, "e2e-nan-pause", 6
    ranks = Ranks(2, {"scenario": "pause", "controller": controller.url, "prefix": run, "max_steps": 16,
                      "nan_step": nan_step, "skip_nonfinite": True, "pg_timeout_s": timeout_s,
                      "naive_pause_s": 3 * timeout_s, "jitter_s": 0.002}, tmp_path)
    try:
        until(lambda: ranks.exited() or ((d := controller.run_detail(run)) is not None and d["desired"]["paused"]),
              300.0, 0.02)
        assert not ranks.exited() and controller.run_detail(run)["desired"]["paused"], ranks.output()
        time.sleep(3 * timeout_s)  # paused 3x longer than the process group's timeout
        cli = subprocess.run([TRAINGUARD, "resume", run, "--reason", "checked", "--url", controller.url],
                             capture_output=True, text=True, timeout=30)
        assert cli.returncode == 0, cli.stderr
        codes = ranks.wait(300)
    finally:
        ranks.kill()
    assert codes == [0, 0], ranks.output()
    logs = [json.loads((tmp_path / f"pause-rank{r}.json").read_text()) for r in range(2)]
    _check_same_on_every_rank(logs)
    hist = logs[0]["history"]
    assert [h[2] for h in hist] == [True, False]  # paused by the rule, resumed by the operator
    assert hist[0][1] == hist[1][1] > nan_step  # applied after the NaN step, resumed at that step
    assert hist[1][6] - hist[0][6] >= 3 * timeout_s  # the pause outlived the group timeout 3x
    for log in logs:
        assert len(log["steps"]) == 16 and not log["stopped"]  # trained on to the end
        assert log["skipped"] == 1.0  # the NaN step was skipped on every rank
        assert _check_lr(log) == [nan_step]
    detail = controller.run_detail(run)
    assert detail["applied_generation"] == hist[-1][0]
    # negative control: the same wait inside a collective fails with the group's timeout
    neg = json.loads((tmp_path / "negative-rank1.json").read_text())
    assert neg["error"] and ("timeout" in neg["error"].lower() or "timed out" in neg["error"].lower()), neg
    assert neg["after_s"] < 3 * timeout_s


@pytest.mark.timeout(600)
def test_a_paused_run_restarted_on_two_ranks_waits_in_attach_until_resumed(
    controller: ControllerProcess, tmp_path: Path
) -> None:
    timeout_s, run = 2.0, "restart-paused"
    # the job before: registered, given an lr_scale, paused; then it died
    assert httpx.post(f"{controller.url}/v1/runs", json={"job": "ctl-test", "run": run, "world_size": 2},
                      timeout=10).status_code == 200
    controller.command(run, "lr-scale", scale=0.5)
    assert controller.command(run, "pause")["desired"]["generation"] == 2
    ranks = Ranks(2, {"scenario": "restart", "controller": controller.url, "prefix": run, "max_steps": 6,
                      "pg_timeout_s": timeout_s}, tmp_path)
    try:
        # the restarted leader registered and applied the paused state at step 0 (its ack)
        assert until(lambda: ranks.exited() or controller.acks(run) == [(2, 0)], 300.0, 0.05), ranks.output()
        assert not ranks.exited(), ranks.output()
        time.sleep(1.5 * timeout_s)  # paused longer than the group's timeout: the waits are not collectives
        assert not ranks.exited(), ranks.output()  # every rank still waiting in attach
        resumed_at = time.time()
        assert controller.command(run, "resume")["desired"]["generation"] == 3
        codes = ranks.wait(300)
    finally:
        ranks.kill()
    assert codes == [0, 0], ranks.output()
    logs = [json.loads((tmp_path / f"restart-rank{r}.json").read_text()) for r in range(2)]
    _check_same_on_every_rank(logs)
    for log in logs:
        assert log["attached_at"] > resumed_at, log["rank"]  # the non-leader too waited for the resume
        assert log["attach_state"] == [3, False, 0.5, 0]  # the registration state, before step 1
        assert len(log["steps"]) == 6 and _check_lr(log) == []
    assert until(lambda: controller.acks(run) == [(2, 0), (3, 0)], 30.0), controller.acks(run)
