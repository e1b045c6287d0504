"""Dashboard 3, ranks: is every rank keeping up, and is the agent behaving? Step time per rank as a
heatmap, the straggler ratio (slowest rank over the median), model-FLOPs utilisation per rank,
gradient communication time per rank and the share of it the step waits for, whether the
replicas' gradients and parameters agree, memory per rank, each rank's GPU (utilisation, clock,
temperature, memory, ECC and XID errors), the agent's own overhead and errors,
whether the run reaches the controller, and the reports it had to drop.
"""

from __future__ import annotations

from grafanalib.core import Dashboard

from trainguard.dashboards.common import (
    DATASOURCE,
    JOB_RUN,
    SEL,
    Band,
    RankHeatmap,
    Section,
    dashboard,
    job_level,
    query,
    stat,
    state_timeline,
    timeseries,
    with_ref_ids,
)
from trainguard.dashboards.rules import FORWARD_WINDOW
from trainguard.dashboards.thresholds import COMM_EXPOSED_RATIO_MAX, DESYNC_REL_TOL, STRAGGLER_RATIO

UID = "trainguard-ranks"
TITLE = "trainguard / Ranks"


def _speed() -> Section:
    return Section("Step time", [*_step_time_panels(), *_utilisation_panels()])


def _step_time_panels() -> list:
    """The step and forward times per rank, and the straggler ratio over them."""
    return [
        RankHeatmap(
            title="Step time per rank (heatmap)",
            description="Wall time between the last two end_step calls, one row per rank; a "
                        "row that is persistently darker is a straggler.",
            dataSource=DATASOURCE,
            targets=with_ref_ids(
                [query(f"trainguard_step_duration_seconds{{{SEL}}}", "rank {{rank}} ({{run}})")]),
            maxDataPoints=200,
            span=12,
        ),
        RankHeatmap(
            title="Forward time per rank (heatmap)",
            description="Wall time in the model's forward pass, one row per rank. Under data "
                        "parallelism every rank waits for the slowest in the gradient all-reduce, so "
                        "step times are equal; a slow rank shows here as a persistently darker row.",
            dataSource=DATASOURCE,
            targets=with_ref_ids(
                [query(f"trainguard_forward_seconds{{{SEL}}}", "rank {{rank}} ({{run}})")]),
            maxDataPoints=200,
            span=12,
        ),
        timeseries(
            "Stragglers: slowest rank / median of the others (forward time)",
            f"Each rank's median forward-pass time over {FORWARD_WINDOW}; the slowest rank's divided by "
            f"the median of the other ranks' (1 for a run of one rank). The straggler alert fires above "
            f"{STRAGGLER_RATIO:g} (red line) for 1 minute.",
            [query(f"trainguard:forward_seconds:max_over_median{{{JOB_RUN}}}", "{{run}}")],
            band=Band(((STRAGGLER_RATIO, "red"),)),
        ),
        timeseries(
            "Step time per rank",
            "Wall time between the last two end_step calls.",
            [query(f"trainguard_step_duration_seconds{{{SEL}}}", "rank {{rank}} ({{run}})")],
            unit="s",
        ),
        timeseries(
            "Slowest rank",
            "The rank with the longest last step, per run.",
            [query(f"topk by (job, run) (1, trainguard_step_duration_seconds{{{SEL}}})",
                   "rank {{rank}} ({{run}})")],
            unit="s",
        ),
    ]


def _utilisation_panels() -> list:
    """Compute utilisation and gradient communication per rank."""
    return [
        timeseries(
            "Model-FLOPs utilisation per rank",
            "Tokens/s x FLOPs per token over the device's dense 16-bit peak (trainguard_mfu). "
            "A rank well below the others computes slower or waits longer (for input, or for a "
            "collective); the whole job low means the step is not compute-bound. Only where the "
            "agent knows the model's FLOPs per token and the device's peak.",
            [query(f"trainguard_mfu{{{SEL}}}", "rank {{rank}} ({{run}})")],
            unit="percentunit", width=24,
        ),
        timeseries(
            "Gradient communication per rank",
            "Mean time per step DDP's gradient all-reduce was in flight (trainguard_comm_seconds) "
            "and the part of it after the backward had ended, which the step waits for "
            "(trainguard_comm_exposed_seconds). Only with AgentConfig(comm_timing=True) under DDP "
            "on the CPU (gloo); absent (NaN) on CUDA, under FSDP2 or with a communication hook of "
            "the run's own.",
            [query(f"trainguard_comm_seconds{{{SEL}}}", "in flight, rank {{rank}} ({{run}})"),
             query(f"trainguard_comm_exposed_seconds{{{SEL}}}", "exposed, rank {{rank}} ({{run}})")],
            unit="s",
        ),
        timeseries(
            "Exposed communication (share of the step)",
            f"Share of each rank's step time spent waiting for the gradient all-reduce after its "
            f"backward (trainguard_comm_exposed_ratio). Every rank high: the network or the bucket "
            f"sizes limit the step; every rank but one: they wait for that rank's gradients (it is "
            f"the slow one). The comm_exposed rule notifies at {COMM_EXPOSED_RATIO_MAX:g} or more "
            f"for five reports (red line).",
            [query(f"trainguard_comm_exposed_ratio{{{SEL}}}", "rank {{rank}} ({{run}})")],
            unit="percentunit", band=Band(((COMM_EXPOSED_RATIO_MAX, "red"),)),
        ),
    ]


