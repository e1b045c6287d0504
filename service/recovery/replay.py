"""The replay guard of a rolled-back LR jump of the user's schedule: the restored scheduler asks
for the jump again at the same point of its schedule (``Incident.replay``)."""

from __future__ import annotations

import math
from typing import Any

from trainguard.protocol.wire import LR_SCALE_MAX, LR_SCALE_MIN, DesiredState
from trainguard.service.adaptive_lr import ScheduleBaseline
from trainguard.service.cause import LR_RATIO, SCHEDULE_PEAK_MARGIN
from trainguard.service.recovery.incident import Incident, RecoveryChange

#: Evidence signals of an LR beyond the schedule's range (``service/cause.py``).
LR_SIGNALS = frozenset({"trainguard_scheduler_lr", "trainguard_scheduler_lr_ratio"})


def _interval(step: int, last_step: int | None) -> int:
    """The steps between the last report and this one (1 without a last one)."""
    return step - last_step if last_step is not None and last_step < step else 1


def _change(desired: DesiredState, scale: float, reason: str) -> RecoveryChange:
    return RecoveryChange(desired.model_copy(update={"generation": desired.generation + 1, "lr_scale": scale,
                                                     "reason": reason[:2000]}), "recovery:ladder")


def lr_jump_over(inc: Incident | None, values: dict[str, float], lr: float | None, fault_peak: float | None) -> float | None:
    """The ratio of an LR jump that opened this optimizer incident and was over by its report
    (the verdict's ``trainguard_scheduler_lr_ratio`` evidence), the schedule back within the
    range it had before the jump now; None otherwise."""
    if inc is None or inc.cause != "optimizer":
        return None
    ratio = next((e["value"] for e in inc.verdict.get("evidence", []) if e["signal"] == LR_RATIO
                  and e["points_to"] == "optimizer" and isinstance(e["value"], (int, float))), None)
    if ratio is None or not ratio > 1:
        return None
    now = values.get(LR_RATIO)
    if now is not None and math.isfinite(now) and now > SCHEDULE_PEAK_MARGIN:
        return None  # the schedule is jumping now
    if lr is not None and fault_peak is not None and lr > SCHEDULE_PEAK_MARGIN * fault_peak:
        return None  # the jump lasts: adaptive LR's
    return float(ratio)


def lr_jump_lasts(inc: Incident | None, lr: float | None, fault_peak: float | None) -> bool:
    """This optimizer incident opened on the scheduled LR beyond the schedule's range, and it
    still is (a lasting fault of the user's schedule)."""
    if inc is None or inc.cause != "optimizer" or fault_peak is None or lr is None:
        return False
    return lr > SCHEDULE_PEAK_MARGIN * fault_peak and any(
        e["signal"] in LR_SIGNALS and e["points_to"] == "optimizer" for e in inc.verdict.get("evidence", []))


def guard_replay(inc: Incident, step: int, last_step: int | None, ratio: float, new: DesiredState) -> DesiredState:
    """A rollback over an LR jump that is over: the restored scheduler will ask for the jump
    again at the same point of its schedule, so around that point the rollback's scale is
    1/``ratio`` of the usual: from the last report at least one interval before the restored
    run reaches the jump's first possible step (the incident's onset) until one interval past
    the report that saw it. Before that, the rollback's scale: the restored schedule is the
    healthy one (guarded from the rollback on, 5 steps at x200 cost a run 68 steps at 1/400 of
    its LR)."""
    seen = int(inc.rungs[0]["step"]) if inc.rungs else inc.onset_step
    interval = _interval(step, last_step)
    until = step + max(seen - new.rollback_step, 0) + interval
    guard_from = step + (inc.onset_step - new.rollback_step) - interval - 1
    after = new.lr_scale
    guard = max(after / ratio, LR_SCALE_MIN)
    guarding = step if guard_from <= step else None
    inc.replay = {"kind": "over", "ratio": ratio, "from_step": step + 1, "guard_from": max(guard_from, step),
                  "guarding": guarding, "until_step": until, "lr_scale": guard, "lr_scale_after": after,
                  "released": None}
    if guarding is None:
        reason = (f"{new.reason}; then lr_scale {guard:.4g} (1/{ratio:.4g} of {after:.4g}) from the report at step "
                  f"{guard_from} to step {until}, where the restored schedule asks for the LR jump again")
        return new.model_copy(update={"reason": reason[:2000]})
    reason = (f"{new.reason}; lr_scale {guard:.4g} (1/{ratio:.4g} of {after:.4g}) until step {until}: the restored "
              f"schedule asks for the LR jump again")
    return new.model_copy(update={"lr_scale": guard, "reason": reason[:2000]})


