"""The cause verdict (``service/cause.py``) and the rungs each cause takes (``service/incidents.py``),
replayed through the default rules without I/O (``engine.simulate``): a data burst is skipped with
the LR untouched, a warm restart of the schedule draws no action (no incident even when the agent
skips its steps; a NaN after it is the optimizer's), an LR above anything the run had
is met with the optimizer's ladder, a recompute that does not reproduce a gradient names the rank,
and an incident of unknown cause runs the troubleshooting experiment."""

from __future__ import annotations

import math

import pytest

from trainguard.protocol.wire import Report
from trainguard.service.cause import CAUSES, refusal
from trainguard.service.incidents import RunRecovery
from trainguard.service.schemas import IncidentList
from trainguard.service.rules import AdaptiveLrAction, LrScaleAction, PauseAction, RecoveryPolicy, RulesError, default_rules_text, load_rules

RULES = load_rules(default_rules_text())
POLICY = RULES.file.recovery


def _values(i: int, **over: float) -> dict[str, float]:
    v = {"trainguard_loss": 2.0 + 0.01 * math.sin(i), "trainguard_update_ratio": 1e-3 * (1 + 0.01 * math.sin(i)),
         "trainguard_grad_norm_max": 1.0, "trainguard_scheduler_lr": 1e-3, "trainguard_data_token_kl_divergence": 0.01}
    v.update(over)
    # what the agent reports beside them: the update per unit of the LR the step applied
    v.setdefault("trainguard_update_ratio_per_lr", v["trainguard_update_ratio"] / v["trainguard_scheduler_lr"])
    return v


def _report(i: int, world: int = 1, ranks: dict | None = None, **over: float) -> Report:
    return Report(job="j", step_first=i, step_last=i, time=float(i), values=_values(i, **over), ranks=ranks or {})


def _incidents(reports: list[Report], world: int = 1, policy: RecoveryPolicy = POLICY) -> tuple[list, list[dict]]:
    """Replay through the rules and a RunRecovery kept here, as the controller feeds it."""
    from trainguard.service.engine import AlertBook, decide
    from trainguard.service.evaluate import evaluate
    from trainguard.service.window import RunWindow
    from trainguard.protocol.wire import DesiredState

    window = RunWindow(capacity=128, rank_capacity=8, world_size=world, created=0.0)
    book, rec, desired = AlertBook(), RunRecovery(policy), DesiredState()
    states = []
    for r in reports:
        window.append(r, r.time)
        rec.before_decide(r.values)
        findings = evaluate(RULES.base, window, r.time)
        rec.consider(findings, window, ranks=[{"rank": k, "host": f"node-{k}"} for k in range(world)])
        out = decide(findings, book, desired, r.time, complete=True, ctx=rec)
        changes = rec.after_report(step=r.step_last, values=r.values, findings=findings, before=desired,
                                   desired=out.desired, fired=[(f.finding.rule.name, f.desired) for f in out.fired if f.desired],
                                   now=r.time)
        desired = changes[-1].desired if changes else out.desired
        states.append(desired)
    return states, [i.as_dict() for i in rec.incidents]


def test_a_data_burst_is_skipped_with_the_lr_untouched() -> None:
    healthy = [_report(i) for i in range(1, 60)]
    # ten reports of corrupted text: the loss jumps, the token distribution drifts, the update ratio rises 8x
    burst = [_report(i, trainguard_loss=5.5, trainguard_data_token_kl_divergence=0.5, trainguard_update_ratio=8e-3)
             for i in range(60, 70)]
    after = [_report(i) for i in range(70, 90)]
    states, incidents = _incidents(healthy + burst + after)
    (inc,) = incidents
    assert (inc["cause"], inc["onset_step"], inc["trigger"]) == ("data", 60, "cause:data")
    kl = [e for e in inc["verdict"]["evidence"] if e["signal"] == "rule:data_token_kl"]
    assert kl == [{"signal": "rule:data_token_kl", "value": 0.5, "reference": 0.1, "points_to": "data",
                   "detail": kl[0]["detail"]}]
    assert [r["rung"] for r in inc["rungs"]] == ["data_skip"] and inc["outcome"] == "recovered"
    assert all(s.lr_scale == 1.0 and not s.paused and s.rollback_seq == 0 for s in states)
    # every burst step from the one after the first bad report is covered by a skip applied before it
    # (8 steps ahead, renewed when 4 or fewer remain: at 64 to 72, at 68 to 76)
    step_of = {r.step_last: s for r, s in zip(healthy + burst + after, states)}
    assert [step_of[s].data_skip_until for s in (59, 60, 63, 64, 68, 69, 70)] == [0, 68, 68, 72, 76, 76, 76]
    # from the first bad batch's step on, renewals included (a job restarted from an earlier
    # checkpoint trains on the steps before it)
    assert [step_of[s].data_skip_from for s in (59, 60, 64, 68, 70)] == [0, 61, 61, 61, 61]
    assert inc["data_skipped"] == [61, 76]


def _burst_then_hurt(hurt_reports: int) -> list[Report]:
    """A 30-report data burst whose skip reached the ranks a few steps late: the weights took a few
    bad steps, so once the data is back the gradients run 12x their norm for ``hurt_reports``
    reports, then settle."""
    healthy = [_report(i) for i in range(1, 60)]
    burst = [_report(i, trainguard_loss=5.5, trainguard_data_token_kl_divergence=0.5) for i in range(60, 90)]
    hurt = [_report(i, trainguard_loss=3.0, trainguard_grad_norm_max=12.0) for i in range(90, 90 + hurt_reports)]
    return healthy + burst + hurt + [_report(i) for i in range(90 + hurt_reports, 90 + hurt_reports + 20)]


def test_a_data_skips_window_opens_when_its_data_is_back_not_when_it_was_decided() -> None:
    # The skip rung was decided at step 60; judged from there, its window (3 reports, 15 steps) was
    # used up by the burst itself and the third unhealthy report on good data escalated (a rollback,
    # refused without snapshots: a pause). Judged from when the data is back, the run gets its
    # 15 steps on good data, and heals within them.
    states, incidents = _incidents(_burst_then_hurt(8))
    (inc,) = incidents
    assert inc["cause"] == "data" and [r["rung"] for r in inc["rungs"]] == ["data_skip"]
    assert inc["outcome"] == "recovered"
    assert all(s.lr_scale == 1.0 and not s.paused and s.rollback_seq == 0 for s in states)


def test_a_data_incident_whose_signals_stay_bad_on_good_data_still_climbs_the_ladder() -> None:
    reports = _burst_then_hurt(40)
    states, incidents = _incidents(reports)
    (inc,) = incidents
    assert [r["rung"] for r in inc["rungs"]][:2] == ["data_skip", "rollback"]
    back = next(r.step_last for r in reports if r.step_last >= 60
                and r.values["trainguard_data_token_kl_divergence"] < 0.1)  # the first report on good data
    rollback = inc["rungs"][1]
    # window_steps after the last report that still skipped data, and not before
    assert rollback["step"] == back - 1 + POLICY.window_steps
    assert states[-1].paused  # refused without snapshots, so paused for a human