#: What the replicas' agreement panel shows, in plain words.
_AGREEMENT_HELP = " ".join((
    "Ranks that hold copies of the same weights (data-parallel replicas) apply the same averaged",
    "gradient and must stay equal. At each report the leader compares every rank's gradients and",
    "parameters, layer by layer, and this shows the largest relative difference it found.",
    f"0 means every rank agrees. Above the tolerance ({DESYNC_REL_TOL:g}, red line) a rank disagrees:".replace("e-0", "e-"),
    "its device corrupted data silently, or its optimizer went out of step with the others (e.g.",
    "after a restore on that rank alone); the controller's desync rules raise a critical alert.",
    "Inf: a NaN or Inf on some ranks only. Only ranks that must hold the same values are compared:",
    "FSDP2 shards with their replicas alone (none under plain FSDP2). FSDP1's shards, post-local SGD",
    "averaged by DDP's hook and the parameters named in AgentConfig(rank_local_params=...) are left",
    "out; other ranks that differ on purpose (experts placed by hand and not declared) show here:",
    "declare them, or turn the comparison off (AgentConfig(fingerprint=False)).",
    "No line: no comparison ran (a run of one rank, plain FSDP2).",
))


def _agreement() -> Section:
    """The leader's comparison of the replicas' gradients and parameters (job-level gauges)."""
    return Section("Parameter synchronisation", [
        timeseries(
            "Replica agreement: largest difference across ranks",
            _AGREEMENT_HELP,
            [query(job_level("trainguard_grad_desync_rel_diff"), "gradients ({{run}})"),
             query(job_level("trainguard_param_desync_rel_diff"), "parameters ({{run}})")],
            band=Band(((DESYNC_REL_TOL, "red"),)),
        ),
        stat(
            "Rank and layer that differ most",
            "The rank holding the largest difference (the value) and its layer (in the name), for "
            "gradients and parameters; empty while every rank agrees. With two replicas both "
            "differ alike and the lower rank is named; with three or more, the odd one out.",
            [query(job_level("trainguard_grad_desync_rank", by="worst_layer"),
                   "gradients, layer {{worst_layer}} ({{run}})"),
             query(job_level("trainguard_param_desync_rank", by="worst_layer"),
                   "parameters, layer {{worst_layer}} ({{run}})")],
            width=12,
        ),
    ])


def _memory() -> Section:
    return Section("Memory", [
        timeseries(
            "Memory per rank",
            "Allocated, reserved and peak bytes: torch.cuda counters on GPUs, the process's "
            "resident set size on CPU.",
            [
                query(f"trainguard_memory_allocated_bytes{{{SEL}}}", "allocated, rank {{rank}} ({{run}})"),
                query(f"trainguard_memory_reserved_bytes{{{SEL}}}", "reserved, rank {{rank}} ({{run}})"),
                query(f"trainguard_memory_peak_bytes{{{SEL}}}", "peak, rank {{rank}} ({{run}})"),
            ],
            unit="bytes", width=24,
        ),
    ])


