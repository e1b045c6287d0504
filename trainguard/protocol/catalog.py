"""The agent's metric catalogue: the one place that names and documents every metric a training
rank exports. The exporter, ``Agent.latest()``, the reports sent to the controller, the dashboards
and the tests all read names from here. This module must not import torch.

Every metric carries the labels ``job``, ``run`` and ``rank``; ``labels`` lists the extra ones.
Units are in the name (Prometheus conventions); counters end in ``_total``.

Each metric declares its ``scope``, which decides the ranks whose ``/metrics`` serve it
(:func:`exported_scopes`): a value of the rank itself (``rank``: its loss, timings, memory, GPU)
on every rank; a value of the whole job (``job``: equal on every rank, such as the global gradient
norm, the LR and the agreed control state, or computed from every rank's values, such as the
noise scale) on the leader, rank 0, only; the per-layer series (``layer``) where
``AgentConfig.per_layer`` computes them (rank 0 by default). :func:`series_per_rank` and
:func:`series_per_job` count the series that makes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "MetricSpec",
    "Scope",
    "SCOPES",
    "RANK",
    "JOB",
    "RUN_CHANGE_MARKERS",
    "LAYER",
    "LABEL_VALUES",
    "ONE_AT_A_TIME",
    "BASE_LABELS",
    "STEP_METRICS",
    "DATA_METRICS",
    "CONTROL_METRICS",
    "INPUT_METRICS",
    "AGENT_METRICS",
    "BY_NAME",
    "spec",
    "exported_scopes",
    "series_per_rank",
    "series_per_job",
]

BASE_LABELS: tuple[str, ...] = ("job", "run", "rank")

Scope = Literal["rank", "job", "layer"]
RANK: Scope = "rank"
JOB: Scope = "job"
LAYER: Scope = "layer"
SCOPES: tuple[Scope, ...] = (RANK, JOB, LAYER)

#: The values of the extra labels that have a fixed set: the reasons the agent skips a step for
#: (``trainer_agent.control.actuators``), the QualityFilter's decisions. ``group`` (one per param group)
#: and ``layer`` (one per layer) depend on the run.
LABEL_VALUES: dict[str, tuple[str, ...]] = {
    "reason": ("spike", "nonfinite", "data"),
    "decision": ("kept", "dropped", "downsampled"),
}

#: Labels whose value changes but which hold one value at a time (one series per metric): the
#: layer where the ranks disagree most.
ONE_AT_A_TIME: tuple[str, ...] = ("worst_layer",)


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One exported metric."""

    name: str
    """Full Prometheus name, e.g. ``trainguard_grad_norm``."""
    kind: Literal["gauge", "counter", "histogram"]
    """Prometheus type. Counters end in ``_total`` and never decrease (the agent exports gauges and
    counters; the controller's catalogue also has histograms)."""
    unit: str
    """Unit in words ("1" for dimensionless ratios)."""
    help: str
    """What it measures and the formula. Becomes the Prometheus HELP text."""
    labels: tuple[str, ...] = ()
    """Labels beyond ``job``, ``run``, ``rank``."""
    scope: Scope = RANK
    """Which ranks serve it (:func:`exported_scopes`): ``rank``, a value of each rank, on every
    rank; ``job``, a value of the whole job, on the leader (rank 0) only by default; ``layer``,
    the per-layer series, where ``AgentConfig.per_layer`` computes them."""

    def __post_init__(self) -> None:
        if not self.name.startswith("trainguard_"):
            raise ValueError(f"metric {self.name!r} must start with 'trainguard_'")
        if (self.kind == "counter") != self.name.endswith("_total"):
            raise ValueError(f"metric {self.name!r}: counters, and only counters, end in '_total'")
        if self.scope not in SCOPES:
            raise ValueError(f"metric {self.name!r}: scope must be one of {SCOPES}, got {self.scope!r}")
        if (self.scope == LAYER) != ("layer" in self.labels):
            raise ValueError(f"metric {self.name!r}: the per-layer metrics, and only they, have the scope 'layer'")

    @property
    def series(self) -> tuple[str, ...]:
        """The sample names Prometheus stores for this metric."""
        if self.kind == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        return (self.name,)


