"""The README's demo as a test: the injected faults produce the expected alerts at the expected
steps, the run recovers from the LR blow-up and the NaN with nobody intervening, every rank applies
every change at the same step, and the final loss is close to that of the run without faults."""

import math
import re
import resource
import time
from pathlib import Path

import pytest

from trainguard.cli import format_incidents
from trainguard.demo.run import DemoConfig, run_demo

pytestmark = [pytest.mark.distributed, pytest.mark.integration, pytest.mark.timeout(400)]


ROOT = Path(__file__).resolve().parents[2]


def _cpu_seconds() -> float:
    """CPU time of this process and of its children that have ended (the demo's processes)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def test_demo_story(tmp_path, record_property) -> None:
    cfg = DemoConfig(quiet=True, resume_after_s=0.5, workdir=str(tmp_path))
    cpu0, wall0 = _cpu_seconds(), time.monotonic()
    result = run_demo(cfg)
    cpu, wall = _cpu_seconds() - cpu0, time.monotonic() - wall0
    record_property("demo_cpu_seconds", round(cpu, 1))
    record_property("demo_wall_seconds", round(wall, 1))

    # The duration the README and docs/demo.md state is the one measured here, within 2x. It is
    # measured as CPU time, which does not depend on how busy the machine is (the wall time does:
    # the stated wall time on two cores is that CPU time spread over both).
    for page in (ROOT / "README.md", ROOT / "docs" / "demo.md"):
        text = " ".join(page.read_text(encoding="utf-8").split())
        # The CPU time depends on the processor (60 CPU-seconds on the 2-core EPYC the project is
        # developed on, 32 on CI's), so the pages state the range measured on both.
        stated = re.search(r"about (\d+) s on two: (\d+) to (\d+) CPU-seconds", text)
        assert stated, f"{page.name} does not state the demo's duration"
        two_cores, cpu_low, cpu_high = (float(stated.group(i)) for i in (1, 2, 3))
        assert cpu_low / 2 <= cpu <= 2 * cpu_high, (page.name, cpu_low, cpu_high, cpu)
        assert cpu / 4 <= two_cores <= cpu, (page.name, two_cores, cpu)  # within 2x of cpu / 2

    # training finished on every rank, and the healthy run beside it
    assert result.steps_completed == [cfg.steps] * cfg.world_size
    assert len(result.healthy_losses) == cfg.steps

    first = {}
    for alert in result.alerts:
        first.setdefault(alert["rule"], alert)
    # the data burst (steps 40..54) is noticed by reports inside or right after it: notify only
    for rule in ("data_duplicate_ratio", "data_special_token_ratio", "data_token_kl", "data_length_shift"):
        assert rule in first, f"{rule} did not fire; alerts: {[a['rule'] for a in result.alerts]}"
        assert cfg.burst[0] <= first[rule]["step"] <= cfg.burst[1] + cfg.report_every

    # Nobody intervened: every change of desired state came from a rule or the recovery ladder,
    # and the run was never paused.
    assert result.actions and all(a["actor"].startswith(("rule:", "recovery:")) for a in result.actions)
    assert not any(a["desired"]["paused"] for a in result.actions)

    # The LR blow-up (x100 from step 75 on, for good) is acted on at the first report after it:
    # adaptive LR brings the update size back to its healthy level, about lr_scale 1/100.
    first_action = result.actions[0]
    onset = cfg.lr_blowup[0]
    assert onset <= first_action["applied_step"] - 1 <= onset + cfg.report_every
    assert 0.5 / cfg.lr_blowup_factor <= first_action["desired"]["lr_scale"] <= 2.0 / cfg.lr_blowup_factor
    # The incident it opened climbed the ladder and ended recovered, without a pause.
    (incident,) = [i for i in result.incidents if i["onset_step"] <= onset + cfg.report_every <= (i["closed_step"] or 10**9)]
    rungs = [r["rung"] for r in incident["rungs"]]
    assert rungs[0] == "adaptive_lr" and "pause" not in rungs and incident["outcome"] == "recovered"
    assert all(i["outcome"] == "recovered" for i in result.incidents)
    # each incident's cause was decided before its first action: the LR blow-up is the optimizer's,
    # and the summary prints every incident's verdict with its evidence
    assert incident["cause"] == "optimizer"
    assert any(e["signal"] == "trainguard_scheduler_lr" and e["points_to"] == "optimizer" for e in incident["verdict"]["evidence"])
    summary = format_incidents(result.incidents)
    for inc in result.incidents:
        assert f"  cause: {inc['cause']}: {inc['verdict']['summary']}" in summary.splitlines()
    rollbacks = [a for a in result.actions if a["desired"].get("rollback_seq", 0) > 0]
    for rb in rollbacks:  # a rollback goes back before the onset, to a snapshot on the agent's grid
        assert rb["desired"]["rollback_step"] < onset and rb["desired"]["rollback_step"] % cfg.snapshot_every == 0

    # The NaN at step 115 is carried by the report of that interval; the agent skipped the step on
    # every rank, so the weights stayed as they were: noted as the agent's skip, no rollback for it.
    nan_alert = first["loss_nonfinite"]
    assert nan_alert["severity"] == "critical"
    assert nan_alert["step"] == math.ceil(cfg.nan_step / cfg.report_every) * cfg.report_every
    # with the stability guide's symptom table: NaN loss -> gradient explosion -> lower the LR / clip harder
    assert any("explosion" in c.lower() for c in nan_alert["diagnosis"]["likely_causes"])
    assert any("learning rate" in a.lower() for a in nan_alert["diagnosis"]["suggested_actions"])
    assert not [a for a in result.actions if a["actor"] == "rule:loss_nonfinite"]
    assert any(r["rung"] == "skip" and r["step"] == nan_alert["step"] for i in result.incidents for r in i["rungs"])

    # every rank applied every generation at the same step, and used scheduler LR x lr_scale
    for log in result.rank_logs:
        assert [e["step"] for e in log] == list(range(1, cfg.steps + 1))
    for entries in zip(*result.rank_logs):
        assert len({e["generation"] for e in entries}) == 1
        assert len({e["lr_scale"] for e in entries}) == 1
    for log in result.rank_logs:
        scale_in_effect = 1.0  # a generation applied in end_step of step S takes effect from step S + 1
        for e in log:
            if e["step"] == cfg.nan_step:
                assert math.isnan(e["lr_used"]), "the non-finite step was not skipped"
            elif not math.isnan(e["lr_used"]):  # (other NaNs: steps the spike guard skipped)
                assert e["lr_used"] == pytest.approx(e["lr_sched"] * scale_in_effect, rel=1e-12), e
            scale_in_effect = e["lr_scale"]
    assert all(math.isfinite(e["loss"]) for log in result.rank_logs for e in log if e["step"] != cfg.nan_step)

    # Recovered: the final loss is within 1.2x the run without faults (the benchmark's criterion).
    healthy = result.healthy_final_loss()
    assert healthy is not None and result.final_loss() <= 1.2 * healthy, (result.final_loss(), healthy)
