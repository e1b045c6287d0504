"""Prometheus recording and alerting rules for the same conditions as the controller's default
rules, for teams that prefer alerting in Prometheus: Prometheus evaluates them, Alertmanager routes
the alerts to the controller's ``POST /v1/alertmanager``, and the controller acts on every alert
whose labels name a ``run`` and a ``trainguard_action`` (``notify``, ``pause``, ``lr_scale`` ...).

Each alert aggregates over ranks ``by (job, run)``, so one alert per run fires, never one per rank
(the controller's own series, which carry no training job, ``by (run)``). A job-level metric
(catalogue scope ``job``: the gradient norm, the optimizer state's non-finite count, ``paused``)
is served by the leader alone, so its aggregate is the leader's value; with
``AgentConfig(job_metrics="all")`` every rank serves an identical copy and the aggregate is the same.
Per-rank metrics (the loss, the forward time, the data signals) are aggregated over every rank.
The thresholds are the controller's default rules' (``dashboards/thresholds.py``).

An alert whose condition one of the controller's own rules judges by cause only notifies: that
rule judges the same values with what Prometheus cannot know (the schedule's planned rises such as a
warm restart, a run's own scale, a change of the trainable elements, its settle periods), so the
controller's verdict is the one cause an action follows from, and a fault is acted on once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainguard.dashboards.thresholds import (
    ABSENCE,
    DUPLICATE_RATIO_MAX,
    FORWARD_MIN,
    GRAD_NORM_LIMIT,
    GRAD_NORM_RISE,
    GRAD_NORM_SPIKE_MIN_HISTORY,
    GRAD_NORM_SPIKE_RATIO,
    LENGTH_SHIFT_P_MIN,
    SPECIAL_TOKEN_RATIO_MAX,
    STRAGGLER_RATIO,
    TOKEN_KL_MAX,
)
from trainguard.protocol.commands import REGISTRY

__all__ = [
    "GRAD_NORM_SPIKE_WINDOW",
    "FORWARD_WINDOW",
    "FORWARD_MIN_SAMPLES",
    "RANK_MEMORY",
    "CONTROLLER_ACTIONS",
    "ACTIONS",
    "Recording",
    "AlertRule",
    "RECORDING_RULES",
    "ALERT_RULES",
    "rule_groups",
]

#: The rolling median of the gradient-norm spike alert (the controller's rule uses its last 32
#: reports; Prometheus has samples in time, not reports). The thresholds come from
#: :mod:`dashboards.thresholds`, i.e. from the controller's default rules.
GRAD_NORM_SPIKE_WINDOW = "10m"
#: Each rank's forward time is its median over this window: one scrape of a forward that the
#: operating system's scheduling stretched (a CPU rank descheduled for a few ms) is not a straggler.
FORWARD_WINDOW = "5m"
#: Scrapes of its forward time a rank needs in that window before it is judged (a median of one
#: or two scrapes is those scrapes).
FORWARD_MIN_SAMPLES = 3
#: How long a rank that stopped answering its scrapes is still listed as down where its scrape
#: target does not name it (a PodMonitor's): longer than the RankDown alert's ``for``.
RANK_MEMORY = "1h"
#: Actions the controller's ``/v1/alertmanager`` carries out from ``trainguard_action``: the
#: registry's commands Alertmanager may give, except ``resume`` (an alert never resumes a run).
#: ``lr_scale`` multiplies the run's lr_scale by ``trainguard_lr_factor``, clamped to
#: [LR_SCALE_MIN, LR_SCALE_MAX] as a rule's is; the other commands take their body from
#: ``trainguard_<field>`` labels.
CONTROLLER_ACTIONS: tuple[str, ...] = tuple(c.name for c in REGISTRY if c.alertmanager and c.operator and c.name != "resume")
#: Every ``trainguard_action`` value: ``notify`` alerts go to people (the webhook sink), not to
#: the controller.
ACTIONS = ("notify", *CONTROLLER_ACTIONS)

BY_RUN = "by (job, run)"
_FORWARD = "trainguard:forward_seconds:median_" + FORWARD_WINDOW


@dataclass(frozen=True, kw_only=True, slots=True)
class Recording:
    """A recording rule: ``record`` is computed from ``expr`` at every evaluation."""

    record: str
    """Name of the recorded series, ``level:metric:operations``."""
    expr: str
    """PromQL expression."""

    def __post_init__(self) -> None:
        if self.record.count(":") != 2 or not self.record.startswith("trainguard:"):
            raise ValueError(f"recording rule {self.record!r} must be named trainguard:<metric>:<ops>")

    def to_yaml(self) -> dict:
        return {"record": self.record, "expr": self.expr}


@dataclass(frozen=True, kw_only=True, slots=True)
class AlertRule:
    """An alerting rule whose labels tell the controller what to do."""

    name: str
    """Alert name (CamelCase, ``Trainguard`` prefix)."""
    expr: str
    """PromQL expression; every series it returns is one firing alert and carries job and run."""
    action: str
    """``trainguard_action`` label: what the controller does when the alert reaches it."""
    severity: str
    """``severity`` label: ``info``, ``warning`` or ``critical``."""
    summary: str
    """One line for people; may use ``{{ $labels.run }}`` and ``{{ $value }}``."""
    for_: str = "0s"
    """How long the condition must hold before the alert fires."""
    extra_labels: dict[str, str] = field(default_factory=dict)
    """More labels, e.g. ``trainguard_lr_factor`` of an ``lr_scale`` action."""
    description: str = "Run {{ $labels.run }} of job {{ $labels.job }}: value {{ $value }}."
    """The ``description`` annotation."""

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"alert {self.name}: action {self.action!r} not in {ACTIONS}")
        if self.severity not in ("info", "warning", "critical"):
            raise ValueError(f"alert {self.name}: unknown severity {self.severity!r}")
        if not self.name.startswith("Trainguard"):
            raise ValueError(f"alert {self.name!r} must start with 'Trainguard'")

    def to_yaml(self) -> dict:
        rule: dict = {"alert": self.name, "expr": self.expr}
        if self.for_ != "0s":
            rule["for"] = self.for_
        rule["labels"] = {"severity": self.severity, "trainguard_action": self.action,
                          **self.extra_labels}
        rule["annotations"] = {
            "summary": self.summary,
            "description": self.description,
        }
        return rule


RECORDING_RULES: tuple[Recording, ...] = (
    # NaN != NaN is true and |±Inf| == Inf: 1 for a rank whose last loss is non-finite, else 0.
    Recording(
        record="trainguard:loss:nonfinite",
        expr=f"max {BY_RUN} ((trainguard_loss != bool trainguard_loss) "
             f"+ (abs(trainguard_loss) == bool Inf))",
    ),
    Recording(record="trainguard:optimizer_state_nonfinite:max",
              expr=f"max {BY_RUN} (trainguard_optimizer_state_nonfinite)"),
    Recording(record="trainguard:grad_norm:max", expr=f"max {BY_RUN} (trainguard_grad_norm_max)"),
    Recording(
        record="trainguard:grad_norm:spike_ratio",
        expr=f"trainguard:grad_norm:max / quantile_over_time(0.5, "
             f"trainguard:grad_norm:max[{GRAD_NORM_SPIKE_WINDOW}])",
    ),
    # Under data parallelism the all-reduce equalises the ranks' step times: what differs on a
    # slow rank is the time in its own forward pass, judged by its median over FORWARD_WINDOW.
    Recording(
        record=_FORWARD,
        expr=f"max by (job, run, rank) (quantile_over_time(0.5, trainguard_forward_seconds[{FORWARD_WINDOW}]) "
             f"and count_over_time(trainguard_forward_seconds[{FORWARD_WINDOW}]) >= {FORWARD_MIN_SAMPLES})",
    ),
    # The slowest rank over the median of the others (with two ranks: over the other one; a rank
    # twice as slow as the rest reads 2); 1 for a run of one rank or of equal ranks.
    Recording(
        record="trainguard:forward_seconds:max_over_median",
        expr=f"max {BY_RUN} ({_FORWARD}) / quantile {BY_RUN} (0.5, {_FORWARD} unless on (job, run, rank) "
             f"({_FORWARD} == on (job, run) group_left max {BY_RUN} ({_FORWARD}))) "
             f"or on (job, run) max {BY_RUN} ({_FORWARD}) / max {BY_RUN} ({_FORWARD})",
    ),
    Recording(record="trainguard:tokens_per_second:sum",
              expr=f"sum {BY_RUN} (trainguard_tokens_per_second)"),
    Recording(record="trainguard:data_duplicate_ratio:max",
              expr=f"max {BY_RUN} (trainguard_data_duplicate_ratio)"),
    Recording(record="trainguard:data_token_kl_divergence:max",
              expr=f"max {BY_RUN} (trainguard_data_token_kl_divergence)"),
    Recording(record="trainguard:data_special_token_ratio:max",
              expr=f"max {BY_RUN} (trainguard_data_special_token_ratio)"),
    Recording(record="trainguard:data_length_shift_pvalue:min",
              expr=f"min {BY_RUN} (trainguard_data_length_shift_pvalue)"),
    Recording(record="trainguard:step:changes_5m",
              expr=f"max {BY_RUN} (changes(trainguard_step[{ABSENCE}]))"),
    # 1 for a rank whose /metrics answered its last scrape, 0 for one that did not. Targets
    # discovered through the controller carry job, run and rank: their `up`. A PodMonitor's targets
    # do not (the ranks' own labels are on the series they serve, never on `up`): there a rank is
    # down when its step is no longer scraped while other ranks of its run still are (remembered
    # for RANK_MEMORY).
    Recording(
        record="trainguard:rank_up:max",
        expr=f'max by (job, run, rank) (up{{run!=""}}) '
             f"or max by (job, run, rank) (trainguard_step) * 0 + 1 "
             f"or max by (job, run, rank) (last_over_time(trainguard_step[{RANK_MEMORY}])) * 0 "
             f"and on (job, run) max {BY_RUN} (trainguard_step)",
    ),
    # The controller's own series carry the controller's scrape job, not the run's: the run's
    # training job comes from its ranks' series (a run's name is unique in its controller), as on
    # every other alert; a run none of whose ranks was seen for RANK_MEMORY keeps its run label.
    Recording(
        record="trainguard:incidents_awaiting_human:max",
        expr="max by (run) (trainguard_controller_incidents_awaiting_human) * on (run) group_left (job) "
             f'topk by (run) (1, group {BY_RUN} (up{{run!=""}} or last_over_time(trainguard_step[{RANK_MEMORY}]))) '
             "or on (run) max by (run) (trainguard_controller_incidents_awaiting_human)",
    ),
)

ALERT_RULES: tuple[AlertRule, ...] = (
    AlertRule(
        # Notifies only: the controller's own loss_nonfinite rule acts on the same reports with
        # the recovery ladder (a step the agent skipped leaves the weights intact; otherwise it rolls
        # back, and pauses only without a snapshot). A pause from here would page a human for a
        # NaN the run already recovered from.
        name="TrainguardLossNonFinite",
        expr="trainguard:loss:nonfinite > 0",
        action="notify", severity="critical",
        summary="Loss is NaN/Inf on run {{ $labels.run }} (likely gradient explosion). The controller "
                "skips the step or rolls back to its last good snapshot; see the run's incidents.",
    ),
    AlertRule(
        name="TrainguardOptimizerStateNonFinite",
        expr="trainguard:optimizer_state_nonfinite:max > 0",
        action="pause", severity="critical",
        summary="{{ $value }} non-finite optimizer-state elements on run {{ $labels.run }}: "
                "pausing it (fp16 Adam moments overflow first).",
    ),
    AlertRule(
        # Notifies only: the controller's grad_norm_high rule lowers the LR on a rise across the
        # limit in this run, not on a run at that scale from its first step (a loss summed over
        # tokens), where an LR cut from here would slow a healthy run. As the rule, a rise: the
        # norm GRAD_NORM_RISE times its rolling median at least (a norm whose level is near the
        # limit crosses it with its noise, up to 2.5x its median).
        name="TrainguardGradNormHigh",
        expr=f"trainguard:grad_norm:max > {GRAD_NORM_LIMIT:g} "
             f"and on (job, run) trainguard:grad_norm:spike_ratio >= {GRAD_NORM_RISE:g}",
        action="notify", severity="warning",
        summary="Gradient norm {{ $value }} above 1e3 on run {{ $labels.run }}, risen to "
                f"{GRAD_NORM_RISE:g}x its rolling median or more (such gradients usually precede "
                "divergence). The controller lowers the LR when the norm rose across 1e3 in this run; "
                "see the run's incidents.",
    ),
    AlertRule(
        # Judged against GRAD_NORM_SPIKE_MIN_HISTORY earlier values at least, as the controller's
        # rule: a run's first few values are no baseline (the window holds the current one too).
        # Notifies only: the controller's grad_norm_spike rule lowers the LR by cause (a warm
        # restart's or a re-warm's planned rise, a change of the trainable elements and its settle
        # period are no fault); an LR cut from here too would cut twice for one spike.
        name="TrainguardGradNormSpike",
        expr=f"trainguard:grad_norm:spike_ratio > {GRAD_NORM_SPIKE_RATIO:g} "
             f"and on (job, run) count_over_time(trainguard:grad_norm:max[{GRAD_NORM_SPIKE_WINDOW}]) "
             f"> {GRAD_NORM_SPIKE_MIN_HISTORY}",
        action="notify", severity="warning",
        summary="Gradient norm spiked to {{ $value }}x its rolling median on run "
                "{{ $labels.run }}. The controller lowers the LR unless the schedule or a change of "
                "the trained layers explains it; see the run's incidents.",
    ),
    AlertRule(
        name="TrainguardDataDuplicates",
        expr=f"trainguard:data_duplicate_ratio:max > {DUPLICATE_RATIO_MAX:g}",
        action="notify", severity="warning",
        summary="Duplicate ratio {{ $value }} above 5% on run {{ $labels.run }}.",
    ),
    AlertRule(
        name="TrainguardTokenDistributionShift",
        expr=f"trainguard:data_token_kl_divergence:max > {TOKEN_KL_MAX:g}",
        action="notify", severity="warning",
        summary="Token-distribution KL {{ $value }} above 0.1 on run {{ $labels.run }}.",
    ),
    AlertRule(
        name="TrainguardSpecialTokens",
        expr=f"trainguard:data_special_token_ratio:max > {SPECIAL_TOKEN_RATIO_MAX:g}",
        action="notify", severity="warning",
        summary="Special/control token ratio {{ $value }} above 0.01% on run {{ $labels.run }}.",
    ),
    AlertRule(
        name="TrainguardLengthShift",
        expr=f"trainguard:data_length_shift_pvalue:min < {LENGTH_SHIFT_P_MIN:g}",
        action="notify", severity="warning",
        summary="Sequence-length distribution shifted (KS p = {{ $value }}) on run "
                "{{ $labels.run }}.",
    ),
    AlertRule(
        name="TrainguardStraggler",
        expr=f"trainguard:forward_seconds:max_over_median > {STRAGGLER_RATIO:g} "
             f"and on (job, run) max {BY_RUN} ({_FORWARD}) >= {FORWARD_MIN:g}",
        for_="1m",
        action="notify", severity="warning",
        summary="Slowest rank spends {{ $value }}x the other ranks' median time in the forward pass on "
                "run {{ $labels.run }} over " + FORWARD_WINDOW + " (step times are equal under data "
                "parallelism; the forward is not).",
    ),
    AlertRule(
        # No change over a window the run was scraped through: a run first scraped less than
        # ABSENCE ago has one sample (no change yet), and a finished run's ranks (no longer
        # scraped: their series are stale) keep their last samples in the window; neither is hung.
        name="TrainguardRunStalled",
        expr=f"trainguard:step:changes_5m == 0 "
             f"and on (job, run) max {BY_RUN} (trainguard_step offset {ABSENCE}) "
             f"and on (job, run) max {BY_RUN} (trainguard_step) "
             f"unless on (job, run) (max {BY_RUN} (trainguard_paused) > 0)",
        action="notify", severity="critical",
        summary="Run {{ $labels.run }} made no step for " + ABSENCE + " and is not paused: hung?",
    ),
    AlertRule(
        name="TrainguardIncidentEscalated",
        expr="trainguard:incidents_awaiting_human:max > 0",
        action="notify", severity="critical",
        summary="Run {{ $labels.run }} is paused: the automatic recovery did not bring it back and "
                "escalated its incident to a human. Look at the rungs it took, fix the cause, then "
                "resume the run.",
        description="Run {{ $labels.run }}: `trainguard incidents {{ $labels.run }}` lists the incident's "
                    "onset and rungs; its page in the console shows them next to the charts.",
    ),
    AlertRule(
        # A rank that stopped answering while the rest of its run still steps left the job (it
        # finished its share early, or an elastic restart went on with fewer ranks): no page. A
        # rank that died under data parallelism holds the others at their next collective.
        name="TrainguardRankDown",
        expr=f"trainguard:rank_up:max == 0 unless on (job, run) trainguard:step:changes_5m > 0",
        for_="1m",
        action="notify", severity="critical",
        summary="Rank {{ $labels.rank }} of run {{ $labels.run }} answers no scrape and the run made no "
                "step for " + ABSENCE + ": the ranks wait for it.",
    ),
)


def rule_groups(*, interval: str | None = None) -> dict:
    """The rules file's content: one group, the recording rules first, then the alerts that read
    them. Rules within a group are evaluated in order at the same timestamp, so an alert always
    sees the value recorded in the same evaluation (groups run independently of each other)."""
    group: dict = {"name": "trainguard",
                   "rules": [r.to_yaml() for r in RECORDING_RULES] + [a.to_yaml() for a in ALERT_RULES]}
    if interval is not None:
        group["interval"] = interval
    return {"groups": [group]}