def _g(name: str, unit: str, help: str, labels: tuple[str, ...] = (), *, scope: Scope = RANK) -> MetricSpec:
    return MetricSpec(name, "gauge", unit, help, labels, scope)


def _c(name: str, unit: str, help: str, labels: tuple[str, ...] = (), *, scope: Scope = RANK) -> MetricSpec:
    return MetricSpec(name, "counter", unit, help, labels, scope)


#: Step metrics (measured around ``optimizer.step()`` and in ``end_step``).
STEP_METRICS: tuple[MetricSpec, ...] = (
    _g("trainguard_step", "steps", "Optimizer steps completed (the step number of the last end_step)."),
    _g("trainguard_loss", "1", "Loss passed to end_step at the last step since the previous report that had one; when a step since the previous report had a non-finite loss, the first such value instead (a NaN between reports is never lost, and is in one report only). Absent on a report where no step since the previous report had a loss (end_step(None))."),
    _g("trainguard_grad_norm", "1", "Global L2 norm of all gradients before clipping: sqrt(sum_p ||g_p||^2); for an accumulated step, of the accumulated gradient. Absent on a report whose step had no gradient (no parameter had a .grad: a step without a backward pass).", scope=JOB),
    _g("trainguard_grad_norm_max", "1", "Largest finite global gradient norm (pre-clip) over the steps since the previous report (NaN when none was finite; absent when none had a gradient): a spike between two reports is not missed. The controller's gradient rules read it.", scope=JOB),
    _g("trainguard_param_norm", "1", "Global L2 norm of the trainable parameters after the step: sqrt(sum_p ||W_p||^2).", scope=JOB),
    _g("trainguard_param_scale", "1", "Root mean square of the trainable parameters: ||W|| / sqrt(n), n = number of trainable elements; comparable across model sizes.", scope=JOB),
    _g("trainguard_update_ratio", "1", "Relative size of the last update: ||W_after - W_before|| / ||W_before|| over all trainable parameters. Healthy band about 1e-4..1e-2. Absent on a report whose step had no gradient (no parameter had a .grad: the weights did not move because nothing trained, not a stalled update).", scope=JOB),
    _g("trainguard_update_ratio_per_lr", "1/LR", "The last update ratio per unit of the LR the step applied: trainguard_update_ratio / the largest LR of the optimizer's param groups at that step (the user's schedule x lr_scale). Neither the schedule nor the controller's lr_scale moves it (with Adam-type optimizers the update is proportional to the LR); absent when the LR lives in a device tensor or is 0, and on a report whose step had no gradient.", scope=JOB),
    _g("trainguard_learning_rate", "1", "Learning rate actually used by the optimizer in param group `group` at the last step (scheduler LR x lr_scale).", ("group",), scope=JOB),
    _g("trainguard_effective_lr", "1", "Effective learning rate ||W_after - W_before|| / ||g||: how far the step actually moved per unit gradient (equals lr for plain SGD). Absent on a report whose step had no gradient or a gradient of exactly 0 (no update per unit of gradient to speak of; a NaN gradient gives NaN).", scope=JOB),
    _g("trainguard_grad_noise_scale", "tokens or micro-batches", "Simple gradient noise scale B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018), estimated from the gradient norms of the micro-batches of an accumulated step or of the data-parallel ranks before their all-reduce. A batch size: in tokens when end_step is given tokens=, else in micro-batches. Absent when neither exists.", scope=JOB),
    _g("trainguard_grad_variance", "grad_norm^2 x batch unit", "tr(Sigma): the per-sample (per token, or per micro-batch without tokens=) gradient variance estimate behind the noise scale (same estimator, McCandlish et al. 2018, appendix A.1).", scope=JOB),
    _g("trainguard_nonfinite_grads", "elements", "Non-finite (NaN or Inf) gradient elements at the last step. Absent on a report whose step had no gradient.", scope=JOB),
    _c("trainguard_nonfinite_steps_total", "steps", "Steps whose loss or gradients held a non-finite value."),
    _g("trainguard_optimizer_state_nonfinite", "elements", "Non-finite elements in the optimizer's state tensors (e.g. Adam moments), checked at the report interval.", scope=JOB),
    _g("trainguard_optimizer_state_steps", "steps", "Age of the optimizer's state: the smallest step count among its per-parameter states (Adam/AdamW's state[p][\"step\"], as Adagrad's and RMSprop's: the steps that parameter's moments have accumulated). It restarts from 1 where the state starts afresh although the run's step goes on (a job resumed from a checkpoint without the optimizer's state, parameters that start to train, a reset_optimizer), and the controller's update_ratio_high judges the first steps of a fresh state by it. Absent for an optimizer that keeps no step count (SGD, LBFGS) and before its first step.", scope=JOB),
    _g("trainguard_loss_scale", "1", "AMP GradScaler loss scale after the last step (absent without a scaler).", scope=JOB),
    _c("trainguard_amp_skipped_steps_total", "steps", "Optimizer steps skipped by the GradScaler because of inf/NaN gradients (detected from a drop of the scale).", scope=JOB),
    _g("trainguard_step_duration_seconds", "seconds", "Wall time between the last two end_step calls. Absent on the report of the first step after attach, whose time is the warm-up's (compilation, first-call initialisation), and on the report of a step in which torch.compile compiled again (trainguard_compile_steps_total)."),
    _c("trainguard_compile_steps_total", "steps", "Steps of this rank after the first since attach in which torch.compile compiled: a new input shape, a guard that failed mid-run, a function compiled at its first call, torch.compiler.reset(). Such a step takes the compiler's time (a fraction of a second to minutes), not a sign of a slow rank: its report has no step time, forward time, throughput or MFU, and its gradient communication is not counted in trainguard_comm_seconds. 0 for a run that never compiles."),
    _g("trainguard_forward_seconds", "seconds", "Wall time this rank spent inside the model's forward pass during the last reported step, summed over its micro-batches; forward passes without gradients (an evaluation or a generation between steps) are left out. Under data parallelism the ranks' step times are equalised by the gradient all-reduce, so a slow rank (a straggler) shows here: its forward takes longer than the other ranks'. Absent on the report of the first step after attach, whose time is the warm-up's (compilation, first-call initialisation), and on the report of a step in which torch.compile compiled again (trainguard_compile_steps_total)."),
    _g("trainguard_tokens_per_second", "tokens/s", "tokens passed to end_step divided by the step duration. Absent on the report of the first step after attach, whose time is the warm-up's (compilation, first-call initialisation), and on the report of a step in which torch.compile compiled again (trainguard_compile_steps_total)."),
    _g("trainguard_mfu", "1", "Model-FLOPs utilisation of this rank's device: tokens/s x FLOPs per token (declared, or 6N + 12LHQT for a standard transformer) over the device's dense 16-bit peak (declared, or looked up by the GPU's name). Absent without a known FLOPs count or peak, on the report of the first step after attach (warm-up) and on the report of a step in which torch.compile compiled."),
    _g("trainguard_comm_seconds", "seconds", "Mean time per optimizer step, over the steps since the previous report, during which at least one of DDP's gradient all-reduce buckets was in flight on this rank: the union of the buckets' launch-to-completion intervals, host-timed by the agent's communication hook (AgentConfig.comm_timing). The first step after attach (the communicator's setup, and the wait for the slowest rank's warm-up) and steps in which torch.compile compiled are not counted: absent on the report of the first step. NaN where it cannot be measured: the model has a communication hook of its own, CUDA/NCCL (host timestamps there mark the launch), FSDP2."),
    _g("trainguard_comm_exposed_seconds", "seconds", "The part of trainguard_comm_seconds not hidden behind backward compute: from the moment the backward's last gradient was ready (the last bucket's launch) to the last bucket's completion, clipped at 0, mean per step since the previous report. High on every rank: the network (or bucket sizes) limits the step; high on all ranks but one: they wait for that rank's gradients."),
    _g("trainguard_comm_exposed_ratio", "1", "trainguard_comm_exposed_seconds over the step time: exposed communication time since the previous report over those steps' wall time. The default rule comm_exposed notifies at 0.2 or more for five reports in a row."),
    _g("trainguard_memory_allocated_bytes", "bytes", "torch.cuda.memory_allocated() on CUDA; the process's resident set size on CPU."),
    _g("trainguard_memory_reserved_bytes", "bytes", "torch.cuda.memory_reserved() on CUDA; the process's resident set size on CPU."),
    _g("trainguard_memory_peak_bytes", "bytes", "torch.cuda.max_memory_allocated() on CUDA; the process's peak resident set size on CPU."),
    _g("trainguard_layer_grad_norm", "1", "L2 norm of the gradients of one layer: a repeated block such as model.layers.3, or the module holding parameters outside the blocks (AgentConfig.layer_depth cuts module paths at a fixed depth instead). 0 for a layer without a gradient on a step where others have one; absent on a report whose step had no gradient at all.", ("layer",), scope=LAYER),
    _g("trainguard_layer_param_norm", "1", "L2 norm of the parameters of one layer.", ("layer",), scope=LAYER),
    _g("trainguard_layer_update_ratio", "1", "||W_after - W_before|| / ||W_before|| of one layer. Absent on a report where no parameter of the layer had a gradient and the layer did not move (frozen or unused on the step, an expert no token reached).", ("layer",), scope=LAYER),
    _g("trainguard_layer_grad_mean", "1", "Mean of one layer's gradient elements as the optimizer applies them (after unscaling and clipping), on report steps. Absent on a report where no parameter of the layer has a gradient (unused on the step).", ("layer",), scope=LAYER),
    _g("trainguard_layer_grad_std", "1", "Standard deviation of one layer's gradient elements as the optimizer applies them. Absent on a report where no parameter of the layer has a gradient (unused on the step).", ("layer",), scope=LAYER),
    _g("trainguard_layer_grad_max_abs", "1", "Largest absolute gradient element of one layer as the optimizer applies it. Absent on a report where no parameter of the layer has a gradient (unused on the step).", ("layer",), scope=LAYER),
    _g("trainguard_layer_grad_min_abs", "1", "Smallest absolute gradient element of one layer as the optimizer applies it (0 when some element gets no gradient signal). Absent on a report where no parameter of the layer has a gradient (unused on the step).", ("layer",), scope=LAYER),
    _g("trainguard_grad_max_abs", "1", "Largest absolute gradient element over the model as the optimizer applies it. Gradient values should stay below 1e3. Absent on a report where no parameter has a gradient (as the per-layer statistics of a layer without one).", scope=JOB),
    _g("trainguard_update_size_ratio", "1", "Measured update ||W_after - W_before|| over the size the optimizer's rule predicts: lr x (||g|| + weight_decay x ||W||) / (1 - momentum) for SGD, lr x (sqrt(n) + weight_decay x ||W||) for Adam-like optimizers (n parameters). About 1 or below when healthy; far above, something else changes the weights; far below, the updates vanish. Absent on a report where no parameter has a gradient.", scope=JOB),
    _g("trainguard_gpu_utilization_ratio", "1", "Share of the last sample period in which a kernel ran on this rank's GPU (NVML; absent without a GPU or NVML)."),
    _g("trainguard_gpu_memory_used_bytes", "bytes", "Memory in use on this rank's GPU, all processes (NVML)."),
    _g("trainguard_gpu_memory_total_bytes", "bytes", "Memory of this rank's GPU (NVML)."),
    _g("trainguard_gpu_temperature_celsius", "celsius", "Temperature of this rank's GPU (NVML)."),
    _g("trainguard_gpu_sm_clock_hertz", "hertz", "Current SM clock of this rank's GPU (NVML): a clock far below the others' points at throttling."),
    _g("trainguard_gpu_throttle_reasons", "bitmask", "NVML's clock throttle reasons of this rank's GPU as a bitmask (0: none; e.g. thermal or power slowdown)."),
    _c("trainguard_gpu_ecc_uncorrected_errors_total", "errors", "Uncorrected ECC memory errors of this rank's GPU since the driver loaded (NVML, volatile count): silent data corruption is likely."),
    _c("trainguard_gpu_xid_errors_total", "errors", "Critical XID errors the GPU driver reported for this rank's GPU since the agent started (NVML events): e.g. 79 the GPU fell off the bus, 48 a double-bit ECC error, 63/64 a memory row remapping, 94/95 a contained/uncontained ECC error, 13/31/43 a fault of the application's kernels."),
    _g("trainguard_gpu_last_xid", "code", "The last critical XID error code reported for this rank's GPU (absent until one is)."),
    _c("trainguard_verify_steps_total", "steps", "Steps whose gradient this rank recomputed on the same batch to check it (AgentConfig.verify_every, or on command)."),
    _c("trainguard_verify_mismatches_total", "steps", "Recomputed steps whose gradient differed from the one the step produced by more than the tolerance (relative 1e-5 by default): a sign of silent data corruption on this rank's device."),
    _g("trainguard_verify_rel_diff", "1", "Largest relative difference over the layers between the last checked step's gradient and its recomputation: max over projections |f(first) - f(again)| / ||g_layer|| (0: bit-identical)."),
    _g("trainguard_verify_float32_rel_diff", "1", "Largest relative difference over the layers between the gradient of the last step recomputed in float32 (the controller's verify_float32: mixed precision off) and the gradient the step produced under autocast: max over projections |f(step) - f(float32)| / ||g_layer||. Rounding of a healthy bfloat16/float16 step stays near the format's precision; a large value or inf means the mixed-precision numerics changed the gradient."),
    _g("trainguard_grad_desync_rel_diff", "1", "Largest relative difference of the gradients across the replicas at the last report step whose cross-rank comparison ran (the leader compares every rank's fingerprints: max over ranks and layers of |f(rank) - f(middle of its replicas)| / ||g_layer||). Replicas apply the same averaged gradient, so anything above the tolerance (AgentConfig.desync_rel_tol, 1e-5 by default) means a rank computed or received a different gradient: its device corrupting data silently, or a broken all-reduce. 0: every rank agrees; Inf: a non-finite value on some ranks only; NaN: no rank could be judged. Only ranks that must hold the same values are compared: a sharded parameter (an FSDP2/HSDP DTensor) with its replicas alone, none under plain FSDP2; FSDP1's sharded flat parameters, a run averaged by post-local SGD's DDP hook and the parameters AgentConfig.rank_local_params names are left out. Other ranks that differ on purpose (a model averaged without DDP's hook, experts placed by hand and not declared) differ here too: declare them in rank_local_params, or turn the comparison off with AgentConfig(fingerprint=False). Absent when no comparison ran (one rank, a report sent without its cross-rank comparisons).", scope=JOB),
    _g("trainguard_param_desync_rel_diff", "1", "Largest relative difference of the parameters across the replicas at the last compared report step (as trainguard_grad_desync_rel_diff, over ||W_layer||): above the tolerance, a rank's weights drifted from the others' (silent data corruption, or an optimizer that went out of step, e.g. after a rank-local restore). Absent when no comparison ran.", scope=JOB),
    _g("trainguard_grad_desync_rank", "rank", "The rank holding trainguard_grad_desync_rel_diff (with two replicas both differ; the lower is named), with worst_layer its layer (empty when only the whole-model screen was compared). One series at a time; absent when no rank differs.", ("worst_layer",), scope=JOB),
    _g("trainguard_param_desync_rank", "rank", "The rank holding trainguard_param_desync_rel_diff, with worst_layer its layer (empty when only the whole-model screen was compared). One series at a time; absent when no rank differs.", ("worst_layer",), scope=JOB),
    _c("trainguard_agent_errors_total", "errors", "Internal errors of the agent (each logged once per kind), bad batches given to observe_batch, and batches the data monitor dropped because it fell behind; training went on."),
    _g("trainguard_agent_overhead_seconds", "seconds", "Wall time the agent spent inside the last step (hooks and end_step)."),
)

