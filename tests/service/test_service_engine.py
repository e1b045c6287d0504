"""The rules' actions (``service/engine.py`` ``apply_actions``, folding each command's action as the
registry says): a rules file naming ``grad_clip``, ``reset_optimizer``, ``momentum`` or
``weight_decay_scale`` sets the desired state once its rule fires on a report; several actions
of one alert make one generation; actions that change nothing make none."""

from __future__ import annotations

from statistics import median
from typing import Any

import pytest

from trainguard.protocol.commands import GradClipAction, MomentumAction, ResetOptimizerAction, WeightDecayScaleAction
from trainguard.protocol.wire import DesiredState
from trainguard.service.engine import apply_actions
from trainguard.service.rules import RulesError, load_rules
from tests.service.conftest import register


def _rules(actions: str) -> str:
    return ("rules:\n"
            "  - {name: grads_high, kind: threshold, metric: trainguard_grad_norm, op: '>', value: 50,"
            f" severity: warning, actions: {actions}, cooldown_s: 0}}\n")


def _report(c: Any, step: int, grad_norm: float) -> Any:
    body = {"job": "job-a", "step_first": step, "step_last": step, "time": float(step),
            "values": {"trainguard_grad_norm": grad_norm, "trainguard_loss": 2.0}}
    r = c.post("/v1/runs/run-1/reports", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _fire(app_factory: Any, actions: str, healthy: list[float]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The desired state before and after a report that fires ``grads_high`` with ``actions``,
    after ``healthy`` reports of those gradient norms."""
    with app_factory() as c:
        r = c.put("/v1/rules", content=_rules(actions))
        assert r.status_code == 200, r.text
        register(c)
        for step, g in enumerate(healthy, start=1):
            assert _report(c, step, g)["alerts"] == []
        before = c.get("/v1/runs/run-1").json()["desired"]
        answer = _report(c, len(healthy) + 1, 400.0)
        assert answer["alerts"] == ["grads_high"]
        return before, c.get("/v1/runs/run-1").json()["desired"]


def _changed(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in after.items() if before[k] != v and k not in ("generation", "reason")}


def test_grad_clip_without_a_norm_clips_to_a_factor_of_the_healthy_gradient_norm(app_factory) -> None:
    healthy = [1.0, 4.0, 2.0, 3.0, 2.5]
    before, after = _fire(app_factory, "[{type: grad_clip, factor: 1.5}]", healthy)
    expected = 1.5 * median(healthy)
    assert _changed(before, after) == {"grad_clip_norm": expected}
    assert after["generation"] == before["generation"] + 1
    assert f"gradient norm clipped to {expected:.4g} (1.5 x the healthy {median(healthy):.4g})" in after["reason"]


def test_grad_clip_with_a_norm_and_the_other_optimizer_actions_make_one_generation(app_factory) -> None:
    actions = ("[{type: grad_clip, max_norm: 2.0}, {type: reset_optimizer, layers: [encoder.0, head]},"
               " {type: momentum, factor: 0.5}, {type: weight_decay_scale, value: 4.0}]")
    before, after = _fire(app_factory, actions, [1.0, 1.0])
    assert _changed(before, after) == {"grad_clip_norm": 2.0, "reset_optimizer_seq": 1, "reset_optimizer_layers": "encoder.0,head",
                                       "momentum_scale": 0.5, "weight_decay_scale": 4.0}
    assert after["generation"] == before["generation"] + 1
    assert after["reason"].startswith("grads_high: ") and "optimizer state reset for the layers encoder.0,head" in after["reason"]


def test_grad_clip_without_a_healthy_norm_changes_nothing(app_factory) -> None:
    before, after = _fire(app_factory, "[notify, {type: grad_clip}]", [])
    assert after == before  # no healthy report before the incident: nothing to clip to


def test_reset_optimizer_of_every_layer_from_a_rule(app_factory) -> None:
    before, after = _fire(app_factory, "[reset_optimizer]", [1.0])
    assert _changed(before, after) == {"reset_optimizer_seq": 1}
    assert "optimizer state reset for every layer" in after["reason"]


def test_multiplier_actions_clamp_to_their_range_and_a_no_op_makes_no_generation() -> None:
    d = DesiredState(momentum_scale=2.0, weight_decay_scale=0.0)
    new = apply_actions(d, (MomentumAction(factor=4.0, max=3.0),), "r")
    assert new is not None and new.momentum_scale == 3.0 and new.generation == 1
    assert apply_actions(d, (WeightDecayScaleAction(factor=2.0),), "r") is None  # 0 x 2 is still 0
    assert apply_actions(d, (GradClipAction(),), "r") is None  # no context: no healthy norm known
    twice = apply_actions(d, (ResetOptimizerAction(), ResetOptimizerAction(layers=("a",))), "r")
    assert twice is not None and (twice.reset_optimizer_seq, twice.reset_optimizer_layers, twice.generation) == (2, "a", 1)


@pytest.mark.parametrize("action, why", [
    ("{type: grad_clip, max_norm: -1}", "max_norm"),
    ("{type: momentum}", "momentum needs exactly one of 'value' (absolute) or 'factor'"),
    ("{type: reset_optimizer, layers: ['a,b']}", "without commas"),
    ("{type: weight_decay_scale, value: 1000}", "value"),
])
def test_a_bad_optimizer_action_is_refused_with_the_reason(action: str, why: str) -> None:
    with pytest.raises(RulesError) as e:
        load_rules(_rules(f"[{action}]"))
    assert why in str(e.value)
