"""The controller's ``verify`` command on two gloo ranks (``dist_worker.py``) with a real
``trainguard serve``: every rank recomputes the gradient of the same step, the one after the step
at which every rank applied the command, and a clean run is not flagged; ``verify_float32`` on a
bfloat16-autocast run recomputes that step in float32 on every rank too, and the report carries
each rank's measure."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.control.procs import ControllerProcess, Ranks, until

pytestmark = pytest.mark.distributed


def _run_commands(tmp_path: Path, run: str, commands: tuple[str, ...], **cfg: object) -> tuple[list[int], dict, list, list]:
    """Two ranks of the ``trials`` scenario under a real controller: each of ``commands`` given
    once the previous one is acknowledged, then, once the report holding the step after the last
    one's ack is in, a stop. Returns the commands' generations, the last answer, the stored
    reports and each rank's log."""
    ctl = ControllerProcess(tmp_path / "tg.db").start()
    ranks = Ranks(2, {"scenario": "trials", "controller": ctl.url, "prefix": run.rsplit("-", 1)[0], "trials": 1,
                      "max_steps": 4000, "jitter_s": 0.002, **cfg}, tmp_path)
    try:
        assert until(lambda: ranks.exited() or (ctl.run_detail(run) or {}).get("last_step") is not None, 300.0, 0.02), \
            ranks.output()
        generations = []
        for command in commands:
            answer = ctl.command(run, command)
            generations.append(answer["desired"]["generation"])
            assert until(lambda g=generations[-1]: any(a[0] == g for a in ctl.acks(run)), 60.0), ranks.output()
        checked_at = next(step for g, step in ctl.acks(run) if g == generations[-1]) + 1
        assert until(lambda: any(r["steps"][1] >= checked_at for r in ctl.reports(run)), 60.0), ranks.output()
        ctl.command(run, "stop")
        codes = ranks.wait(300)
        reports = ctl.reports(run)
    finally:
        ranks.kill()
        ctl.kill()
    assert codes == [0, 0], ranks.output()
    logs = [json.loads((tmp_path / f"trials-rank{r}.json").read_text())[0] for r in range(2)]
    return generations, answer, reports, logs


@pytest.mark.timeout(600)
def test_verify_command_checks_the_same_step_on_every_rank(tmp_path: Path) -> None:
    generations, _, _, logs = _run_commands(tmp_path, "verify-0", ("verify", "verify"))
    applied_at = dict(_applied_at(logs))
    expected = [applied_at[g] + 1 for g in generations]
    for log in logs:
        assert [v[0] for v in log["verified"]] == expected, log["verified"]
        assert all(v[2] and v[1] == 0.0 and not v[3] for v in log["verified"])  # bit-identical on the CPU


@pytest.mark.timeout(600)
def test_verify_float32_command_measures_the_autocast_step_on_every_rank(tmp_path: Path) -> None:
    generations, answer, reports, logs = _run_commands(tmp_path, "amp-0", ("verify", "verify-float32"), autocast=True)
    assert answer["desired"]["verify_float32_seq"] == 1 and answer["desired"]["verify_seq"] == 1
    applied_at = dict(_applied_at(logs))
    same, float32 = (applied_at[g] + 1 for g in generations)
    measured = []
    for log in logs:
        assert [v[0] for v in log["verified"]] == [same, float32], log["verified"]
        (s_step, s_rel, s_bitwise, s_mismatch, s_f32), (f_step, f_rel, f_bitwise, f_mismatch, f_f32) = log["verified"]
        # the same-precision recompute replays the loop's autocast: bit for bit, on both commands' steps
        assert s_bitwise and f_bitwise and s_rel == f_rel == 0.0 and not s_mismatch and not f_mismatch
        # only the float32 command recomputes in float32: bfloat16 rounding, real and small
        assert math.isnan(s_f32) and 1e-5 < f_f32 < 0.1
        measured.append(f_f32)
    # the report of the interval holding that step carries each rank's value (a large job sends it as float32)
    (report,) = [r for r in reports if r["steps"][0] <= float32 <= r["steps"][1]]
    assert report["ranks"]["verify_float32"] == pytest.approx(measured, rel=1e-7)
    assert all(math.isnan(v) for r in reports if r is not report for v in r["ranks"].get("verify_float32", []))


def _applied_at(logs: list[dict]) -> list[tuple[int, int]]:
    """(generation, step) each generation was applied at, as the ranks logged it (the same on both)."""
    assert [h[:2] for h in logs[0]["history"]] == [h[:2] for h in logs[1]["history"]]
    return [(h[0], h[1]) for h in logs[0]["history"]]
