"""The controller's ``verify`` command on two gloo ranks (``dist_worker.py``) with a real
``trainguard serve``: every rank recomputes the gradient of the same step, the one after the step
at which every rank applied the command, and a clean run is not flagged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.control.procs import ControllerProcess, Ranks, until

pytestmark = pytest.mark.distributed


@pytest.mark.timeout(600)
def test_verify_command_checks_the_same_step_on_every_rank(tmp_path: Path) -> None:
    ctl = ControllerProcess(tmp_path / "tg.db").start()
    run = "verify-0"
    ranks = Ranks(2, {"scenario": "trials", "controller": ctl.url, "prefix": "verify", "trials": 1,
                      "max_steps": 4000, "jitter_s": 0.002}, tmp_path)
    try:
        assert until(lambda: ranks.exited() or (ctl.run_detail(run) or {}).get("last_step") is not None, 300.0, 0.02), \
            ranks.output()
        generations = []
        for _ in range(2):
            answer = ctl.command(run, "verify")
            generations.append(answer["desired"]["generation"])
            assert until(lambda g=generations[-1]: any(a[0] == g for a in ctl.acks(run)), 60.0), ranks.output()
        ctl.command(run, "stop")
        codes = ranks.wait(300)
    finally:
        ranks.kill()
        ctl.kill()
    assert codes == [0, 0], ranks.output()
    logs = [json.loads((tmp_path / f"trials-rank{r}.json").read_text())[0] for r in range(2)]
    applied_at = dict(_applied_at(logs))
    expected = [applied_at[g] + 1 for g in generations]
    for log in logs:
        assert [v[0] for v in log["verified"]] == expected, log["verified"]
        assert all(v[2] and v[1] == 0.0 and not v[3] for v in log["verified"])  # bit-identical on the CPU


def _applied_at(logs: list[dict]) -> list[tuple[int, int]]:
    """(generation, step) each generation was applied at, as the ranks logged it (the same on both)."""
    assert [h[:2] for h in logs[0]["history"]] == [h[:2] for h in logs[1]["history"]]
    return [(h[0], h[1]) for h in logs[0]["history"]]