#: Data-quality metrics (``observe_batch`` / ``DataMonitor``; thresholds from the stability guide, 3.1).
DATA_METRICS: tuple[MetricSpec, ...] = (
    _g("trainguard_data_duplicate_ratio", "1", "Share of sequences in the sliding window whose exact token content was already seen in the window. Above 0.05 (5% duplicated text) an alert warns."),
    _g("trainguard_data_near_duplicate_ratio", "1", "Share of sequences in the window whose MinHash signature over token shingles matches an earlier one in the window (near-duplicates)."),
    _g("trainguard_data_token_kl_divergence", "nats", "KL(current window || reference) of the unigram token distribution. Above 0.1 the data the model sees has drifted and an alert fires."),
    _g("trainguard_data_special_token_ratio", "1", "Share of tokens in the window that are control/special/unknown ids. Above 1e-4 (0.01%) the text is likely corrupted and an alert fires."),
    _g("trainguard_data_length_shift_pvalue", "1", "Two-sample Kolmogorov-Smirnov p-value between the sequence lengths of the reference window and the current window. Below 0.05 the length distribution has shifted and an alert fires."),
    _c("trainguard_data_tokens_total", "tokens", "Non-padding tokens observed."),
    _c("trainguard_data_sequences_total", "sequences", "Sequences observed."),
    _c("trainguard_data_filtered_total", "samples", "Samples seen by a QualityFilter, by decision: kept, dropped (quality score below the cleaning threshold) or downsampled (well learned by the model according to the per-sample losses fed back, and left out by the draw).", ("decision",)),
)