def test_a_warm_restart_of_the_schedule_draws_no_action() -> None:
    # cosine-like decay from 1e-3 to 1e-4 while healthy, the update ratio following the LR
    decay = [_report(i, trainguard_scheduler_lr=1e-3 - 9e-4 * i / 50, trainguard_update_ratio=(1e-3 - 9e-4 * i / 50))
             for i in range(1, 51)]
    restart = [_report(i, trainguard_scheduler_lr=1e-3, trainguard_update_ratio=1e-3) for i in range(51, 60)]
    states, incidents = _incidents(decay + restart)
    assert incidents == []  # the update ratio spike's adaptive LR was refused: the schedule's own move
    assert all(s.lr_scale == 1.0 and s.generation == 0 for s in states)


def test_an_lr_above_anything_the_run_had_is_the_optimizers() -> None:
    healthy = [_report(i) for i in range(1, 40)]
    # (the gradient values past their limit make the alert; the verdict reads the scheduled LR)
    jump = [_report(i, trainguard_scheduler_lr=1e-2, trainguard_update_ratio=1e-2, trainguard_grad_norm_max=3000.0)
            for i in range(40, 44)]
    states, incidents = _incidents(healthy + jump)
    (inc,) = incidents
    assert inc["cause"] == "optimizer" and inc["rungs"][0]["rung"] == "adaptive_lr"
    lr = [e for e in inc["verdict"]["evidence"] if e["signal"] == "trainguard_scheduler_lr"]
    assert lr[0]["points_to"] == "optimizer" and lr[0]["reference"] == {"healthy": 1e-3, "peak": 1e-3}
    assert states[39].lr_scale < 1.0  # the optimizer's ladder acts on the LR


def test_a_transient_lr_fault_over_by_the_report_is_still_the_optimizers() -> None:
    # three steps at 1000x inside a report interval: at the report step the schedule is back, the
    # interval's largest scheduled LR is not, and the agent skipped 16 steps in a row
    healthy = [_report(i, trainguard_scheduler_lr_max=1e-3) for i in range(1, 40)]
    fault = [_report(40, trainguard_scheduler_lr_max=1.0, trainguard_consecutive_skipped_steps=16.0)]
    _, incidents = _incidents(healthy + fault)
    (inc,) = incidents
    assert inc["cause"] == "optimizer"
    (lr,) = [e for e in inc["verdict"]["evidence"] if e["signal"] == "trainguard_scheduler_lr"]
    assert (lr["value"], lr["points_to"]) == (1.0, "optimizer")


def test_a_recompute_that_does_not_reproduce_the_gradient_names_the_rank_and_checkpoints_and_pauses() -> None:
    nan2 = [math.nan, math.nan]
    healthy = [_report(i, world=2, ranks={"verify_mismatch": nan2}) for i in range(1, 20)]
    checked = [_report(20, world=2, ranks={"verify_mismatch": [0.0, 3e-3]})]
    states, incidents = _incidents(healthy + checked, world=2)
    (inc,) = incidents
    assert inc["cause"] == "hardware" and (inc["verdict"]["ranks"], inc["verdict"]["hosts"]) == ([1], ["node-1"])
    assert [r["rung"] for r in inc["rungs"]] == ["checkpoint", "pause"] and inc["outcome"] == "escalated"
    assert (states[-1].checkpoint_seq, states[-1].paused, states[-1].lr_scale) == (1, True, 1.0)
    assert "rank 1 on node-1" in states[-1].reason


def test_hardware_evidence_revises_an_open_incident_and_takes_the_hardware_rungs() -> None:
    nan2 = [math.nan, math.nan]
    healthy = [_report(i, world=2, ranks={"verify_mismatch": nan2}) for i in range(1, 30)]
    jump = [_report(i, world=2, ranks={"verify_mismatch": nan2}, trainguard_scheduler_lr=1e-2,
                    trainguard_update_ratio=1e-2, trainguard_grad_norm_max=3000.0) for i in range(30, 33)]
    checked = [_report(33, world=2, ranks={"verify_mismatch": [4e-3, 0.0]}, trainguard_grad_norm_max=3000.0)]
    states, incidents = _incidents(healthy + jump + checked, world=2)
    (inc,) = incidents
    assert inc["cause"] == "hardware" and inc["verdict"]["revised"]["from"] == "optimizer"
    assert inc["verdict"]["revised"]["step"] == 33 and (inc["verdict"]["ranks"], inc["verdict"]["hosts"]) == ([0], ["node-0"])
    assert [r["rung"] for r in inc["rungs"]][-2:] == ["checkpoint", "pause"] and states[-1].paused


def test_a_hardware_ladder_that_stops_carries_the_documented_exit_status() -> None:
    from trainguard.protocol.wire import EXIT_HARDWARE_FAULT
    from trainguard.service.rules import CauseLadders

    policy = POLICY.model_copy(update={"ladders": CauseLadders(hardware=("checkpoint", "stop"))})
    healthy = [_report(i, world=2, ranks={"gpu_xid": [0.0, 0.0]}) for i in range(1, 10)]
    xid = [_report(10, world=2, ranks={"gpu_xid": [0.0, 79.0]})]  # rank 1's GPU fell off the bus
    states, incidents = _incidents(healthy + xid, world=2, policy=policy)
    (inc,) = incidents
    assert inc["cause"] == "hardware" and inc["verdict"]["hosts"] == ["node-1"]
    assert [r["rung"] for r in inc["rungs"]] == ["checkpoint", "stop"] and inc["outcome"] == "escalated"
    final = states[-1]
    assert (final.checkpoint_seq, final.stop, final.stop_exit_code, final.paused) == (1, True, EXIT_HARDWARE_FAULT, False)
    assert EXIT_HARDWARE_FAULT == 75


@pytest.mark.parametrize("ladder", [("checkpoint", "stop"), ("checkpoint", "pause")])
def test_reports_sent_before_the_ranks_apply_a_stop_or_pause_open_no_second_incident(ladder: tuple[str, ...]) -> None:
    """The ranks apply the controller's state at the first agreement after the leader's client has
    it, so under load a further recompute can fail and be reported before the stop (or pause)
    lands: the run is ending (or a human's), and that report must not open a second incident with
    a second checkpoint, however many steps the round trip takes."""
    from trainguard.service.rules import CauseLadders

    policy = POLICY.model_copy(update={"ladders": CauseLadders(hardware=ladder)})
    nan2 = [math.nan, math.nan]
    healthy = [_report(i, world=2, ranks={"verify_mismatch": nan2}) for i in range(1, 30)]
    failing = [_report(i, world=2, ranks={"verify_mismatch": [0.0, 0.4 if i % 5 == 0 else math.nan]}) for i in range(30, 46)]
    states, incidents = _incidents(healthy + failing, world=2, policy=policy)
    (inc,) = incidents
    assert [r["rung"] for r in inc["rungs"]] == list(ladder) and inc["outcome"] == "escalated"
    decided = states[29]  # the report of step 30, the first failing recompute
    assert decided.checkpoint_seq == 1 and (decided.stop or decided.paused)
    assert all(s == decided for s in states[29:])  # steps 35, 40 and 45 fail again: nothing more is decided


