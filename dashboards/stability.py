"""Dashboard 1, training stability: is the optimisation healthy right now, and what did the
controller do about it? Loss, gradient norm (global and the largest layers), update ratio against
its healthy band, parameter norm and scale, learning rates, lr_scale, AMP loss scale and skipped
steps, non-finite counts, gradient noise scale, paused state and the controller's incidents.
"""

from __future__ import annotations

from grafanalib.core import Dashboard

from trainguard.dashboards.common import (
    JOB_RUN,
    SEL,
    Band,
    Section,
    dashboard,
    job_level,
    query,
    right_axis,
    stat,
    state_timeline,
    timeseries,
)
from trainguard.dashboards.thresholds import GRAD_NORM_LIMIT

UID = "trainguard-stability"
TITLE = "trainguard / Training stability"

#: The update ratio's healthy band (DESIGN.md; the stability guide, 6.1): about 1e-4 to 1e-2.
UPDATE_RATIO_BAND = (1e-4, 1e-2)
TOP_LAYERS = 5
#: The newest step of each selected run (any rank): present while the run's ranks are scraped.
RUN_STEP = f"max by (run) (trainguard_step{{{JOB_RUN}}})"


def _overview() -> Section:
    return Section("Overview", [
        stat("Step", "Optimizer steps completed (trainguard_step) per rank.",
             [query(f"trainguard_step{{{SEL}}}", "rank {{rank}} ({{run}})")], width=6),
        stat("Last loss", "Last loss per rank (NaN/Inf shown as is).",
             [query(f"trainguard_loss{{{SEL}}}", "rank {{rank}} ({{run}})")], width=6),
        stat("Current lr_scale", "Multiplier the controller applies to the scheduler's LR.",
             [query(job_level("trainguard_lr_scale"), "{{run}}")], width=6),
        stat("Applied generation", "Generation of the controller's desired state the run applied "
             "(every rank at the same step); it changes with every pause, resume, lr_scale, "
             "checkpoint or stop.",
             [query(job_level("trainguard_applied_generation"), "{{run}}")], width=6),
    ])


def _gradients() -> Section:
    return Section("Loss and gradients", [
        timeseries("Loss", "Loss passed to end_step, per rank.",
                   [query(f"trainguard_loss{{{SEL}}}", "rank {{rank}} ({{run}})")]),
        timeseries(
            "Gradient norm (global, before clipping)",
            f"Global L2 norm of the gradients before clipping at the last reported step, and the "
            f"largest over the steps since the previous report (what the rules read: a spike "
            f"between two reports is not missed). The red line is the limit "
            f"({GRAD_NORM_LIMIT:g}) above which gradients usually precede divergence; the controller's default rules lower the LR above it and on "
            f"spikes.",
            [query(job_level("trainguard_grad_norm"), "{{run}}"),
             query(job_level("trainguard_grad_norm_max"), "{{run}}, max since last report")],
            log=True, band=Band(((GRAD_NORM_LIMIT, "red"),)),
        ),
        timeseries(
            f"Gradient norm, top {TOP_LAYERS} layers",
            "L2 norm of the gradients of the layers with the largest norms (exported by rank 0 "
            "by default). A single layer running away is the usual first sign of a blow-up.",
            [query(f"topk by (job, run) ({TOP_LAYERS}, {job_level('trainguard_layer_grad_norm', by='layer')})",
                   "{{layer}} ({{run}})")],
            log=True,
        ),
        timeseries(
            "Non-finite values",
            "Non-finite gradient elements at the last step, non-finite optimizer-state elements "
            "(e.g. Adam moments, which overflow first under fp16), and steps with a non-finite "
            "loss or gradient / steps skipped by the local guard in each interval.",
            [
                query(job_level("trainguard_nonfinite_grads"), "grad elements ({{run}})"),
                query(job_level("trainguard_optimizer_state_nonfinite"), "optimizer-state elements ({{run}})"),
                query(f"increase(trainguard_nonfinite_steps_total{{{SEL}}}[$__rate_interval])",
                      "non-finite steps, rank {{rank}} ({{run}})"),
                query(job_level("trainguard_skipped_steps_total", by="reason", fn="increase"),
                      "skipped: {{reason}} ({{run}})"),
            ],
            draw="bars",
        ),
    ])


