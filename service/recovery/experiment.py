"""The troubleshooting experiment's checks at its end (an incident of unknown cause: the LR 10x
lower, and a step recomputed in float32): the sampling distribution, mixed precision, and the
float32 recompute."""

from __future__ import annotations

import math
from typing import Any

from trainguard.service.recovery.incident import finite_or_text, number

#: The LR factor of the troubleshooting experiment (the guide: lower the LR 10x and watch).
EXPERIMENT_LR_FACTOR = 0.1


def sampling_check(data_checks: list[tuple[str, str | None, str, Any, bool]], values: dict[str, float]) -> dict[str, Any]:
    """The sampling distribution at the end of the experiment: each data-quality rule's value
    (the agent's data monitor) against its threshold."""
    checks = []
    for name, metric, op, limit, active in data_checks:
        v = values.get(metric)  # type: ignore[arg-type]
        checks.append({"rule": name, "metric": metric, "value": None if v is None else finite_or_text(v),
                       "limit": f"{op} {limit}" if limit is not None else None, "out_of_bounds": bool(active)})
    reported = [c for c in checks if c["value"] is not None]
    outcome = ("not_reported" if not reported else
               "out_of_bounds" if any(c["out_of_bounds"] for c in checks) else "in_bounds")
    return {"outcome": outcome, "checks": checks}


def float32_check(rel_diff: Any, limit: float) -> dict[str, Any]:
    """The float32 recompute the experiment asked for on its first step (``verify_float32``):
    the largest relative difference any rank measured between its mixed-precision gradient and
    the same step's in float32, against ``float32_rel_tol`` (``limit``)."""
    rel_diff = number(rel_diff)
    if rel_diff is None:
        return {"outcome": "not_measured", "limit": f"<= {limit:g}",
                "why": "no rank recomputed a step in float32: the run trains without autocast, its loop does not "
                       "call agent.verify_step, or its parameters are sharded"}
    return {"outcome": "agrees" if rel_diff <= limit else "differs", "rel_diff": finite_or_text(rel_diff),
            "limit": f"<= {limit:g}"}


def amp_check(values: dict[str, float], skipped_at_start: float | None) -> dict[str, Any] | None:
    """Mixed precision during the experiment (None: the run reports no loss scale): the
    GradScaler's scale now and the steps it skipped since the experiment began. The float32
    recompute is ``experiment.float32_recompute`` (:func:`float32_check`)."""
    scale = values.get("trainguard_loss_scale")
    if scale is None:
        return None
    now = values.get("trainguard_amp_skipped_steps_total")
    skipped = (int(now - skipped_at_start) if now is not None and skipped_at_start is not None
               and math.isfinite(now) and math.isfinite(skipped_at_start) else None)
    return {"loss_scale": finite_or_text(scale), "skipped_steps": skipped}


def not_followed_conclusion(*, data_active: bool, amp: dict[str, Any] | None, float32: dict[str, Any],
                            float32_rel_tol: float) -> str:
    """The experiment's conclusion when the symptom stayed with the LR 10x lower."""
    amp_skips = amp is not None and (amp.get("skipped_steps") or 0) > 0
    numerics = float32["outcome"] == "differs"
    return ("the symptom stayed with the LR 10x lower: not the LR" +
            ("; the data rules fire: the data" if data_active else
             f"; mixed precision skipped {amp['skipped_steps']} step(s) meanwhile: its numerics"  # type: ignore[index]
             if amp_skips else
             f"; the step recomputed in float32 moves its gradient by {float32['rel_diff']:.3g} of a "
             f"layer's norm (limit {float32_rel_tol:g}): the mixed-precision numerics"
             if numerics and isinstance(float32["rel_diff"], float) else
             "; the step recomputed in float32 has a finite gradient where the mixed-precision one "
             "had none: its numerics" if numerics else "") +
            "; the LR goes back to where it was")