def test_an_xid_of_the_applications_own_kernels_does_not_make_the_node_suspect() -> None:
    healthy = [_report(i, world=2, ranks={"gpu_xid": [0.0, 0.0]}) for i in range(1, 10)]
    xid = [_report(10, world=2, ranks={"gpu_xid": [13.0, 0.0]})]  # 13: a fault in the application's kernels
    states, incidents = _incidents(healthy + xid, world=2)
    assert incidents == [] and states[-1].generation == 0  # the alert notifies; nothing is stopped or paused


def test_a_recompute_that_reproduces_the_gradient_is_evidence_against_the_hardware() -> None:
    healthy = [_report(i, world=2, ranks={"verify_mismatch": [math.nan, math.nan]}) for i in range(1, 40)]
    spike = [_report(40, world=2, ranks={"verify_mismatch": [0.0, 1e-9]}, trainguard_update_ratio=1e-2,
                     trainguard_grad_norm_max=3000.0)]
    _, incidents = _incidents(healthy + spike, world=2)
    (inc,) = incidents
    assert inc["cause"] == "optimizer"
    (check,) = [e for e in inc["verdict"]["evidence"] if e["signal"] == "ranks.verify_mismatch"]
    assert (check["value"], check["points_to"]) == (1e-9, "none")


def test_an_incident_of_unknown_cause_runs_the_experiment_and_its_outcome_decides_the_next_rung() -> None:
    healthy = [_report(i) for i in range(1, 30)]
    # the agent keeps skipping (5 in a row at each report): more than one batch, nothing else points anywhere
    stuck = [_report(i, trainguard_consecutive_skipped_steps=5.0) for i in range(30, 80)]
    states, incidents = _incidents(healthy + stuck)
    (inc,) = incidents
    assert inc["cause"] == "unknown"
    rungs = [(r["rung"], r["step"]) for r in inc["rungs"]]
    # (the agent's skips are noted again after each controller rung; the controller's rungs:)
    taken = [(r, s) for r, s in rungs if r != "skip"]
    # skip at the onset; the window (3 reports and 15 steps) ends at 45: the experiment, 10 steps;
    # the symptom stayed: the LR goes back and adaptive LR is passed over for the rollback, which is
    # refused without a snapshot (paused: escalated)
    assert rungs[0] == ("skip", 30) and taken[0] == ("experiment", 45)
    exp = inc["experiment"]
    assert (exp["from_step"], exp["until_step"], exp["outcome"]) == (45, 55, "not_followed")
    step_of = {r.step_last: s for r, s in zip(healthy + stuck, states)}
    assert step_of[45].lr_scale == pytest.approx(0.1) and step_of[54].lr_scale == pytest.approx(0.1)
    assert step_of[55].lr_scale == 1.0
    assert taken[1:] == [("rollback", 70)] and inc["outcome"] == "escalated"


def test_a_data_verdict_on_one_batch_is_revised_when_the_skips_go_on() -> None:
    """One skipped step, the loss up: one batch stands out, a data incident. The agent goes on
    skipping (3, then 5 steps in a row), with no data rule firing: no single batch is the cause
    (a schedule's LR past what the run takes makes every batch stand out). The cause is revised
    to unknown and the unknown ladder's experiment follows, not the data skip; the revision is
    recorded. With a data rule among the evidence the data verdict stands."""
    healthy = [_report(i) for i in range(1, 30)]
    one = [_report(30, trainguard_consecutive_skipped_steps=1.0, trainguard_loss=3.0)]
    more = [_report(i, trainguard_consecutive_skipped_steps=3.0 if i == 31 else 5.0) for i in range(31, 60)]
    _, incidents = _incidents(healthy + one + more)
    (inc,) = incidents
    assert inc["cause"] == "unknown" and inc["verdict"]["cause"] == "data"  # judged data at the onset
    assert inc["verdict"]["revised"]["from"] == "data" and inc["verdict"]["revised"]["step"] == 31
    taken = [r["rung"] for r in inc["rungs"] if r["rung"] != "skip"]
    assert taken[0] == "experiment" and "data_skip" not in taken

    _, stays = _incidents(healthy + one[:1] + [_report(31, trainguard_consecutive_skipped_steps=1.0)])
    assert stays[0]["cause"] == "data" and "revised" not in stays[0]["verdict"]  # one batch: nothing refutes it
    drifted = [_report(30, trainguard_consecutive_skipped_steps=1.0, trainguard_loss=3.0,
                       trainguard_data_token_kl_divergence=0.5)]  # the token distribution drifted too
    _, stays = _incidents(healthy + drifted + more)
    assert stays[0]["cause"] == "data" and "revised" not in stays[0]["verdict"]


def test_the_experiment_concludes_optimizer_when_the_symptom_follows_the_lr() -> None:
    healthy = [_report(i) for i in range(1, 30)]
    stuck = [_report(i, trainguard_consecutive_skipped_steps=5.0) for i in range(30, 50)]
    calm = [_report(i) for i in range(50, 60)]  # under the 10x lower LR the skips stop
    _, incidents = _incidents(healthy + stuck + calm)
    (inc,) = incidents
    assert inc["experiment"]["outcome"] == "followed" and inc["cause"] == "optimizer"


def test_causes_refuse_the_actions_that_do_not_fit_them() -> None:
    cut, raise_ = LrScaleAction(factor=0.5), LrScaleAction(factor=2.0)
    assert refusal("data", cut) == "lr_scale refused: the cause is data"
    assert refusal("data", AdaptiveLrAction()) and refusal("data", PauseAction())
    assert refusal("data", raise_) is None and refusal("optimizer", cut) is None and refusal(None, cut) is None
    assert refusal("schedule", AdaptiveLrAction()) and refusal("hardware", AdaptiveLrAction())
    assert refusal("hardware", PauseAction()) is None


@pytest.mark.parametrize(("ladders", "message"), [
    ({"data": ["skip", "adaptive_lr"]}, "ladders.data: adaptive_lr does not fit a fault of that cause"),
    ({"data": ["pause"]}, "ladders.data: pause does not fit a fault of that cause"),
    ({"hardware": ["checkpoint", "pause", "stop"]}, "either pause"),
    ({"hardware": ["rollback"]}, "ladders.hardware: rollback does not fit"),
])
def test_a_rules_file_cannot_give_a_cause_rungs_that_do_not_fit_it(ladders: dict, message: str) -> None:
    import yaml

    with pytest.raises(RulesError) as e:
        load_rules(yaml.safe_dump({"version": 1, "recovery": {"ladders": ladders}, "rules": []}))
    assert message in str(e.value)