def _gpu() -> Section:
    """Each rank's GPU as NVML reads it: how busy, how fast, how warm, how full, and its errors."""
    return Section("GPU health", [
        timeseries(
            "GPU utilisation per rank",
            "Share of the last sample period in which a kernel ran on the rank's GPU "
            "(trainguard_gpu_utilization_ratio, NVML). A rank far below the others waits (for input, "
            "or for the others at a collective); every rank low means the job feeds its GPUs "
            "poorly: a job at 65 % takes about 40 % longer than one at 92 %. Absent without a GPU or NVML.",
            [query(f"trainguard_gpu_utilization_ratio{{{SEL}}}", "rank {{rank}} ({{run}})")],
            unit="percentunit", width=24,
        ),
        timeseries(
            "SM clock and temperature per rank",
            "The GPU's current SM clock (left) and temperature (right). One clock far below the "
            "others' with a non-zero throttle reason (trainguard_gpu_throttle_reasons) points at a "
            "GPU slowed by heat or power: that rank becomes the straggler.",
            [query(f"trainguard_gpu_sm_clock_hertz{{{SEL}}}", "clock, rank {{rank}} ({{run}})"),
             query(f"trainguard_gpu_temperature_celsius{{{SEL}}}", "temperature, rank {{rank}} ({{run}})")],
            unit="hertz",
            overrides=[{
                "matcher": {"id": "byRegexp", "options": "temperature.*"},
                "properties": [{"id": "custom.axisPlacement", "value": "right"}, {"id": "unit", "value": "celsius"}],
            }],
        ),
        timeseries(
            "GPU memory per rank",
            "Memory in use on the rank's GPU by every process (NVML), beside the GPU's total: the "
            "allocator's own view is in the Memory section.",
            [query(f"trainguard_gpu_memory_used_bytes{{{SEL}}}", "used, rank {{rank}} ({{run}})"),
             query(f"trainguard_gpu_memory_total_bytes{{{SEL}}}", "total, rank {{rank}} ({{run}})")],
            unit="bytes",
        ),
        timeseries(
            "GPU errors per rank",
            "Uncorrected ECC memory errors and critical XID errors per interval: either on a rank "
            "makes its results suspect (the controller's hardware rules name the rank and its node).",
            [query(f"increase(trainguard_gpu_ecc_uncorrected_errors_total{{{SEL}}}[$__rate_interval])",
                   "ECC, rank {{rank}} ({{run}})"),
             query(f"increase(trainguard_gpu_xid_errors_total{{{SEL}}}[$__rate_interval])",
                   "XID, rank {{rank}} ({{run}})")],
            draw="bars",
        ),
    ])


def _reachability_panels() -> list:
    """Whether the run reaches the controller, and whether Prometheus reaches each rank."""
    return [
        state_timeline(
            "Controller reachable",
            "1 when the run's last exchange with the controller succeeded (rank 0 talks to the "
            "controller for the run). The agent fails open: training goes on while the controller "
            "is away.",
            [query(job_level("trainguard_agent_controller_up"), "{{run}}")],
            states={0: ("unreachable", "red"), 1: ("reachable", "green")},
        ),
        state_timeline(
            "Scraped by Prometheus",
            "Whether each rank's /metrics endpoint answered its last scrape "
            "(trainguard:rank_up:max): Prometheus's own `up` where the ranks are discovered "
            "through the controller's http_sd targets; under a PodMonitor, whose targets do not "
            "name the rank, a rank is down when its series stop while its run's other ranks are "
            "still scraped.",
            [query(f"trainguard:rank_up:max{{{SEL}}}", "rank {{rank}} ({{run}})")],
            states={0: ("down", "red"), 1: ("up", "green")},
        ),
    ]


def _agent() -> Section:
    return Section("Agent health", [
        timeseries(
            "Agent overhead (share of the step)",
            "Wall time the agent spent inside the last step divided by the step time.",
            [query(f"trainguard_agent_overhead_seconds{{{SEL}}} "
                   f"/ trainguard_step_duration_seconds{{{SEL}}}", "rank {{rank}} ({{run}})")],
            unit="percentunit",
        ),
        timeseries(
            "Agent overhead and errors",
            "Seconds the agent spent in the last step (left) and its internal errors per "
            "interval (right; training goes on after each).",
            [
                query(f"trainguard_agent_overhead_seconds{{{SEL}}}", "overhead, rank {{rank}} ({{run}})"),
                query(f"increase(trainguard_agent_errors_total{{{SEL}}}[$__rate_interval])",
                      "errors, rank {{rank}} ({{run}})"),
            ],
            unit="s",
            overrides=[{
                "matcher": {"id": "byRegexp", "options": "errors.*"},
                "properties": [{"id": "custom.axisPlacement", "value": "right"},
                               {"id": "unit", "value": "short"},
                               {"id": "custom.drawStyle", "value": "bars"}],
            }],
        ),
        *_reachability_panels(),
        timeseries(
            "Dropped reports",
            "Reports the agent dropped per interval because its send buffer was full (the "
            "controller was slow or away).",
            [query(job_level("trainguard_agent_reports_dropped_total", fn="increase"), "{{run}}")],
            draw="bars", width=24,
        ),
    ])


def build() -> Dashboard:
    return dashboard(
        uid=UID,
        title=TITLE,
        description=" ".join(__doc__.split()),
        tags=["ranks"],
        sections=[_speed(), _agreement(), _memory(), _gpu(), _agent()],
    )