#: Control-loop metrics (reporting to and acting for the controller).
CONTROL_METRICS: tuple[MetricSpec, ...] = (
    _g("trainguard_paused", "1", "1 while the run is paused by the controller, else 0.", scope=JOB),
    _g("trainguard_lr_scale", "1", "Multiplier the controller applies to the scheduler's LR.", scope=JOB),
    _g("trainguard_scheduler_lr", "1", "Learning rate the user's own schedule set for the last step taken: the largest of the optimizer's param groups, read in the optimizer's pre-hook before lr_scale multiplies it.", scope=JOB),
    _g("trainguard_scheduler_lr_max", "1", "Largest learning rate the user's own schedule set for any step taken since the previous report (before lr_scale).", scope=JOB),
    _g("trainguard_scheduler_lr_peak", "1", "Largest learning rate the user's own schedule set for any step before the current report interval, or the LR the schedule was built on (the param groups' initial_lr, which a warm-up rises to) if that is larger: the schedule's envelope so far (kept across a resume through the agent's state_dict). Absent for the first 8 steps.", scope=JOB),
    _g("trainguard_scheduler_lr_ratio", "1", "trainguard_scheduler_lr_max / trainguard_scheduler_lr_peak: how far the schedule went above every LR the run had trained at or was built to reach. A warm-up keeps it at or below 1 (stepped per step or per epoch), a restart or re-warm back to 1, decays below 1.", scope=JOB),
    _g("trainguard_trainable_elements", "1", "Elements of the measured parameters that require a gradient at the report: it changes when the run freezes or unfreezes part of the model (a linear probe, then fine-tuning), and the controller's spike rules then compare each metric only with the reports since the change; the agent's spike guard takes the first spike after a change and starts its baseline afresh.", scope=JOB),
    _c("trainguard_run_changes_total", "changes", "Changes the run marked on purpose (Agent.run_changed: a new loss weight or normalisation, objective or data mixture), after which its metrics may jump at once: the controller's spike rules then compare each metric only with the reports since the last one, as for trainguard_trainable_elements.", scope=JOB),
    _g("trainguard_optimizer_class", "1", "A code of the optimizer's class (the CRC-32 of its module and name; a ZeroRedundancyOptimizer's names the optimizer it steps too): it changes when the run switches optimizer (Adam to SGD, or back) and attaches the agent to the new one, and the controller's spike rules then compare each metric only with the reports since the switch, as for trainguard_trainable_elements.", scope=JOB),
    _g("trainguard_applied_generation", "1", "Generation of the controller's desired state applied (by every rank at the same step).", scope=JOB),
    _g("trainguard_agent_controller_up", "1", "1 when the last exchange with the controller succeeded, else 0 (rank 0 talks to the controller for the run).", scope=JOB),
    _c("trainguard_agent_reports_dropped_total", "reports", "Reports dropped because the send buffer was full (oldest first).", scope=JOB),
    _c("trainguard_agent_cross_rank_lightened_total", "reports", "Reports the leader sent without their cross-rank comparisons (data overlap, fingerprints) because its cross-rank worker fell behind the reports (the per-rank values still went). Absent with one rank.", scope=JOB),
    _c("trainguard_agent_cross_rank_dropped_total", "reports", "Reports the leader dropped because its cross-rank worker fell behind the reports even in the light form. Absent with one rank.", scope=JOB),
    _c("trainguard_skipped_steps_total", "steps", "Optimizer steps not taken on any rank, by reason: nonfinite (a NaN/Inf gradient on some rank), spike (the gradient norm far above its recent values) or data (the controller found the batches' data at fault and every rank skipped their steps, the LR untouched).", ("reason",), scope=JOB),
    _g("trainguard_consecutive_skipped_steps", "steps", "Optimizer steps skipped in a row by the spike guard, up to the step in progress; skipping that goes on means skipping alone is not fixing the run.", scope=JOB),
    _g("trainguard_snapshot_step", "steps", "Step of the newest in-memory snapshot of the training state a rollback can restore (absent without snapshots)."),
    _c("trainguard_rollbacks_total", "rollbacks", "Rollbacks to an in-memory snapshot carried out on this rank."),
    _g("trainguard_accumulation_steps", "micro-batches", "Gradient accumulation steps per optimizer step in force (on every rank; runs that let the controller change them; the LR follows by the command's rule).", scope=JOB),
    _g("trainguard_grad_clip_norm", "1", "Global gradient norm (over all shards) the controller's grad_clip command clips to before each optimizer step, on top of the run's own clipping; 0 when off.", scope=JOB),
    _c("trainguard_optimizer_resets_total", "resets", "Optimizer state resets (reset_optimizer commands) carried out (by every rank at the same step): the moments and step counts of the named layers started afresh.", scope=JOB),
    _g("trainguard_optimizer_reset_parameters", "parameters", "Parameters whose optimizer state the last reset_optimizer command dropped on this rank."),
    _g("trainguard_momentum_scale", "1", "Multiplier the controller applies to the optimizer's own momentum (Adam-style beta1, SGD momentum; held at most 0.999) during each step.", scope=JOB),
    _g("trainguard_weight_decay_scale", "1", "Multiplier the controller applies to the optimizer's own weight decay during each step.", scope=JOB),
)