def _updates() -> Section:
    low, high = UPDATE_RATIO_BAND
    return Section("Updates and parameters", [
        timeseries(
            "Update ratio ||ΔW|| / ||W||",
            f"Relative size of the last update, global and for the {TOP_LAYERS} layers with the "
            f"largest ratio. The shaded band {low:g}..{high:g} is the healthy range: below it the "
            f"model barely learns (LR too small), above it the step is too large.",
            [
                query(job_level("trainguard_update_ratio"), "global ({{run}})"),
                query(f"topk by (job, run) ({TOP_LAYERS}, {job_level('trainguard_layer_update_ratio', by='layer')})",
                      "{{layer}} ({{run}})"),
            ],
            log=True,
            band=Band(((low, "green"), (high, "transparent")), style="line+area"),
        ),
        timeseries("Parameter norm", "Global L2 norm of the trainable parameters after the step.",
                   [query(job_level("trainguard_param_norm"), "{{run}}")]),
        timeseries("Parameter scale (RMS)", "Root mean square of the trainable parameters "
                   "||W|| / sqrt(n): comparable across model sizes; steady growth means weight "
                   "decay is not keeping up.",
                   [query(job_level("trainguard_param_scale"), "{{run}}")]),
        timeseries(
            "Gradient noise scale",
            "B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018) from the micro-batch or "
            "per-rank gradient norms (left), and tr(Sigma) itself (right). The batch size at "
            "which training stops gaining from larger batches is about B_simple.",
            [
                query(job_level("trainguard_grad_noise_scale"), "noise scale ({{run}})"),
                query(job_level("trainguard_grad_variance"), "tr(Sigma) ({{run}})"),
            ],
            log=True,
            overrides=[right_axis("tr\\(Sigma\\).*")],
        ),
    ])


def _lr() -> Section:
    return Section("Learning rate and control", [
        timeseries(
            "Learning rate per group and effective LR",
            "LR actually used per param group (scheduler LR x lr_scale) and the effective LR "
            "||ΔW|| / ||g||: how far a step moved per unit gradient (equal to the LR for plain "
            "SGD; adaptive optimizers move it).",
            [
                query(job_level("trainguard_learning_rate", by="group"), "group {{group}} ({{run}})"),
                query(job_level("trainguard_effective_lr"), "effective ({{run}})"),
            ],
            log=True,
        ),
        timeseries("lr_scale", "Multiplier the controller applies to the scheduler's LR "
                   "(1 = untouched; the default rules halve it on a gradient spike).",
                   [query(job_level("trainguard_lr_scale"), "{{run}}")],
                   interpolation="stepAfter"),
        timeseries(
            "AMP loss scale and skipped steps",
            "GradScaler loss scale (left, log) and optimizer steps the scaler skipped because "
            "of inf/NaN gradients in each interval (right, bars). Absent without a GradScaler.",
            [
                query(job_level("trainguard_loss_scale"), "loss scale ({{run}})"),
                query(job_level("trainguard_amp_skipped_steps_total", fn="increase"), "skipped ({{run}})"),
            ],
            log=True,
            overrides=[right_axis("skipped.*", draw="bars")],
        ),
        state_timeline(
            "Paused",
            "1 while the controller holds the run paused (every rank waits at the same step).",
            [query(job_level("trainguard_paused"), "{{run}}")],
            states={0: ("running", "green"), 1: ("paused", "orange")},
        ),
        state_timeline(
            "Incident",
            "The controller's automatic recovery for the run: no incident, an incident open (the "
            "escalation ladder is working on it), or escalated (the run paused, waiting for a "
            "human). `trainguard incidents RUN` lists the rungs taken.",
            # (the controller's series carry no training job: the runs of the selected jobs are
            # the ones whose ranks report a step)
            [query(f"(max by (run) (trainguard_controller_incidents_awaiting_human{{run=~\"$run\"}}) * 2"
                   f" or max by (run) (trainguard_controller_incidents_open{{run=~\"$run\"}})"
                   f" or {RUN_STEP} * 0) and on (run) {RUN_STEP}", "{{run}}")],
            states={0: ("no incident", "green"), 1: ("recovering", "orange"), 2: ("waiting for a human", "red")},
        ),
    ])


def build() -> Dashboard:
    return dashboard(
        uid=UID,
        title=TITLE,
        description=" ".join(__doc__.split()),
        tags=["stability"],
        sections=[_overview(), _gradients(), _updates(), _lr()],
    )