def test_the_verdict_and_its_evidence_reach_the_api_the_event_stream_a_webhook_and_the_cli(tmp_path, serve, receiver_factory) -> None:
    import json
    import subprocess
    import sys

    import httpx

    from tests.service.conftest import wait_until
    from tests.service.test_service_events import _Subscriber

    rx = receiver_factory([200])
    srv = serve(tmp_path / "tg.db")
    reg = {"job": "job-a", "run": "run-hw", "world_size": 2, "agent_version": "test",
           "ranks": [{"rank": r, "local_rank": 0, "host": f"node-{'ab'[r]}", "port": 9100} for r in range(2)]}
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        assert c.post("/v1/webhooks", json={"url": rx.url, "secret": "s3cret-s3cret-s3cret", "min_severity": "warning"}).status_code == 201
        assert c.post("/v1/runs", json=reg).status_code == 200
        live = _Subscriber(f"{srv.url}/v1/events/stream?run=run-hw")
        assert live.connected.wait(30) and live.error is None, live.error
        for step in range(1, 6):  # rank 1's recompute of step 5 does not reproduce its gradient
            mismatch = [0.0, 3e-3] if step == 5 else ["NaN", "NaN"]  # (the wire spells NaN as a string)
            body = {"job": "job-a", "step_first": step, "step_last": step, "time": float(step),
                    "values": {"trainguard_loss": 2.0}, "ranks": {"verify_mismatch": mismatch}}
            assert c.post("/v1/runs/run-hw/reports", json=body).status_code == 200
        wait_until(lambda: live.incidents() or live.error)
        live.stop.set()
        listed = c.get("/v1/runs/run-hw/incidents").json()
        IncidentList.model_validate(listed)  # the answer is the documented schema
        (incident,) = listed["incidents"]
        doc = c.get("/openapi.json").json()
        assert doc["components"]["schemas"]["Incident"]["properties"]["cause"]["enum"] == list(CAUSES)
        desired = c.get("/v1/runs/run-hw/desired").json()
        wait_until(lambda: rx.requests)
    assert incident["cause"] == "hardware" and incident["outcome"] == "escalated"
    verdict = incident["verdict"]
    assert (verdict["ranks"], verdict["hosts"]) == ([1], ["node-b"])
    (ev,) = [e for e in verdict["evidence"] if e["signal"] == "rule:gradient_recompute_mismatch"]
    assert (ev["value"], ev["reference"], ev["points_to"]) == ({"1": 3e-3}, 1e-5, "hardware")
    assert [r["rung"] for r in incident["rungs"]] == ["checkpoint", "pause"]
    assert (desired["checkpoint_seq"], desired["paused"], desired["lr_scale"]) == (1, True, 1.0)
    assert "rank 1 on node-b" in desired["reason"]
    # the event stream: the incident as the API lists it, verdict and evidence included
    assert live.incidents()[-1][1]["data"]["incident"] == incident
    # the webhook: the incident, its cause and the suspect host (an orchestrator leaves it out)
    (msg,) = [json.loads(body) for _, body in rx.requests if json.loads(body).get("kind") == "incident"]
    assert msg["incident"] == incident and (msg["cause"], msg["hosts"]) == ("hardware", ["node-b"])
    (am,) = msg["alerts"]
    assert am["labels"]["cause"] == "hardware" and am["annotations"]["hosts"] == "node-b"
    assert "cause hardware" in am["annotations"]["summary"] and "rank 1 on node-b" in am["annotations"]["summary"]
    assert am["annotations"]["evidence"].splitlines()[0].startswith("hardware: rule:gradient_recompute_mismatch: ")
    # the CLI
    out = subprocess.run([sys.executable, "-m", "trainguard.cli", "incidents", "run-hw", "--url", srv.url],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[1] == f"  cause: hardware: {verdict['summary']}" and lines[2] == "  suspect: rank 1 on node-b"
    assert lines[3].split()[:2] == ["hardware", "rule:gradient_recompute_mismatch"]


def test_an_lr_jump_inside_one_interval_is_the_optimizers_by_the_agents_ratio_without_a_healthy_history() -> None:
    # A controller that restarted just before: no healthy scheduled LR of its own. The schedule
    # went x1000 for 3 steps inside the interval; at the report step it is back (the report's
    # scheduled LR as before), the agent's ratio (interval max / every LR before) says 1000.
    healthy = [_report(i, trainguard_scheduler_lr_ratio=1.0) for i in range(1, 3)]
    fault = [_report(3, trainguard_scheduler_lr_ratio=1000.0, trainguard_consecutive_skipped_steps=3.0)]
    _, incidents = _incidents(healthy + fault)
    (inc,) = incidents
    assert inc["cause"] == "optimizer" and "within the report's interval" in inc["verdict"]["summary"]
    (ratio,) = [e for e in inc["verdict"]["evidence"] if e["signal"] == "trainguard_scheduler_lr_ratio"]
    assert (ratio["value"], ratio["reference"], ratio["points_to"]) == (1000.0, 4.0, "optimizer")
    assert "rule scheduler_lr_jump fired" in ratio["detail"]


def test_an_lr_fault_replayed_after_a_rollback_is_not_the_schedules_own_move() -> None:
    # The agent's record of the schedule's range holds the faulty LR (1e-2) once the fault was
    # taken; the same fault again (a rollback restored the user's scheduler) is still the optimizer's.
    healthy = [_report(i, trainguard_scheduler_lr_peak=1e-3) for i in range(1, 40)]
    fault = [_report(i, trainguard_scheduler_lr=1e-2, trainguard_scheduler_lr_peak=1e-3 if i == 40 else 1e-2,
                     trainguard_update_ratio=1e-2, trainguard_grad_norm_max=3000.0) for i in range(40, 44)]
    calm = [_report(i, trainguard_scheduler_lr_peak=1e-2) for i in range(44, 80)]
    replay = [_report(80, trainguard_scheduler_lr=1e-2, trainguard_scheduler_lr_peak=1e-2,
                      trainguard_update_ratio=1e-2, trainguard_grad_norm_max=3000.0)]
    replay = [replay[0].model_copy(update={"time": 2000.0})]  # past the alert's cooldown
    _, incidents = _incidents(healthy + fault + calm + replay)
    first, again = incidents
    assert first["cause"] == "optimizer" and first["outcome"] == "recovered"
    assert again["cause"] == "optimizer" and again["onset_step"] == 80
    (lr,) = [e for e in again["verdict"]["evidence"] if e["signal"] == "trainguard_scheduler_lr"]
    assert lr["points_to"] == "optimizer" and lr["reference"]["peak"] == 1e-3


def test_a_data_incident_names_the_quarantined_samples_in_the_api_the_event_stream_and_a_webhook(tmp_path, serve, receiver_factory) -> None:
    import json

    import httpx

    from tests.service.conftest import wait_until

    rx = receiver_factory([200])
    srv = serve(tmp_path / "tg.db")
    reg = {"job": "j", "run": "run-data", "world_size": 1, "agent_version": "test",
           "ranks": [{"rank": 0, "local_rank": 0, "host": "node-a", "port": 9100}]}
    quarantine = {"step": 61, "samples": [{"shard": "/data/shards/shard-00001", "indices": [7, 3, 3]},
                                          {"shard": "/data/shards/shard-00000", "indices": [12]}]}
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        assert c.post("/v1/webhooks", json={"url": rx.url, "secret": "s3cret-s3cret-s3cret", "min_severity": "warning"}).status_code == 201
        assert c.post("/v1/runs", json=reg).status_code == 200
        # no data incident yet: nothing to name
        assert c.post("/v1/runs/run-data/quarantine", json=quarantine).json() == {"run": "run-data", "named": False}
        burst = dict(trainguard_loss=5.5, trainguard_data_token_kl_divergence=0.5, trainguard_update_ratio=8e-3)
        for i in range(1, 62):
            r = _report(i, **(burst if i >= 60 else {}))
            assert c.post("/v1/runs/run-data/reports", content=r.model_dump_json()).status_code == 200
        (opened,) = c.get("/v1/runs/run-data/incidents").json()["incidents"]
        assert opened["cause"] == "data" and opened["quarantined"] is None
        answer = c.post("/v1/runs/run-data/quarantine", json=quarantine).json()
        assert answer == {"run": "run-data", "named": True, "incident": opened["id"]}
        # the same samples again change nothing; a bad body is refused with the field named
        assert c.post("/v1/runs/run-data/quarantine", json=quarantine).json()["named"] is False
        bad = c.post("/v1/runs/run-data/quarantine", json={"step": 61, "samples": [{"shard": "", "indices": [1]}]})
        assert bad.status_code == 422 and "shard" in bad.text
        assert c.post("/v1/runs/nope/quarantine", json=quarantine).status_code == 404
        listed = c.get("/v1/runs/run-data/incidents").json()
        IncidentList.model_validate(listed)
        (incident,) = listed["incidents"]
        events = c.get("/v1/runs/run-data/events", params={"limit": 5000}).json()
        wait_until(lambda: any(json.loads(b).get("update") == "quarantined" for _, b in rx.requests))
    expected = {"/data/shards/shard-00001": [3, 7], "/data/shards/shard-00000": [12]}
    assert incident["quarantined"] == expected
    (event,) = [e for e in events if e["kind"] == "incident" and e["data"]["update"] == "quarantined"]
    assert event["data"]["incident"] == incident
    (msg,) = [json.loads(b) for _, b in rx.requests if json.loads(b).get("update") == "quarantined"]
    assert msg["incident"]["quarantined"] == expected and msg["cause"] == "data"
    from trainguard.cli import format_incidents

    text = format_incidents([incident]).splitlines()
    assert "  quarantined in /data/shards/shard-00001: sequences 3, 7" in text
    assert "  quarantined in /data/shards/shard-00000: sequences 12" in text


def test_the_experiment_records_the_sampling_distribution_and_mixed_precision_in_its_outcome() -> None:
    # mixed precision: the loss scale is reported; during the experiment the GradScaler skips 4 steps
    amp = {"trainguard_loss_scale": 1024.0}
    healthy = [_report(i, trainguard_amp_skipped_steps_total=2.0, **amp) for i in range(1, 30)]
    stuck = [_report(i, trainguard_consecutive_skipped_steps=5.0, trainguard_amp_skipped_steps_total=2.0 + 4.0 * (i >= 50),
                     **amp) for i in range(30, 60)]
    _, incidents = _incidents(healthy + stuck)
    (inc,) = incidents
    exp = inc["experiment"]
    assert (exp["from_step"], exp["until_step"], exp["outcome"]) == (45, 55, "not_followed")
    # the data monitor's values against the data rules' limits: only the token KL is reported, in bounds
    sampling = exp["sampling"]
    assert sampling["outcome"] == "in_bounds"
    (kl,) = [c for c in sampling["checks"] if c["rule"] == "data_token_kl"]
    assert kl == {"rule": "data_token_kl", "metric": "trainguard_data_token_kl_divergence", "value": 0.01,
                  "limit": "> 0.1", "out_of_bounds": False}
    assert {c["rule"] for c in sampling["checks"] if c["value"] is None} >= {"data_duplicate_ratio", "data_length_shift"}
    # mixed precision skipped 4 steps between the experiment's start (45) and its end (55): its numerics
    assert exp["amp"] == {"loss_scale": 1024.0, "skipped_steps": 4}
    assert inc["cause"] == "optimizer" and "mixed precision skipped 4 step(s)" in exp["conclusion"]
    # no rank sent a float32 recompute: not measured, and said why
    assert exp["float32_recompute"]["outcome"] == "not_measured" and "verify_step" in exp["float32_recompute"]["why"]


def _experiment_with_float32(measured: list[float]) -> tuple[list, dict]:
    """Two ranks stuck skipping (an unknown cause); the report after the experiment's start (45)
    carries each rank's float32 recompute, every other report NaN (none in its interval)."""
    nan = math.nan
    healthy = [_report(i, world=2, ranks={"verify_float32": [nan, nan]}) for i in range(1, 30)]
    stuck = [_report(i, world=2, trainguard_consecutive_skipped_steps=5.0,
                     ranks={"verify_float32": measured if i == 46 else [nan, nan]}) for i in range(30, 60)]
    states, incidents = _incidents(healthy + stuck, world=2)
    (inc,) = incidents
    return states, inc


def test_the_experiment_asks_for_a_float32_recompute_once_and_a_gradient_it_changes_points_at_the_numerics() -> None:
    states, inc = _experiment_with_float32([0.008, math.inf])  # rank 1's step overflowed under autocast
    exp = inc["experiment"]
    assert (exp["from_step"], exp["outcome"]) == (45, "not_followed")
    # the experiment's rung bumped verify_float32_seq once, at its start, with the LR 10x lower
    bumps = [i + 1 for i, (a, b) in enumerate(zip(states, states[1:])) if b.verify_float32_seq != a.verify_float32_seq]
    assert bumps == [45 - 1] and states[44].verify_float32_seq == 1 and states[-1].verify_float32_seq == 1
    assert exp["float32_recompute"] == {"outcome": "differs", "rel_diff": "Infinity", "limit": "<= 0.1"}
    assert inc["cause"] == "optimizer" and "finite gradient where the mixed-precision one had none" in exp["conclusion"]


def test_a_float32_recompute_within_the_formats_rounding_leaves_the_cause_unknown() -> None:
    _, inc = _experiment_with_float32([0.008, 0.012])  # a healthy bfloat16 step's rounding
    exp = inc["experiment"]
    assert exp["float32_recompute"] == {"outcome": "agrees", "rel_diff": 0.012, "limit": "<= 0.1"}
    assert inc["cause"] == "unknown" and exp["outcome"] == "not_followed"
    _, inc = _experiment_with_float32([0.008, 0.4])
    assert inc["experiment"]["float32_recompute"]["outcome"] == "differs" and inc["cause"] == "optimizer"
    assert "moves its gradient by 0.4 of a layer's norm (limit 0.1)" in inc["experiment"]["conclusion"]


def test_the_experiment_finds_the_sampling_out_of_bounds_and_concludes_data() -> None:
    healthy = [_report(i) for i in range(1, 30)]
    stuck = [_report(i, trainguard_consecutive_skipped_steps=5.0,
                     trainguard_data_token_kl_divergence=0.01 if i < 50 else 0.4) for i in range(30, 56)]
    _, incidents = _incidents(healthy + stuck)
    (inc,) = incidents
    exp = inc["experiment"]
    assert exp["outcome"] == "not_followed" and exp["sampling"]["outcome"] == "out_of_bounds"
    (kl,) = [c for c in exp["sampling"]["checks"] if c["rule"] == "data_token_kl"]
    assert (kl["value"], kl["out_of_bounds"]) == (0.4, True) and inc["cause"] == "data" and "amp" not in exp


def test_a_rolled_back_lr_jump_that_was_over_by_its_report_is_guarded_where_the_restored_schedule_repeats_it() -> None:
    # a report every 5 steps; the schedule went x1000 for a few steps inside the interval ending at 135
    # (the report's own step back on it), the agent skipped 3 steps, the loss stays hurt
    def at(i: int, **over: float) -> Report:
        base = dict(trainguard_scheduler_lr_max=1e-3, trainguard_scheduler_lr_ratio=1.0, trainguard_scheduler_lr_peak=1e-3,
                    trainguard_snapshot_step=100.0 if i >= 100 else 50.0)
        return _report(i, **(base | over))

    healthy = [at(i) for i in range(5, 135, 5)]
    jump = [at(135, trainguard_scheduler_lr_max=1.0, trainguard_scheduler_lr_ratio=1000.0,
               trainguard_consecutive_skipped_steps=3.0, trainguard_loss=5.0)]
    hurt = [at(i, trainguard_loss=5.0, trainguard_scheduler_lr_peak=1.0) for i in (140, 145, 150)]
    after = [at(i, trainguard_scheduler_lr_peak=1.0) for i in range(155, 260, 5)]
    reports = healthy + jump + hurt + after
    states, incidents = _incidents(reports)
    (inc,) = incidents
    assert inc["cause"] == "optimizer"
    # no adaptive LR (the LR is back on the schedule): the rollback, to the snapshot before the jump
    assert [(r["rung"], r["step"]) for r in inc["rungs"] if r["rung"] != "skip"][0] == ("rollback", 150)
    step_of = {r.step_last: s for r, s in zip(reports, states)}
    assert step_of[150].rollback_step == 100
    # the jump came within steps 131-135: the restored scheduler asks for it again 31-35 steps after
    # the snapshot, at steps 181-185 of the run. The rollback's scale (0.5) until the last report at
    # least one interval before 181 (175); from there 1/1000 of it until one report past the one that
    # saw the jump (150 + 35 + 5 = 190); then the rollback's scale again
    assert inc["replay"] == {"kind": "over", "ratio": 1000.0, "from_step": 151, "guard_from": 175, "guarding": 175,
                             "until_step": 190, "lr_scale": pytest.approx(5e-4), "lr_scale_after": 0.5, "released": 195}
    assert [step_of[i].lr_scale for i in (150, 155, 170)] == [0.5] * 3
    assert [step_of[i].lr_scale for i in (175, 180, 190)] == [pytest.approx(5e-4)] * 3
    assert step_of[195].lr_scale == 0.5
    assert inc["outcome"] == "recovered" and states[-1].lr_scale == 1.0  # and back to the schedule by the end


def _over_jump(after: list[Report]) -> tuple[dict[int, object], dict]:
    """A report every 5 steps; the schedule went x1000 for a few steps inside the interval ending
    at 135 (over by that report), the agent skipped 3 steps; then ``after``."""
    healthy = [_jump_at(i) for i in range(5, 135, 5)]
    jump = [_jump_at(135, trainguard_scheduler_lr_max=1.0, trainguard_scheduler_lr_ratio=1000.0,
                     trainguard_consecutive_skipped_steps=3.0, trainguard_loss=5.0)]
    reports = healthy + jump + after
    states, incidents = _incidents(reports)
    return {r.step_last: st for r, st in zip(reports, states)}, incidents[0]


def _jump_at(i: int, **over: float) -> Report:
    base = dict(trainguard_scheduler_lr_max=1e-3, trainguard_scheduler_lr_ratio=1.0, trainguard_scheduler_lr_peak=1e-3,
                trainguard_snapshot_step=100.0 if i >= 100 else 50.0)
    return _report(i, **(base | over))


def test_an_lr_fault_whose_optimizer_state_still_holds_it_is_not_recovered_until_rolled_back() -> None:
    # after the jump the loss is back, but the update per unit of LR is a fifth of its healthy 1.0:
    # Adam's second moment holds the fault's gradients, the run trains at a fifth of its LR
    stalled = [_jump_at(i, trainguard_update_ratio=2e-4, trainguard_scheduler_lr_peak=1.0) for i in range(140, 200, 5)]
    step_of, inc = _over_jump(stalled)
    assert inc["cause"] == "optimizer"
    rungs = [(r["rung"], r["step"]) for r in inc["rungs"] if r["rung"] != "skip"]
    # not closed as recovered on the healthy-looking loss: the window runs out and the ladder rolls back
    assert rungs[0] == ("rollback", 150) and step_of[150].rollback_step == 100
    # the same after-fault reports at the healthy update: recovered with no rollback
    healthy_after = [_jump_at(i, trainguard_scheduler_lr_peak=1.0) for i in range(140, 200, 5)]
    _, inc = _over_jump(healthy_after)
    assert inc["outcome"] == "recovered" and not any(r["rung"] == "rollback" for r in inc["rungs"])


def test_a_high_update_per_lr_under_a_cut_lr_is_not_a_hurt_run() -> None:
    # after the rollback (step 150) and its guard (lr_scale 5e-4 until 190), the update per unit of
    # LR reads 3x its healthy value while the update itself is 1/100 of it (Adam's normalised step
    # at a tiny LR): no further rung, no pause; the incident ends recovered
    hurt = [_jump_at(i, trainguard_loss=5.0, trainguard_scheduler_lr_peak=1.0) for i in (140, 145, 150)]
    frozen = [_jump_at(i, trainguard_update_ratio=1e-5, trainguard_update_ratio_per_lr=3.0, trainguard_scheduler_lr_peak=1.0)
              for i in range(155, 260, 5)]
    step_of, inc = _over_jump(hurt + frozen)
    assert [r["rung"] for r in inc["rungs"] if r["rung"] != "skip"] == ["rollback"]
    assert inc["outcome"] == "recovered" and not any(st.paused for st in step_of.values())


def test_a_rolled_back_lasting_lr_jump_keeps_the_healthy_scale_until_the_restored_schedule_reaches_it() -> None:
    # a report every 5 steps; from step 131 the schedule asks for 10x its LR, for good
    def at(i: int, lr: float = 1e-3, **over: float) -> Report:
        base = dict(trainguard_scheduler_lr=lr, trainguard_scheduler_lr_max=lr, trainguard_update_ratio=lr,
                    trainguard_snapshot_step=100.0 if i >= 100 else 50.0)
        return _report(i, **(base | over))

    healthy = [at(i) for i in range(5, 135, 5)]
    # the jump: gradients past their limit; the loss stays hurt under the cut, so the ladder rolls back
    jump = [at(i, 1e-2, trainguard_grad_norm_max=3000.0, trainguard_loss=5.0) for i in (135, 140, 145, 150)]
    restored = [at(i) for i in range(155, 180, 5)]  # the restored schedule, healthy until it reaches the jump
    again = [at(i, 1e-2) for i in range(180, 200, 5)]
    reports = healthy + jump + restored + again
    states, incidents = _incidents(reports)
    inc = incidents[0]
    assert inc["cause"] == "optimizer"
    step_of = {r.step_last: s for r, s in zip(reports, states)}
    assert step_of[135].lr_scale == pytest.approx(0.1)  # adaptive LR: the schedule's 10x brought back
    (rollback,) = [r for r in inc["rungs"] if r["rung"] == "rollback"]
    assert rollback["step"] == 150 and step_of[150].rollback_step == 100
    # the jump comes again 31 steps after the snapshot (run step 181): the rollback's 0.5 until the
    # last report before it, then the rollback's scale for the jumped schedule (0.1 x 0.5)
    assert inc["replay"] == {"kind": "lasting", "from_step": 151, "until_step": 175, "lr_scale": 0.5,
                             "lr_scale_after": pytest.approx(0.05), "released": 175}
    assert step_of[150].lr_scale == 0.5 and step_of[170].lr_scale == 0.5
    assert step_of[175].lr_scale == pytest.approx(0.05) and step_of[195].lr_scale == pytest.approx(0.05)


def _lasting_jump(loss_after: float, *, snapshots: bool = True) -> tuple[dict[int, object], dict]:
    """A report every 5 steps; from step 131 the schedule asks for 10x its LR for good; adaptive
    LR brings the update back at the report of step 135 and the signals are back from 140 on, with
    the loss at ``loss_after`` (healthy: 2.0 +- 0.2, so that 2.6 is no loss spike)."""
    def at(i: int, lr: float = 1e-3, **over: float) -> Report:
        base = dict(trainguard_scheduler_lr=lr, trainguard_scheduler_lr_max=lr, trainguard_update_ratio=lr,
                    trainguard_loss=2.0 + 0.2 * math.sin(i))
        if snapshots:
            base["trainguard_snapshot_step"] = 100.0 if i >= 100 else 50.0
        return _report(i, **(base | over))

    healthy = [at(i) for i in range(5, 135, 5)]
    jump = [at(135, 1e-2, trainguard_grad_norm_max=3000.0, trainguard_loss=5.0)]
    back = [at(i, 1e-2, trainguard_update_ratio=1e-3, trainguard_update_ratio_per_lr=1.0,
               trainguard_loss=loss_after + 0.2 * math.sin(i)) for i in range(140, 260, 5)]
    reports = healthy + jump + back
    states, incidents = _incidents(reports)
    return {r.step_last: s for r, s in zip(reports, states)}, incidents[0]


def test_an_lr_fault_whose_signals_are_back_but_not_its_loss_is_rolled_back_to_the_snapshot_before_it() -> None:
    # 1.3x the healthy loss with the update back at its healthy level: the faulty steps moved the weights
    step_of, inc = _lasting_jump(2.6)
    assert inc["cause"] == "optimizer" and step_of[135].lr_scale == pytest.approx(0.1)
    (rollback,) = [r for r in inc["rungs"] if r["rung"] == "rollback"]
    # five reports with the signals back (140-160) show the loss still hurt; from there the rung's
    # window of 3 reports runs (160, 165, 170)
    assert rollback["step"] == 170 and step_of[170].rollback_step == 100
    assert inc["outcome"] == "recovered" and not any(st.paused for st in step_of.values())
    # the same at the healthy loss (within 1.1x): recovered with adaptive LR alone, no rollback
    step_of, inc = _lasting_jump(2.1)
    assert [r["rung"] for r in inc["rungs"] if r["rung"] != "skip"] == ["adaptive_lr"]
    assert inc["outcome"] == "recovered" and step_of[255].rollback_seq == 0


def test_a_loss_still_hurt_without_a_snapshot_to_roll_back_to_takes_no_rung_and_never_pauses() -> None:
    step_of, inc = _lasting_jump(2.6, snapshots=False)
    assert [r["rung"] for r in inc["rungs"] if r["rung"] != "skip"] == ["adaptive_lr"]
    assert inc["outcome"] == "recovered" and not any(st.paused for st in step_of.values())


def _warm_restart(after: int = 12, **restart: float) -> list[Report]:
    """A cosine cycle decaying from 1e-3 to 1e-5 with a steady loss, then the schedule's warm
    restart to 1e-3: the agent skips 8 steps, and for ``after`` reports the loss, the gradient
    norm and the update per unit of LR stay far above where the cycle ended (a run trained close
    to zero loss, thrown out of its minimum by the restart)."""
    decay = [_report(i, trainguard_scheduler_lr=1e-3 * 0.99 ** (i * 3) + 1e-5,
                     trainguard_update_ratio=1e-3 * 0.99 ** (i * 3) + 1e-5) for i in range(1, 151)]
    over = {"trainguard_loss": 2.6, "trainguard_grad_norm_max": 40.0, "trainguard_update_ratio": 3e-2, **restart}
    jump = [_report(151, trainguard_scheduler_lr=1e-3, trainguard_consecutive_skipped_steps=8.0, **over)]
    return decay + jump + [_report(i, trainguard_scheduler_lr=1e-3, **over) for i in range(152, 152 + after)]


def test_a_warm_restart_whose_steps_the_agent_skips_opens_no_incident_and_takes_no_rung() -> None:
    states, incidents = _incidents(_warm_restart())
    assert incidents == []  # the schedule's own move: no incident, not even on the agent's skips
    assert all(s.generation == 0 and s.lr_scale == 1.0 and not s.paused for s in states)


def test_a_non_finite_loss_after_a_warm_restart_is_the_optimizers() -> None:
    states, incidents = _incidents(_warm_restart(after=4, trainguard_loss=math.nan))
    (inc,) = incidents
    assert inc["cause"] == "optimizer" and inc["onset_step"] == 151
    (nf,) = [e for e in inc["verdict"]["evidence"] if e["signal"] == "nonfinite"]
    assert nf["points_to"] == "optimizer" and "loss_nonfinite" in nf["value"]
    lr = [e for e in inc["verdict"]["evidence"] if e["signal"] == "trainguard_scheduler_lr"]
    assert lr[0]["points_to"] == "schedule"  # within the schedule's range, but not the schedule's to explain
    assert {r["rung"] for r in inc["rungs"]} >= {"skip", "adaptive_lr"}  # the rules' LR cut is no longer refused
    assert states[-1].lr_scale < 1.0


def _gradient_jump(after: list[float]) -> tuple[list, list[dict]]:
    """40 healthy reports, then the gradient norm 6x (the update ratio 2.5x: the step a jumped
    gradient gives through Adam's momentum), then the gradient norms of ``after``."""
    healthy = [_report(i) for i in range(1, 41)]
    jump = [_report(41, trainguard_grad_norm_max=6.0, trainguard_update_ratio=2.5e-3)]
    rest = [_report(42 + k, trainguard_grad_norm_max=g, trainguard_update_ratio=1e-3 * min(g, 2.5)) for k, g in enumerate(after)]
    return _incidents(healthy + jump + rest)


def test_one_jumped_gradient_whose_step_moved_twice_as_far_is_one_batch_not_the_lr() -> None:
    # The gradient norm 6x its neighbours' for one report, the update ratio 2.5x with it, then
    # both back: one batch stood out; no LR cut.
    states, (inc,) = _gradient_jump([1.0] * 10)
    assert inc["cause"] == "data" and inc["outcome"] == "recovered" and inc["rungs"] == []
    (grad,) = [e for e in inc["verdict"]["evidence"] if e["signal"] == "trainguard_grad_norm_max"]
    assert (grad["value"], grad["reference"], grad["points_to"]) == (6.0, 1.0, "data")
    assert all(s.lr_scale == 1.0 and s.generation == 0 for s in states)


def test_a_jumped_gradient_that_stays_up_is_revised_and_the_lr_is_cut() -> None:
    # The same onset, then the gradient norm climbs on (an explosion): the one-batch verdict is
    # revised at the next report and the LR is cut.
    states, (inc,) = _gradient_jump([6.0 * 1.5 ** k for k in range(1, 20)])
    assert inc["verdict"]["revised"]["from"] == "data" and inc["verdict"]["revised"]["step"] == 42
    assert inc["cause"] in ("unknown", "optimizer") and "adaptive_lr" in [r["rung"] for r in inc["rungs"]]
    assert min(s.lr_scale for s in states) < 0.5


def test_a_second_jumped_gradient_after_the_first_came_back_is_another_batch_not_a_rise_that_lasts() -> None:
    # A rare harder source: the onset's batch 6x, the norm back at its level for 3 reports, then a
    # second hard batch 11x while the incident is open. Each stood out alone: the verdict stays data
    # (it was revised to unknown at the second, whose ladder may cut the LR).
    states, (inc,) = _gradient_jump([1.0] * 3 + [11.0] + [1.0] * 10)
    assert inc["cause"] == "data" and "revised" not in inc["verdict"] and inc["outcome"] == "recovered"
    assert all(s.lr_scale == 1.0 and s.generation == 0 for s in states)
    # ... while a norm that never came back within 2x of its level after the onset is revised.
    states, (inc,) = _gradient_jump([2.5] * 3 + [11.0] + [2.5] * 10)
    assert inc["verdict"]["revised"]["from"] == "data" and inc["verdict"]["revised"]["step"] == 45


def test_a_jump_of_the_update_ratio_beyond_what_one_gradient_gives_is_the_optimizers() -> None:
    healthy = [_report(i) for i in range(1, 41)]
    _, (inc,) = _incidents(healthy + [_report(41, trainguard_grad_norm_max=6.0, trainguard_update_ratio=4e-3)])
    assert inc["cause"] == "optimizer"


def _desync_reports(world: int, bad: list[int]) -> list[Report]:
    """Healthy reports of ``world`` ranks, then ranks ``bad`` disagreeing on their gradients and
    parameters (their fingerprints 0.9 and 5e-3 away from the others')."""
    zeros = [0.0] * world
    grad = [0.9 if r in bad else 0.0 for r in range(world)]
    param = [5e-3 if r in bad else 0.0 for r in range(world)]
    healthy = [_report(i, world=world, ranks={"grad_desync": zeros, "param_desync": zeros}) for i in range(1, 20)]
    return healthy + [_report(i, world=world, ranks={"grad_desync": grad, "param_desync": param}) for i in range(20, 26)]


@pytest.mark.parametrize("world, bad", [(3, [0, 2]), (4, [0, 1, 2, 3]), (8, [0, 1, 2, 3, 5])])
def test_a_desync_of_most_ranks_is_a_layout_and_neither_checkpoints_nor_pauses(world: int, bad: list[int]) -> None:
    """Post-local SGD, FSDP1 shards or per-rank expert layers make most ranks disagree: no device is at fault."""
    states, incidents = _incidents(_desync_reports(world, bad), world=world)
    assert incidents == []
    assert all((s.checkpoint_seq, s.paused, s.stop, s.generation) == (0, False, False, 0) for s in states)


@pytest.mark.parametrize("world, bad", [(3, [1]), (8, [2, 6]), (2, [0, 1])])
def test_a_desync_of_a_minority_of_ranks_stays_hardware(world: int, bad: list[int]) -> None:
    states, incidents = _incidents(_desync_reports(world, bad), world=world)
    (inc,) = incidents
    assert inc["cause"] == "hardware" and inc["verdict"]["ranks"] == bad
    assert inc["verdict"]["hosts"] == [f"node-{r}" for r in bad]
    assert [r["rung"] for r in inc["rungs"]] == ["checkpoint", "pause"] and states[-1].paused


def test_the_verdict_on_a_desync_of_most_ranks_says_why_it_is_not_hardware() -> None:
    from trainguard.service.cause import judge
    from trainguard.service.evaluate import evaluate
    from trainguard.service.window import RunWindow

    window = RunWindow(capacity=128, rank_capacity=8, world_size=3, created=0.0)
    for r in _desync_reports(3, [0, 2]):
        window.append(r, r.time)
    verdict = judge(evaluate(RULES.base, window, 25.0), window, hosts={0: "a", 1: "b", 2: "c"})
    assert verdict.cause != "hardware" and verdict.ranks == ()
    layouts = [e for e in verdict.as_dict()["evidence"] if e["signal"] in ("rule:grad_desync", "rule:param_desync")]
    assert [e["points_to"] for e in layouts] == ["none", "none"]
    assert all("2 of 3 ranks" in e["detail"] and "by design" in e["detail"] and "rank_local" in e["detail"] for e in layouts)