#: Input metrics: what feeds the model and how much of it per step (``trainer_agent/measure/inputs.py``,
#: ``trainer_agent/data/sharded_dataset.py``, ``trainer_agent/measure/batch_size.py``; the stability guide, 3.3 and 4.2).
INPUT_METRICS: tuple[MetricSpec, ...] = (
    _g("trainguard_input_wait_seconds", "seconds", "Mean time per step this rank waited for its batch over the steps since the previous report: from the end of one end_step to the first forward pass of the model after it (loader, collation, host-to-device copy). High on one rank only: that rank is held back by its data, not its computation."),
    _g("trainguard_input_prefetch_depth", "batches", "Batches the token loader has ready ahead of the training loop (its prefetch queue) when scraped; 0 means the loop is waiting for data. Only with trainguard's TokenLoader."),
    _g("trainguard_input_tokens_per_second", "tokens/s", "Non-padding tokens the training loop received from the token loader per second, between two reads of this value. Only with trainguard's TokenLoader."),
    _g("trainguard_global_batch_size", "tokens or micro-batches", "The step's global batch size in the noise scale's unit: tokens passed to end_step x ranks, or (without tokens=) backward passes x ranks.", scope=JOB),
    _g("trainguard_recommended_batch_size", "tokens or micro-batches", "Recommended global batch size: the running gradient noise scale, ratio of the moving averages (decay 0.95 per report) of tr(Sigma) and of |G|^2 (McCandlish et al. 2018: beyond it a larger batch buys little progress per step; below it steps are noise-dominated). Same unit as trainguard_grad_noise_scale.", scope=JOB),
)

