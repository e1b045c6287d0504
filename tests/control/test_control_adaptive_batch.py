"""The adaptive batch size end to end: two real gloo ranks and a real controller (``trainguard
serve``) with the built-in ``batch_grow_low_variance`` rule turned on. The run opts in with its
own accumulation steps (2) and an LR schedule; its low gradient variance makes the controller
raise the steps 1.5x (to 3), every rank applies them at the same agreed step, and from there the
optimizer's LR is the schedule's x sqrt(3 / 2) (the action's LR rule)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import pytest
import yaml

from tests.control.procs import ControllerProcess, Ranks, operator_only_rules

pytestmark = pytest.mark.distributed

WORKER = str(Path(__file__).with_name("adaptive_batch_worker.py"))
GROW = "batch_grow_low_variance"
OWN, LR = 2, 0.05


def _rules(tmp_path: Path) -> Path:
    """The built-in rules without those that set lr_scale on their own (``operator_only_rules``:
    the LR the test checks is the schedule's x the accumulation rule's only), with the grow rule
    on: 2 low reports in a row, once (a cooldown longer than the run)."""
    path = operator_only_rules(tmp_path)
    raw = yaml.safe_load(path.read_text())
    (grow,) = [r for r in raw["rules"] if r["name"] == GROW]
    grow.update(enabled=True, for_reports=2, cooldown_s=86400)
    path.write_text(yaml.safe_dump(raw))
    return path


def test_low_variance_raises_the_steps_on_every_rank_at_one_step_with_the_lr_rule(tmp_path: Path) -> None:
    ctl = ControllerProcess(tmp_path / "trainguard.db", rules=_rules(tmp_path)).start()
    try:
        ranks = Ranks(2, {"scenario": "grow", "run": "grow", "controller": ctl.url, "steps": 400, "own": OWN,
                          "lr": LR, "loss_scale": 1e-3}, tmp_path, worker=WORKER)
        try:
            assert ranks.wait(240) == [0, 0], ranks.output()
        finally:
            ranks.kill()
        desired = httpx.get(f"{ctl.url}/v1/runs/grow/desired", timeout=10).json()
        alerts = [a for a in httpx.get(f"{ctl.url}/v1/alerts", params={"run": "grow"}, timeout=10).json()
                  if a["rule"] == GROW]
    finally:
        ctl.kill()
    grown = math.floor(OWN * 1.5 + 0.5)
    assert (desired["accumulation_steps"], desired["accumulation_lr_rule"]) == (grown, "sqrt") == (3, "sqrt")
    assert desired["reason"].startswith(f"{GROW}: ") and "accumulation steps 2 -> 3" in desired["reason"]
    assert len(alerts) == 1 and alerts[0]["values"]["value"] < 0.1
    logs = [json.loads((tmp_path / f"grow-rank{r}.json").read_text()) for r in range(2)]
    assert logs[0]["steps"] == logs[1]["steps"]  # the same micro-batches and LR at every step, on every rank
    assert logs[0]["history"] == logs[1]["history"]
    (switch,) = [h[1] for h in logs[0]["history"] if h[2] == grown]
    assert switch % 5 == 0  # an agreement step (sync_every=5)
    factor = math.sqrt(grown / OWN)
    for step, micro, scheduled, used in logs[0]["steps"]:
        assert scheduled == pytest.approx(LR / (1.0 + (step - 1) / 1000.0), rel=1e-12), step  # the schedule, by hand
        if step <= switch:  # applied at the end of step `switch`: the next step uses it
            assert (micro, used) == (OWN, pytest.approx(scheduled, rel=1e-12)), step
        else:
            assert micro == grown and used == pytest.approx(scheduled * factor, rel=1e-12), step