def before_replay(inc: Incident, step: int, last_step: int | None, new: DesiredState, before: float) -> DesiredState:
    """A rollback over a lasting LR jump: the rollback's scale is meant for the jumped schedule,
    but the restored one is healthy until it reaches the jump again. Until the last report
    before that point, ``before`` (the rollback's factor of the ceiling); then the rollback's scale."""
    until = step + (inc.onset_step - new.rollback_step) - _interval(step, last_step) - 1
    if until <= step or before <= new.lr_scale:
        return new
    inc.replay = {"kind": "lasting", "from_step": step + 1, "until_step": until, "lr_scale": before,
                  "lr_scale_after": new.lr_scale, "released": None}
    reason = (f"{new.reason}; lr_scale {before:.4g} until step {until} (the restored schedule is the healthy one "
              f"until it reaches the LR jump again), then {new.lr_scale:.4g}")
    return new.model_copy(update={"lr_scale": before, "reason": reason[:2000]})


def guard_due(replay: dict[str, Any] | None, step: int) -> bool:
    """The restored run of an ``over`` replay reaches the report its guard begins at."""
    return (replay is not None and replay.get("released") is None and replay["kind"] == "over"
            and replay.get("guarding", step) is None and step >= replay["guard_from"])


def release_due(replay: dict[str, Any] | None, step: int) -> bool:
    """The restored run is past the LR jump (``until_step``)."""
    return replay is not None and replay.get("released") is None and (
        step > replay["until_step"] or (replay["kind"] == "lasting" and step >= replay["until_step"]))


def guard_replayed_jump(inc: Incident, step: int, desired: DesiredState, why: str) -> RecoveryChange:
    """The restored run nears the step of the LR jump: 1/``ratio`` of the rollback's scale until
    it is past it."""
    assert inc.replay is not None
    replay = inc.replay = dict(inc.replay, guarding=step)
    scale = min(replay["lr_scale"], desired.lr_scale)
    return _change(desired, scale, f"{why}: the restored schedule nears the LR jump (x{replay['ratio']:.4g}): lr_scale "
                                   f"{scale:.4g} until step {replay['until_step']}")


def release_replay(inc: Incident, step: int, values: dict[str, float], desired: DesiredState, why: str, *,
                   schedule: ScheduleBaseline, ceiling: float) -> RecoveryChange | None:
    """The restored run is past the LR jump: the scale the rollback meant (``lr_scale_after``),
    lower if the schedule's terms still need it (``ScheduleBaseline.needed``)."""
    assert inc.replay is not None
    replay = inc.replay = dict(inc.replay, released=step)
    if replay["kind"] == "lasting":
        scale = replay["lr_scale_after"]
        if scale == desired.lr_scale:
            return None
        return _change(desired, scale, f"{why}: the restored schedule reaches the LR jump again: lr_scale {scale:.4g}")
    needed, note = schedule.needed(values)
    scale = replay["lr_scale_after"] if needed is None else min(replay["lr_scale_after"], needed * ceiling)
    scale = min(max(scale, LR_SCALE_MIN), LR_SCALE_MAX)
    if scale <= desired.lr_scale:
        return None
    return _change(desired, scale, f"{why}: the restored schedule is past the LR jump: lr_scale {scale:.4g} ({note})")