AGENT_METRICS: tuple[MetricSpec, ...] = STEP_METRICS + DATA_METRICS + CONTROL_METRICS + INPUT_METRICS

BY_NAME: dict[str, MetricSpec] = {m.name: m for m in AGENT_METRICS}
assert len(BY_NAME) == len(AGENT_METRICS), "duplicate metric name in the catalogue"

#: The job values that change when a run changes by its own plan: the elements that train (freezing
#: or unfreezing part of the model), the optimizer's class (a switch, Adam to SGD) and the changes
#: the user marked (``Agent.run_changed``: a new loss weight). Before such a change a metric was
#: another run's: the controller's spike rules and its recovery's healthy levels start afresh there.
RUN_CHANGE_MARKERS: tuple[str, ...] = ("trainguard_trainable_elements", "trainguard_optimizer_class",
                                       "trainguard_run_changes_total")
assert set(RUN_CHANGE_MARKERS) <= BY_NAME.keys()


def spec(name: str) -> MetricSpec:
    """The catalogue entry of ``name``; ``ValueError`` for a name the agent does not export."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown trainguard metric {name!r}") from None


def exported_scopes(rank: int, *, job_metrics: str = "rank0", per_layer: str = "rank0") -> frozenset[Scope]:
    """The scopes whose metrics rank ``rank`` serves on its ``/metrics``: its own (``rank``)
    always; the job's on rank 0, the leader, or everywhere with ``job_metrics="all"``; the
    per-layer series as ``per_layer`` says (``"rank0"``, ``"all"``, ``"off"``: the values of
    ``AgentConfig``'s fields of these names). ``ValueError`` for another value."""
    if job_metrics not in ("rank0", "all"):
        raise ValueError(f"job_metrics must be 'rank0' or 'all', got {job_metrics!r}")
    if per_layer not in ("rank0", "all", "off"):
        raise ValueError(f"per_layer must be 'rank0', 'all' or 'off', got {per_layer!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be an int >= 0, got {rank!r}")
    scopes = {RANK}
    if rank == 0 or job_metrics == "all":
        scopes.add(JOB)
    if per_layer == "all" or (per_layer == "rank0" and rank == 0):
        scopes.add(LAYER)
    return frozenset(scopes)


def _series_of(m: MetricSpec, counts: dict[str, int]) -> int:
    n = len(m.series)
    for label in m.labels:
        n *= counts[label]
    return n


def series_per_rank(rank: int, *, layers: int, param_groups: int = 1, job_metrics: str = "rank0",
                    per_layer: str = "rank0", names: Iterable[str] | None = None) -> int:
    """Series rank ``rank``'s ``/metrics`` serves when every metric of ``names`` (default: the
    whole catalogue, an upper bound: GPU health, the data monitor, the token loader, the
    communication timing, a GradScaler, snapshots and the controller all present) has a value:
    a labelled metric counts one series per value of its labels (``layers`` layers,
    ``param_groups`` optimizer param groups, :data:`LABEL_VALUES`). ``ValueError`` for a name the
    catalogue does not list or a negative count."""
    if layers < 0 or param_groups < 0:
        raise ValueError(f"layers and param_groups must be >= 0, got {layers} and {param_groups}")
    scopes = exported_scopes(rank, job_metrics=job_metrics, per_layer=per_layer)
    metrics = AGENT_METRICS if names is None else [spec(n) for n in set(names)]
    counts = {"layer": layers, "group": param_groups, **{k: len(v) for k, v in LABEL_VALUES.items()},
              **dict.fromkeys(ONE_AT_A_TIME, 1)}
    return sum(_series_of(m, counts) for m in metrics if m.scope in scopes)


def series_per_job(world_size: int, *, layers: int, param_groups: int = 1, job_metrics: str = "rank0",
                   per_layer: str = "rank0", names: Iterable[str] | None = None) -> int:
    """Series the ``/metrics`` of all ``world_size`` ranks of one job serve together: the
    leader's :func:`series_per_rank` plus ``world_size - 1`` times another rank's."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    names = None if names is None else tuple(names)
    kw = dict(layers=layers, param_groups=param_groups, job_metrics=job_metrics, per_layer=per_layer, names=names)
    others = series_per_rank(1, **kw) if world_size > 1 else 0
    return series_per_rank(0, **kw) + (world_size - 1) * others
