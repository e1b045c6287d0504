"""The README's demo as a test: the injected faults produce the expected alerts and actions at the
expected steps, every rank applies them at the same step, and training finishes."""

import math

import pytest

from trainguard.demo.run import DemoConfig, run_demo

pytestmark = [pytest.mark.distributed, pytest.mark.integration, pytest.mark.timeout(300)]


def test_demo_story(tmp_path) -> None:
    cfg = DemoConfig(quiet=True, resume_after_s=0.5, workdir=str(tmp_path))
    result = run_demo(cfg)

    # training finished on every rank
    assert result.steps_completed == [cfg.steps] * cfg.world_size

    first = {}
    for alert in result.alerts:
        first.setdefault(alert["rule"], alert)
    # the data burst (steps 40..54) is noticed by reports inside or right after it: notify only
    for rule in ("data_duplicate_ratio", "data_special_token_ratio", "data_token_kl", "data_length_shift"):
        assert rule in first, f"{rule} did not fire; alerts: {[a['rule'] for a in result.alerts]}"
        assert cfg.burst[0] <= first[rule]["step"] <= cfg.burst[1] + cfg.report_every
    # the LR blow-up (steps 75..89) gives a gradient spike, answered by halving the LR
    spike = first["grad_norm_spike"]
    assert cfg.lr_blowup[0] <= spike["step"] <= cfg.lr_blowup[1]
    # the NaN at step 115 is carried by the report of that interval and pauses the run
    nan_alert = first["loss_nonfinite"]
    assert nan_alert["severity"] == "critical"
    # with the stability guide's symptom table: NaN loss -> gradient explosion -> lower the LR / clip harder
    assert any("explosion" in c.lower() for c in nan_alert["diagnosis"]["likely_causes"])
    assert any("learning rate" in a.lower() for a in nan_alert["diagnosis"]["suggested_actions"])
    assert nan_alert["step"] == math.ceil(cfg.nan_step / cfg.report_every) * cfg.report_every

    by_actor = {a["actor"]: a for a in result.actions}
    lr_action = by_actor["rule:grad_norm_spike"]
    assert lr_action["desired"]["lr_scale"] == 0.5
    pause = by_actor["rule:loss_nonfinite"]
    assert pause["desired"]["paused"] is True
    resume = next(a for a in result.actions if a["actor"].startswith("operator:"))
    assert resume["desired"]["paused"] is False and resume["generation"] > pause["generation"]
    # each action applied at the step boundary after the report that carried its cause
    assert lr_action["applied_step"] == spike["step"] + 1
    assert pause["applied_step"] == nan_alert["step"] + 1

    # every rank applied every generation at the same step, and used scheduler LR x lr_scale
    for log in result.rank_logs:
        assert [e["step"] for e in log] == list(range(1, cfg.steps + 1))
    for entries in zip(*result.rank_logs):
        assert len({e["generation"] for e in entries}) == 1
        assert len({e["lr_scale"] for e in entries}) == 1
    # a generation applied in end_step of step S takes effect from step S + 1
    for log in result.rank_logs:
        scale_in_effect = 1.0
        for e in log:
            assert e["lr_scale"] == (0.5 if e["step"] >= lr_action["applied_step"] else 1.0), e
            if e["step"] == cfg.nan_step:
                assert math.isnan(e["lr_used"]), "the non-finite step was not skipped"
            else:
                assert e["lr_used"] == pytest.approx(e["lr_sched"] * scale_in_effect, rel=1e-12), e
            scale_in_effect = e["lr_scale"]
    # the NaN step was skipped on every rank (skip_nonfinite), so the weights stayed finite
    assert all(math.isfinite(e["loss"]) for e in result.rank_logs[0] if e["step"] > cfg.nan_step)
