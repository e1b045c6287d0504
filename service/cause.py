"""The cause of an incident, decided before its first action, with the evidence it used.

Pure: :func:`judge` reads the findings of the report that opens an incident and the run's recent
history, and answers a :class:`Verdict`. Each cause has its own rungs (``recovery.ladders`` of the
rules file, ``service/incidents.py``); an action a rule asks for that does not fit the cause is
refused (:func:`refusal`).

=============  =======================================================================  ==================
cause          evidence                                                                 what is done
=============  =======================================================================  ==================
``hardware``   a rule of diagnosis ``gpu_xid`` (a critical XID on a rank's GPU),        name the rank and
               ``gradient_recompute_mismatch`` (a recompute of a step on the same        host, checkpoint,
               batch, weights and random state that does not give its gradient back),   then pause and page
               ``grad_desync`` / ``param_desync`` (one rank's fingerprints differ)       or stop
``schedule``   the LR the user's scheduler set jumped (x ``lr_jump`` over its healthy    nothing (the alert
               level) but stays within the range it already had in this run            only notifies; no
               (<= ``schedule_peak_margin`` x its highest healthy value): a warm        incident opens, not
               restart, a re-warm after a resume                                        even on the agent's
                                                                                        skips)
``optimizer``  the scheduled LR jumped beyond anything the run had (also when the jump    skip, adaptive LR,
               began and ended inside one report interval: the agent's                  rollback, pause
               ``trainguard_scheduler_lr_ratio`` past the threshold of the rule on it,
               or that rule firing); or the update ratio rose with the LR unchanged
               and clean data; or mixed precision's loss scale collapsed / its
               overflow skips; or a non-finite loss, gradient or optimizer state
               after the schedule raised the LR within its range (the schedule
               explains values that rose with the LR, never a NaN)
``data``       a data-quality rule of the same window fires (duplicates, token KL,       skip the batches'
               special tokens, length shift); or one batch stands out from its           steps on every
               neighbours (its loss, or at most ``SINGLE_BATCH_SKIPS`` steps the agent   rank, never an LR
               skipped) with the LR where it was, the update ratio at most 3x          cut or a pause
``unknown``    none of the above                                                        a bounded
                                                                                        experiment (5.1)
=============  =======================================================================  ==================

The checks are made in that order: hardware evidence wins over everything (a faulty device corrupts the
loss, the gradients and the update ratio alike), then a jump of the scheduled LR (the largest of the
report's interval when the agent sends ``trainguard_scheduler_lr_max``), then data. The verdict is asked for
only on a report that would open an incident (``RunRecovery.consider``): a rule that acts, a health rule,
the agent skipping, or a hardware rule; data rules alone only notify (a planned switch of the data mixture
is not a fault). A recompute that *did* reproduce the step's gradient, and a desync of most of three or more
ranks (a layout: ``service/desync_layout.py``), are evidence against hardware. The range the schedule
already had is the agent's ``trainguard_scheduler_lr_peak`` (every LR it set, and the LR it was built on,
which a warm-up rises to), capped after an LR fault by the range before that fault (``RunRecovery``): a
rollback restores the user's scheduler, so the fault comes again, and its LR is not the schedule's own.

Every evidence entry is ``{"signal", "value", "reference", "points_to", "detail"}``: what was read, its
value, what it was compared with, the cause it points at (``"none"``: found nothing), and a sentence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import median
from typing import Any, Literal

import numpy as np

from trainguard.protocol.commands import REGISTRY
from trainguard.service.desync_layout import layout_desync

__all__ = ["CAUSES", "Cause", "Verdict", "GRAD_CALM", "GRAD_JUMP", "GRAD_NORM", "judge", "refusal", "HARDWARE_DIAGNOSES", "HARDWARE_XIDS", "DATA_DIAGNOSES"]

Cause = Literal["schedule", "optimizer", "data", "hardware", "unknown"]
CAUSES: tuple[Cause, ...] = ("schedule", "optimizer", "data", "hardware", "unknown")

#: Rule diagnoses (``service/diagnosis.py``) whose alerts are hardware evidence, naming ranks.
HARDWARE_DIAGNOSES = frozenset({"gpu_xid", "gradient_recompute_mismatch", "grad_desync", "param_desync"})
#: XID codes of a failing GPU (``service/diagnosis.py``'s gpu_xid entry): 48 double-bit ECC, 64 row
#: remapping failed, 74 NVLink, 79 off the bus, 95 uncontained ECC. Others (13, 31, 43: the
#: application's own kernels; 63, 94: contained by the driver) do not make the node suspect.
HARDWARE_XIDS = frozenset({48, 64, 74, 79, 95})
#: Rule diagnoses whose alerts are data evidence.
DATA_DIAGNOSES = frozenset({"data_quality"})
#: Rule diagnoses of non-finite values: never the schedule's own move.
NONFINITE_DIAGNOSES = frozenset({"loss_nan", "optimizer_state"})
#: Rule diagnoses of mixed-precision trouble (optimizer numerics).
_AMP_DIAGNOSES = frozenset({"amp_loss_scale_collapse", "amp_skips"})

#: The scheduled LR this many times its healthy level is a jump.
LR_JUMP = 2.0
#: A jump that stays within this factor of the highest LR the run had while healthy is the schedule's.
SCHEDULE_PEAK_MARGIN = 1.05
#: The agent's ratio of the interval's largest scheduled LR to the largest of all steps before it.
LR_RATIO = "trainguard_scheduler_lr_ratio"
#: That ratio above this is a jump beyond the schedule's range (the built-in ``scheduler_lr_jump``'s
#: threshold; a rule on the ratio in the rules file gives its own).
LR_RATIO_JUMP = 4.0
#: The relative tolerance of the gradient recompute check (the agent's default ``verify_rel_tol``).
VERIFY_TOL = 1e-5
#: A batch's loss this many robust standard deviations above its neighbours' stands out.
LOSS_Z = 6.0
#: The update ratio above this multiple of its healthy baseline has risen.
UPDATE_RISE = 1.5
#: Steps skipped in a row that can still be one bad batch (more: something lasts).
SINGLE_BATCH_SKIPS = 2
#: One batch's gradient jump: GRAD_NORM >= GRAD_JUMP x the median of its _GRAD_WINDOW neighbours (the built-in
#: grad_norm_spike's window: the median the rule fired on), the report before within GRAD_CALM x.
GRAD_JUMP, GRAD_CALM, GRAD_EXPLAINS, GRAD_NORM, _GRAD_WINDOW = 5.0, 2.0, 3.0, "trainguard_grad_norm_max", 32


@dataclass(frozen=True, slots=True)
class Verdict:
    """The cause of an incident, and why."""

    cause: Cause
    summary: str
    evidence: tuple[dict[str, Any], ...] = ()
    ranks: tuple[int, ...] = ()  # hardware: the suspect ranks (global rank numbers)
    hosts: tuple[str, ...] = ()  # hardware: the nodes of the ranks (else their hosts; from the run's registration), in their order

    def as_dict(self) -> dict[str, Any]:
        return {"cause": self.cause, "summary": self.summary, "evidence": [dict(e) for e in self.evidence],
                "ranks": list(self.ranks), "hosts": list(self.hosts)}


def _num(x: float | None) -> float | str | None:
    if x is None:
        return None
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    return float(x)


def _entry(signal: str, value: Any, reference: Any, points_to: str, detail: str) -> dict[str, Any]:
    return {"signal": signal, "value": value, "reference": reference, "points_to": points_to, "detail": detail}


@dataclass(slots=True)
class _Evidence:
    items: list[dict[str, Any]] = field(default_factory=list)

    def add(self, signal: str, value: Any, reference: Any, points_to: str, detail: str) -> None:
        self.items.append(_entry(signal, value, reference, points_to, detail))

    def pointing(self, cause: str) -> list[dict[str, Any]]:
        return [e for e in self.items if e["points_to"] == cause]


def _ratio_text(x: float | None) -> str:
    return "an LR far above" if x is None or not math.isfinite(x) else f"{x:.3g}x"


def _robust_z(x: float, history: np.ndarray) -> float | None:
    """(x - median) / (1.4826 MAD) of ``history`` (finite values); None with too little history."""
    h = history[np.isfinite(history)]
    if len(h) < 8 or not math.isfinite(x):
        return None
    m = float(np.median(h))
    mad = float(np.median(np.abs(h - m))) * 1.4826
    scale = max(mad, 1e-3 * abs(m), 1e-12)
    return (x - m) / scale


def judge(findings: list[Any], window: Any, *, skipped: int = 0, lr_healthy: list[float] | None = None,
          lr_peak: float | None = None, metric: str = "trainguard_update_ratio", metric_baseline: float | None = None,
          hosts: dict[int, str] | None = None) -> Verdict:
    """The cause of the anomaly the newest report of ``window`` shows. ``findings``: the rules'
    findings on it; ``skipped``: steps the agent skipped since the previous report (its spike
    guard or non-finite gradients); ``lr_healthy``: the scheduled LR of recent healthy reports;
    ``lr_peak``: the highest scheduled LR of a healthy report of this run; ``metric_baseline``: the
    healthy level of ``metric`` (the update ratio); ``hosts``: the node (else the host) of each rank."""
    ev = _Evidence()
    active = [f for f in findings if f.active]
    hosts = hosts or {}
    suspects = _hardware_rules(ev, active)
    suspects += [r for r in _verify_mismatch(ev, window) if r not in suspects]
    if suspects:
        suspects = suspects[:16]
        named = [hosts.get(r, "?") for r in suspects]
        where = ", ".join(f"rank {r} on {h}" for r, h in zip(suspects, named))
        return Verdict("hardware", f"hardware fault suspected: {where}", tuple(ev.items), tuple(suspects), tuple(named))
    ratio_jumped = _lr_ratio(ev, findings, window)
    lr_jumped = _lr_level(ev, window, lr_healthy, lr_peak, ratio_jumped=ratio_jumped)
    # -- data quality of the same window
    data_rules = [f for f in active if getattr(f.rule, "diagnosis", "") in DATA_DIAGNOSES]
    for f in data_rules:
        ev.add(f"rule:{f.rule.name}", f.values.get("value", f.values.get("values")), f.values.get("threshold"), "data",
               f.summary or f.rule.name)
    batch_outlier = _batch_outlier(ev, window, skipped)
    nonfinite = lr_jumped and bool(ev.pointing("schedule")) and _nonfinite(ev, active, window)
    # -- the update ratio
    measured = window.latest(metric)
    rose = False
    if measured is not None and metric_baseline is not None and metric_baseline > 0:
        rel = measured / metric_baseline if math.isfinite(measured) else math.inf
        rose = rel > UPDATE_RISE
        # up by at most GRAD_EXPLAINS x with one batch's gradient jumping alone (its finite loss may stand out
        # too: a batch of a harder source): that gradient through the optimizer's step, not the LR
        loss_out = any(e["signal"] == "trainguard_loss" and isinstance(e["value"], float) for e in ev.pointing("data"))
        if rose and rel <= GRAD_EXPLAINS and (loss_out or not batch_outlier) and _gradient_jump(ev, window):
            rose, batch_outlier = False, True
        ev.add(metric, _num(measured), metric_baseline, "optimizer" if rose else "none",
               f"the update ratio is {rel:.3g}x its healthy level")
    # -- mixed precision
    amp = [f for f in active if getattr(f.rule, "diagnosis", "") in _AMP_DIAGNOSES]
    for f in amp:
        ev.add(f"rule:{f.rule.name}", f.values.get("value"), f.values.get("threshold", f.values.get("limit")), "optimizer",
               f"{f.summary or f.rule.name} (mixed-precision numerics)")
    return _weigh(ev, lr_jumped=lr_jumped, ratio_jumped=ratio_jumped, data_rules=data_rules, amp=amp, rose=rose,
                  batch_outlier=batch_outlier, nonfinite=nonfinite)


def _nonfinite(ev: _Evidence, active: list[Any], window: Any) -> bool:
    """Whether the report holds a non-finite loss, gradient or optimizer state (a rule of those
    diagnoses or of kind ``nonfinite`` firing, or the values themselves): asked when the schedule
    moved the LR within its range, which explains a loss, gradient or update that rose, not a NaN."""
    rules = [f.rule.name for f in active
             if f.rule.kind == "nonfinite" or getattr(f.rule, "diagnosis", "") in NONFINITE_DIAGNOSES]
    values = [m for m in ("trainguard_loss", "trainguard_grad_norm")
              if (v := window.latest(m)) is not None and not math.isfinite(v)]
    if not rules and not values:
        return False
    ev.add("nonfinite", rules or values, None, "optimizer",
           f"non-finite values ({', '.join(rules or values)}) after the schedule raised the LR: the schedule explains a loss "
           "or gradient that rose with it, not a NaN; the run did not take the LR it was scheduled to take")
    return True


def _hardware_rules(ev: _Evidence, active: list[Any]) -> list[int]:
    """The ranks the active hardware rules name (XID codes of a hardware failure, and the other
    hardware diagnoses but a desync of most ranks: a layout), their evidence added to ``ev``."""
    suspects: list[int] = []
    for f in active:
        diag = getattr(f.rule, "diagnosis", "")
        if diag == "gpu_xid":
            codes = {int(r): v for r, v in (f.values.get("values") or {}).items()}
            app = {r: v for r, v in codes.items() if not (isinstance(v, float) and int(v) in HARDWARE_XIDS)}
            if app:  # the application's own kernel faults (13, 31, 43) and contained errors: not the node
                ev.add(f"rule:{f.rule.name}", app, sorted(HARDWARE_XIDS), "none",
                       f"XID codes that are not a hardware failure on ranks {sorted(app)}")
            ranks = sorted(r for r in codes if r not in app)
            if ranks:
                suspects += [r for r in ranks if r not in suspects]
                ev.add(f"rule:{f.rule.name}", {r: codes[r] for r in ranks}, sorted(HARDWARE_XIDS), "hardware",
                       f"hardware XID errors on ranks {ranks}")
        elif diag in HARDWARE_DIAGNOSES:
            ranks, layout = [int(r) for r in f.values.get("ranks", [])], layout_desync(f)
            suspects += [r for r in ranks if r not in suspects and layout is None]
            ev.add(f"rule:{f.rule.name}", f.values.get("values", ranks), f.values.get("limit", f.values.get("rel_tol")),
                   "none" if layout else "hardware", layout or f"{f.summary or diag} (ranks {ranks})")
    return suspects


def _verify_mismatch(ev: _Evidence, window: Any) -> list[int]:
    """The ranks whose recompute of the step on the same batch did not reproduce its gradient."""
    verify = window.rank_history("verify_mismatch", 1)
    if not len(verify):
        return []
    row = verify[-1]
    checked = np.isfinite(row)
    if not checked.any():
        return []
    worst = float(np.max(row[checked]))
    with np.errstate(invalid="ignore"):
        bad = np.flatnonzero(checked & (row > VERIFY_TOL)).tolist()
    if bad:
        if not any(e["signal"].startswith("rule:") and "recompute" in e["detail"] for e in ev.items):
            ev.add("ranks.verify_mismatch", {int(r): _num(float(row[r])) for r in bad}, VERIFY_TOL, "hardware",
                   f"a recompute of the step on the same batch did not reproduce its gradient on ranks {bad}")
    else:
        ev.add("ranks.verify_mismatch", _num(worst), VERIFY_TOL, "none",
               "the recompute of the step reproduced its gradient on every rank checked: not the hardware")
    return bad


def _lr_ratio(ev: _Evidence, findings: list[Any], window: Any) -> bool:
    """Whether the agent's own ratio of the interval's largest scheduled LR to every LR it set
    before is past the rule's threshold: the LR went beyond anything the run had (even when the
    report's own step is back on the schedule, and without a healthy history here, e.g. after a
    restart)."""
    ratio_rules = [f for f in findings if getattr(f.rule, "metric", None) == LR_RATIO]
    limit = next((float(f.rule.value) for f in ratio_rules if isinstance(getattr(f.rule, "value", None), (int, float))),
                 LR_RATIO_JUMP)
    lr_ratio = window.latest(LR_RATIO)
    ratio_fired = [f for f in ratio_rules if f.active]
    if ratio_fired or (lr_ratio is not None and math.isfinite(lr_ratio) and lr_ratio > limit):
        fired = f" (rule {ratio_fired[0].rule.name} fired)" if ratio_fired else ""
        ev.add(LR_RATIO, _num(lr_ratio) if lr_ratio is not None else None, limit, "optimizer",
               f"in the report's interval the schedule asked for {_ratio_text(lr_ratio)} the highest LR it had set "
               f"before (limit {limit:.3g}x){fired}, although the report's own step may be back on the schedule")
        return True
    if lr_ratio is not None and math.isfinite(lr_ratio):
        ev.add(LR_RATIO, float(lr_ratio), limit, "none",
               f"the interval's largest scheduled LR is {lr_ratio:.3g}x the highest before it: within the schedule's range")
    return False


def _lr_level(ev: _Evidence, window: Any, lr_healthy: list[float] | None, lr_peak: float | None, *,
              ratio_jumped: bool) -> bool:
    """Whether the LR jumped (``ratio_jumped``, or the scheduled LR against its healthy level): the
    largest of the report's interval when the agent sends it (a fault of a few steps may be over by
    the report step)."""
    lr = window.latest("trainguard_scheduler_lr")
    interval_max = window.latest("trainguard_scheduler_lr_max")
    if interval_max is not None and math.isfinite(interval_max) and (lr is None or not math.isfinite(lr) or interval_max > lr):
        lr = interval_max
    lr_level = median(lr_healthy) if lr_healthy else None
    if lr is None or not math.isfinite(lr) or lr <= 0 or lr_level is None or lr_level <= 0:
        return ratio_jumped
    ratio = lr / lr_level
    if ratio < LR_JUMP:
        ev.add("trainguard_scheduler_lr", lr, {"healthy": lr_level, "peak": lr_peak}, "none",
               f"the scheduled LR is {ratio:.3g}x its healthy level: unchanged")
        return ratio_jumped
    within = lr_peak is not None and lr <= SCHEDULE_PEAK_MARGIN * lr_peak and not ratio_jumped
    ev.add("trainguard_scheduler_lr", lr, {"healthy": lr_level, "peak": lr_peak},
           "schedule" if within else "optimizer",
           f"the scheduled LR is {ratio:.3g}x its healthy level" +
           (f", within the {lr_peak:.3g} the run already had: the schedule's own move" if within else
            f", above anything the run had ({lr_peak:.3g}): an LR the optimizer has not been stable at"
            if lr_peak is not None else ""))
    return True


def _batch_outlier(ev: _Evidence, window: Any, skipped: int) -> bool:
    """Whether the batch stands out from its neighbours (its loss, or the agent's skips of one batch)."""
    loss_hist = window.series("trainguard_loss", 65)
    batch_outlier = False
    if len(loss_hist) >= 9:
        z = _robust_z(float(loss_hist[-1]), np.asarray(loss_hist[:-1], dtype=np.float64))
        if z is not None and z >= LOSS_Z:
            batch_outlier = True
            ev.add("trainguard_loss", float(loss_hist[-1]), float(np.median(loss_hist[:-1])), "data",
                   f"the batch's loss is {z:.3g} robust standard deviations above its neighbours'")
        elif not math.isfinite(float(loss_hist[-1])):
            batch_outlier = True
            ev.add("trainguard_loss", _num(float(loss_hist[-1])), None, "data", "the batch's loss is not finite")
    if 0 < skipped <= SINGLE_BATCH_SKIPS:
        ev.add("trainguard_consecutive_skipped_steps", skipped, SINGLE_BATCH_SKIPS, "data",
               f"the agent skipped {skipped} step(s) whose gradient stood out from its neighbours'")
        batch_outlier = True
    elif skipped:
        ev.add("trainguard_consecutive_skipped_steps", skipped, SINGLE_BATCH_SKIPS, "unknown",
               f"the agent skipped {skipped} steps in a row: more than one batch stands out")
    return batch_outlier


def _gradient_jump(ev: _Evidence, window: Any) -> bool:
    """Whether the newest gradient norm jumped alone (GRAD_JUMP; Adam's momentum takes a tenth of it: a healthy
    run's step went 2x as far on a gradient 5x its neighbours')."""
    hist = (h := window.series(GRAD_NORM, _GRAD_WINDOW + 1))[np.isfinite(h)]
    base, latest, before = (float(np.median(hist[:-1])), float(hist[-1]), float(hist[-2])) if len(hist) >= 10 else (0, 0, 0)
    if not (base > 0 and latest >= GRAD_JUMP * base and before <= GRAD_CALM * base):
        return False
    ev.add(GRAD_NORM, latest, base, "data",
           f"the batch's gradient norm is {latest / base:.3g}x its neighbours' median, the report before at its level: "
           "the update ratio rose with this one gradient")
    return True


def _weigh(ev: _Evidence, *, lr_jumped: bool, ratio_jumped: bool, data_rules: list[Any], amp: list[Any], rose: bool,
           batch_outlier: bool, nonfinite: bool) -> Verdict:
    """The verdict the evidence (no hardware fault among it) adds up to."""
    sched = ev.pointing("schedule")
    if lr_jumped and sched and not data_rules and not amp:
        if nonfinite:
            return Verdict("optimizer", "the run turned non-finite after its schedule raised the LR within the range it "
                           "already had: more LR than the run can take now", tuple(ev.items))
        return Verdict("schedule", "the user's LR schedule moved the LR within the range the run already had",
                       tuple(ev.items))
    if lr_jumped and not sched:
        return Verdict("optimizer", "the scheduled LR jumped beyond anything the run was stable at" +
                       (" (within the report's interval)" if ratio_jumped else ""), tuple(ev.items))
    if data_rules:
        names = ", ".join(f.rule.name for f in data_rules)
        return Verdict("data", f"the data of this window is out of bounds ({names})", tuple(ev.items))
    if amp:
        return Verdict("optimizer", "mixed precision's loss scaling is failing", tuple(ev.items))
    if rose:
        return Verdict("optimizer", "the update ratio rose with the LR and the data unchanged", tuple(ev.items))
    if batch_outlier and not ev.pointing("unknown"):
        return Verdict("data", "one batch stands out from its neighbours with the LR unchanged",
                       tuple(ev.items))
    return Verdict("unknown", "no evidence points at one cause", tuple(ev.items))


#: The optimizer remedies of the registry (``grad_clip``, ``reset_optimizer``): for an optimizer fault only.
_REMEDIES = frozenset(c.name for c in REGISTRY if c.remedy)
#: Actions (rule action types) each cause refuses: data is never met with an LR cut, a pause or
#: an optimizer remedy, hardware not with the LR or the optimizer, the schedule with nothing at all.
_REFUSED: dict[str, frozenset[str]] = {
    "data": frozenset({"lr_scale", "adaptive_lr", "pause"}) | _REMEDIES,
    "hardware": frozenset({"lr_scale", "adaptive_lr", "rollback"}) | _REMEDIES,
    "schedule": frozenset({"lr_scale", "adaptive_lr", "rollback", "pause"}) | _REMEDIES,
}


def refusal(cause: str | None, action: Any) -> str | None:
    """Why a rule's ``action`` does not fit ``cause`` (None: it does). An ``lr_scale`` that raises
    the LR is never refused."""
    if cause is None or action.type not in _REFUSED.get(cause, ()):
        return None
    if action.type == "lr_scale" and ((action.factor is not None and action.factor >= 1.0)
                                       or (action.value is not None and action.value >= 1.0)):
        return None
    return f"{action.type} refused: the cause is {cause}"
