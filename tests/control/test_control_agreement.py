"""The ranks' agreement on the controller's desired state (``trainer_agent/control/agreement.py``)
with a real controller and a real 2-rank gloo job: a job that starts while the controller is
unreachable judges the state it gets at its late registration as a restarted job judges the one
it gets at attach."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.control.procs import ROOT, ControllerProcess, Ranks, until
from tests.tools.faultproxy import FaultProxy

pytestmark = pytest.mark.integration


def _earlier_process(ctl: ControllerProcess, run: str) -> int:
    """What an earlier process of ``run`` did, over the agent's API: it registered, reported a
    confirmed snapshot, and applied a rollback, an optimizer reset and lr_scale 0.5 (acked); a
    checkpoint was requested after it ended. The generation of that checkpoint."""
    agent = httpx.Client(base_url=f"{ctl.url}/v1", timeout=10.0)
    ranks = [{"rank": r, "local_rank": r, "host": "127.0.0.1", "port": 9300 + r} for r in range(2)]
    agent.post("/runs", json={"job": "resume-job", "run": run, "world_size": 2, "ranks": ranks}).raise_for_status()
    for step in range(1, 9):
        agent.post(f"/runs/{run}/reports", json={
            "job": "resume-job", "step_first": step, "step_last": step, "time": float(step),
            "values": {"trainguard_loss": 3.0 - 0.01 * step, "trainguard_snapshot_step": 4.0}}).raise_for_status()
    ctl.command(run, "rollback")
    ctl.command(run, "reset-optimizer")
    applied = ctl.command(run, "lr-scale", scale=0.5)["desired"]
    assert (applied["rollback_seq"], applied["reset_optimizer_seq"], applied["lr_scale"]) == (1, 1, 0.5)
    agent.post(f"/runs/{run}/acks", json={"generation": applied["generation"], "step": 9}).raise_for_status()
    assert until(lambda: ctl.run_detail(run)["applied_generation"] == applied["generation"], 30, 0.05)
    return ctl.command(run, "checkpoint")["desired"]["generation"]


@pytest.mark.distributed
def test_a_job_registered_late_takes_no_rollback_or_reset_and_the_checkpoint_nobody_took(tmp_path: Path) -> None:
    ctl = ControllerProcess(tmp_path / "tg.db").start()
    run, worker = "late-0", str(ROOT / "tests" / "control" / "dist_worker.py")
    try:
        wanted = _earlier_process(ctl, run)
        with FaultProxy(ctl.port) as proxy:
            proxy.set_mode("blackhole")  # the controller does not answer while the job attaches
            ranks = Ranks(2, {"scenario": "late", "phase": "late", "run": run, "controller": proxy.url,
                              "max_steps": 100_000, "until_generation": wanted}, tmp_path, worker=worker)
            try:
                assert until(lambda: ranks.exited() or (tmp_path / "started-rank0").exists(), 120, 0.05)
                proxy.set_mode("pass")
                assert ranks.wait(120) == [0, 0], ranks.output()
            finally:
                ranks.kill()
        logs = [json.loads((tmp_path / f"resume-rank{r}.json").read_text()) for r in range(2)]
    finally:
        ctl.kill()
    assert [log["acted"] for log in logs] == [{"rollback": [], "reset_optimizer": []}] * 2
    assert [log["lr_scale"] for log in logs] == [0.5, 0.5]
    # the checkpoint no process took: once, on both ranks, at the step that applied it (the last)
    assert [log["checkpoints"] for log in logs] == [[logs[0]["step"]]] * 2
