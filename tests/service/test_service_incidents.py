"""A run's incidents survive a controller restart: read back from their audit events, the open
one resumes its escalation ladder, and new incidents are numbered after the old ones."""

from __future__ import annotations

from statistics import median
from typing import Callable

import pytest

from trainguard.service.rules import RulesError, load_rules
from tests.service.conftest import LADDER_STEPS, climb_ladder, register


def test_incidents_are_read_back_after_a_restart_and_the_open_one_climbs_on(app_factory) -> None:
    with app_factory() as c:
        register(c, "run-1")
        climb_ladder(c, "run-1", until=LADDER_STEPS["rollback"])  # opened, adaptive LR, rolled back: still open
        before = c.get("/v1/runs/run-1/incidents").json()["incidents"]
    (incident,) = before
    assert incident["outcome"] == "open"
    assert [r["rung"] for r in incident["rungs"]] == ["adaptive_lr", "rollback"]

    with app_factory() as c:  # a new controller on the same database
        assert c.get("/v1/runs/run-1/incidents").json()["incidents"] == before
        # the signals stay bad: the restored incident takes its next rung after a full window
        climb_ladder(c, "run-1", after=LADDER_STEPS["rollback"])
        (after,) = c.get("/v1/runs/run-1/incidents").json()["incidents"]
        assert after["id"] == incident["id"] and after["outcome"] == "escalated"
        assert after["rungs"][:2] == incident["rungs"]
        assert [r["rung"] for r in after["rungs"]] == ["adaptive_lr", "rollback", "pause"]
        assert after["rungs"][2]["step"] == LADDER_STEPS["pause"]
        assert c.get("/v1/runs/run-1/desired").json()["paused"] is True
        # a new run's first incident is numbered after the ones recorded before the restart
        register(c, "run-2")
        climb_ladder(c, "run-2", until=LADDER_STEPS["adaptive_lr"])
        (second,) = c.get("/v1/runs/run-2/incidents").json()["incidents"]
        assert second["id"] > incident["id"]

    with app_factory() as c:  # and again: the closed incident reads back closed, nothing is open
        assert c.get("/v1/runs/run-1/incidents").json()["incidents"] == [after]
        assert c.get("/v1/runs/run-2/incidents").json()["incidents"] == [second]


def _ladder_rules(optimizer: list[str]) -> str:
    import yaml

    from trainguard.service.rules import default_rules_text

    data = yaml.safe_load(default_rules_text())
    data["recovery"].setdefault("ladders", {})["optimizer"] = optimizer
    return yaml.safe_dump(data)


def _optimizer_fault(c, grad_norm: Callable[[int], float], until: int) -> None:
    """Healthy reports at steps 1-39, then from step 40 the scheduled LR 10x above anything the run
    had (the update ratio following it, the gradients past the default rule's limit): an
    incident of optimizer cause whose signals do not come back."""
    for i in range(1, until + 1):
        jump = i >= 40
        values = {"trainguard_loss": 2.0, "trainguard_scheduler_lr": 1e-2 if jump else 1e-3,
                  "trainguard_update_ratio": 1e-2 if jump else 1e-3, "trainguard_update_ratio_per_lr": 1.0,
                  "trainguard_grad_norm_max": 3000.0 if jump else 1.0, "trainguard_grad_norm": grad_norm(i)}
        r = c.post("/v1/runs/run-1/reports", json={"job": "job-a", "step_first": i, "step_last": i, "time": float(i),
                                                     "values": values})
        assert r.status_code == 200, r.text


def test_an_optimizer_ladder_may_clip_the_gradients_to_their_healthy_norm(app_factory) -> None:
    """With ``ladders.optimizer: [skip, grad_clip, rollback, pause]`` an optimizer fault's next
    rung after the rule's adaptive LR clips every rank's gradient norm to the median of its
    healthy reports before the onset (the adaptive LR's baseline: the last 16)."""
    def grad_norm(i: int) -> float:
        return 1.0 + 0.25 * (i % 5) + (50.0 if i >= 40 else 0.0)

    with app_factory() as c:
        assert c.put("/v1/rules", content=_ladder_rules(["skip", "grad_clip", "rollback", "pause"])).status_code == 200
        register(c)
        _optimizer_fault(c, grad_norm, until=60)
        (incident,) = c.get("/v1/runs/run-1/incidents").json()["incidents"]
        desired = c.get("/v1/runs/run-1").json()["desired"]
    assert incident["cause"] == "optimizer" and incident["onset_step"] == 40
    assert [r["rung"] for r in incident["rungs"]][:2] == ["adaptive_lr", "grad_clip"]
    expected = median(grad_norm(i) for i in range(24, 40))  # the 16 healthy reports before the onset
    assert desired["grad_clip_norm"] == expected and expected == 1.5
    clip = incident["rungs"][1]
    assert clip["actor"] == "recovery:ladder" and f"gradient norm clipped to {expected:.4g}" in clip["reason"]


def test_the_default_ladders_never_clip_or_reset_the_optimizer(app_factory) -> None:
    with app_factory() as c:
        register(c)
        _optimizer_fault(c, lambda i: 1.0, until=80)
        (incident,) = c.get("/v1/runs/run-1/incidents").json()["incidents"]
        desired = c.get("/v1/runs/run-1").json()["desired"]
    # (no snapshot to roll back to: the rollback rung pauses the run for a human)
    assert [r["rung"] for r in incident["rungs"]] == ["adaptive_lr", "rollback"] and incident["outcome"] == "escalated"
    assert desired["paused"] is True and (desired["grad_clip_norm"], desired["reset_optimizer_seq"]) == (0.0, 0)


@pytest.mark.parametrize("cause", ["data", "hardware"])
def test_data_and_hardware_ladders_refuse_the_optimizer_remedies(cause: str) -> None:
    import yaml

    for remedy in ("grad_clip", "reset_optimizer"):
        with pytest.raises(RulesError) as e:
            load_rules(yaml.safe_dump({"recovery": {"ladders": {cause: ["checkpoint", remedy]}}, "rules": []}))
        assert f"ladders.{cause}: {remedy} does not fit a fault of that cause" in str(e.value)
    policy = load_rules(yaml.safe_dump({"recovery": {"ladders": {"optimizer": ["grad_clip", "reset_optimizer"]}},
                                        "rules": []})).file.recovery
    assert policy.optimizer_ladder == ("grad_clip", "reset_optimizer")
