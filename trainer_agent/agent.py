"""The training agent: step metrics measured on the device, read by the host once per report.

    agent = attach(model, optimizer, job="llm-7b", run="llm-7b-0001", scaler=scaler)
    for batch in loader:
        agent.observe_batch(batch["input_ids"])        # optional, data quality
        loss = model(**batch).loss
        scaler.scale(loss).backward()                  # (1) backward-end callback
        scaler.unscale_(optimizer); clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)                         # (2) optimizer step pre/post hooks
        scaler.update(); optimizer.zero_grad()
        agent.end_step(loss, tokens=batch["input_ids"].numel())   # (3)

Where each metric is measured (metric names, units and formulas: ``trainguard/protocol/catalog.py``):

(1) **End of every backward pass** (an autograd engine callback queued by the first gradient hook
    of the pass; it runs after DDP has finished its all-reduce): per-tensor norms of the
    accumulated gradients, so the last backward before ``optimizer.step`` gives ``grad_norm``
    *before* any clipping the user does afterwards, divided by the GradScaler's scale.
    For the gradient noise scale, per-parameter gradient hooks measure the incoming gradient of
    every further backward pass of the step (the first one equals the accumulated gradient);
    under data parallelism every pass is measured there, before the all-reduce. Those hooks are
    on the parameters only for the report steps (the noise scale is a report step's) and the
    verifier's armed step; an ordinary step runs one hook per layer, which queues the callback
    (``step_stats.GradHooks``), so its host work does not grow with the tensor count.
(2) **Optimizer step hooks** (``register_step_pre_hook``/``register_step_post_hook``): the LR
    each param group actually used; the weights before the step are copied into one reusable
    buffer (``AgentConfig.update_ratio``), and one pass over it and the new weights gives
    ``||W_before - W_after||`` (``update_ratio``, ``effective_lr``, per-layer update ratio) and
    the parameter norms (``stats.update_sq_norms``). A GradScaler that skips the step skips these
    hooks: ``end_step`` counts the step in ``trainguard_amp_skipped_steps_total`` (no device read
    needed to know it).
(3) **end_step**: the step's (loss, gradient norm) row of the report interval, step time and
    tokens/s; on a report step (``ReportSchedule.is_report``) the interval's rows give the
    non-finite accounting, every rank enters the report step's one collective (its row of
    per-rank values, and the controller's desired state), and all device values are concatenated
    into one float64 vector and copied to the host — on CUDA with a non-blocking copy into pinned
    memory, read at a later ``end_step`` once the copy's event has completed.
(4) **Forward hooks** on the model: the wall time inside forward on report steps
    (``trainguard_forward_seconds``, ``trainer_agent/measure/forward_timer.py``), and the time each step
    waited for its batch, from the end of ``end_step`` to the next forward
    (``trainguard_input_wait_seconds``, ``trainer_agent/measure/inputs.py``).

Modules: ``params`` (parameter buckets and layers), ``step_stats`` (the hook bodies of (1) and
(2)), ``report`` (the report pipeline of (3)), ``ranks`` (the report step's collective),
``schedule`` (which steps report), ``forward_timer`` and ``inputs`` (4), ``data_relay`` (data
quality; its sketch of the sequences seen rides in the report step's row, ``sketch``),
``batch_size`` (the recommended batch size from the noise scale), ``control``, ``actuators``,
``spike_guard`` and ``snapshots`` (acting for the controller, skipping spikes, rolling back),
``client`` (HTTP). This module is the
facade that wires them, registers the hooks, times them and keeps their errors out of the loop.

Host work per step (what a launch-bound GPU step feels): the parameters are ordered once, at
attach, bucket after bucket of one (device, dtype), so every reduction over them is one fused
``torch._foreach_*`` call per bucket and its results line up with the per-layer index without a
scatter; a step that is not a report step issues about 10 operators (``bench/agent_overhead.py``
prints the count per configuration). The optimizer hooks run under ``torch.no_grad()`` (the
optimizer's own ``no_grad`` does not cover its hooks). On the CPU, memory bandwidth is the cost:
the update pass works in cache-sized chunks and, when the next step is measured too, leaves
``W_after`` in the snapshot so that step needs no copy (see ``AgentConfig.update_ratio``).

Gradient noise scale (``trainguard_grad_noise_scale``, ``trainguard_grad_variance``): the
estimator of McCandlish et al. 2018, appendix A.1, in ``stats.noise_scale``. The small batches
are the micro-batches of the step on every rank (``k`` backward passes per rank, ``W`` ranks,
``n = k W`` small gradients, the incoming gradients ``h_j`` seen by the gradient hooks), the big
batch is the whole step (the accumulated, all-reduced gradient ``H``): |G_small|^2 =
k^2 mean_j ||h_j||^2 and |G_big|^2 = ||H||^2, both divided by the loss scale^2. A loss divided by
``k`` or not, and any loss scale, multiply both alike, so B_simple does not change; it is in
tokens when ``end_step`` gets ``tokens`` (b = tokens / k per micro-batch), else in micro-batches.
tr(Sigma) is in units of ``trainguard_grad_norm``^2 x those. DDP's averaging all-reduce is
assumed. Absent with one micro-batch on one rank, and with sharded parameters (FSDP2, HSDP,
tensor parallel), where no rank sees a full incoming gradient per micro-batch: absent rather than
wrong.

Sharded and parallel parameters (DTensors: FSDP2's ``fully_shard``, HSDP, tensor parallel, and
their combinations): every step value is measured on the local shards and the report step adds
the ranks' shares up in one ``all_reduce`` (``trainer_agent/measure/sharding.py``), so ``grad_norm``
equals ``clip_grad_norm_``'s total norm and every per-layer value is the global one. FSDP2 sets
the sharded gradients without running their tensor hooks, so a hook on the model's output starts
the end-of-backward measurement.

Host-device synchronisation happens only where a comment says ``SYNC``. The ``/metrics``
collector and ``latest()`` read host values only (``latest()`` may wait for a report copy that is
still in flight; that is its one sync point).

The agent never raises into the training loop: an internal error is logged once per kind, counted
in ``trainguard_agent_errors_total``, and training goes on.
"""

from __future__ import annotations

import functools
import math
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from prometheus_client.registry import CollectorRegistry
from pydantic import TypeAdapter, ValidationError
from torch import nn

from trainguard.protocol.catalog import exported_scopes
from trainguard.protocol.wire import Name
from trainer_agent.measure import flops, optim
from trainer_agent.config import AgentConfig
from trainer_agent.data.relay import DataRelay
from trainer_agent.report.exporter import AgentCollector, MetricsServer, UnknownValues
from trainer_agent.measure.batch_size import BatchSizeAdvisor
from trainer_agent.measure.fingerprint import DesyncFinding, for_ranks
from trainer_agent.measure.comm_timing import CommTiming
from trainer_agent.measure.forward_timer import ForwardTimer
from trainer_agent.measure.inputs import InputWait
from trainer_agent.measure.params import ParamIndex
from trainer_agent.diagnostics.preflight import PREFLIGHT_ONLY_ENV, PreflightOnly
from trainer_agent.report.exchange import RANK_FIELDS, RankExchange
from trainer_agent.report.pipeline import HostStep, RankVectors, ReportPipeline
from trainer_agent.measure.schedule import ReportSchedule, ScheduledLr
from trainer_agent.control.snapshots import SnapshotBackend, SnapshotStore
from trainer_agent.measure.step_stats import GradHooks, StepMeter

__all__ = ["Agent", "attach", "RANK_FIELDS"]

log = logging.getLogger(__name__)

_NAME = TypeAdapter(Name)


class Agent:
    """Measures a training loop and exports the results; see the module docstring.

    Attributes for the control plane and for tests:

    - ``step``: optimizer steps completed (``end_step`` calls).
    - ``grad_norm_device``: 0-dim float64 device tensor, the pre-clip global gradient norm of the
      step in progress (set at the end of each backward pass, so it is valid in
      ``before_optimizer_step``), or ``None`` before the first backward of the step. With sharded
      parameters (DTensors) it is the norm of this rank's shards only (finite exactly when they
      are); the global norm is formed at the report, with no collective inside the step.
    - ``loss_device``: 0-dim float64 device tensor of the loss of the last ``end_step``.
    - ``step_finite_device``: 0-dim bool device tensor, loss and gradients of the last ``end_step``
      were finite.
    - ``rank_values``: on the leader (rank 0), ``{field: [value of rank 0, rank 1, ...]}`` for
      ``RANK_FIELDS`` (and the fingerprint and data-overlap vectors), gathered at the last
      published report; on any other rank, ``{field: [its own value]}`` (lists of one: a rank
      keeps no other rank's values).
    - ``overhead_seconds_total``: wall time spent inside the agent since attach.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        job: str,
        run: str,
        config: AgentConfig,
        scaler: Any = None,
        lr_scheduler: Any = None,
        data_monitor: Any = None,
        on_checkpoint: Callable[..., Any] | None = None,
        snapshot_backend: SnapshotBackend | None = None,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.perf_counter,
        accumulation_steps: int | None = None,
    ) -> None:
        if accumulation_steps is not None and (type(accumulation_steps) is not int or accumulation_steps < 1):
            raise ValueError(f"accumulation_steps must be a positive integer, got {accumulation_steps!r}")
        #: The run's own accumulation steps when it lets the controller change them (else None).
        self.accumulation_base = accumulation_steps
        self.batch_size_advisor = BatchSizeAdvisor()
        self._loader: Any = None
        self.input_wait: InputWait | None = None
        self.config, self.job, self.run = config, job, run
        self.model, self.optimizer, self.scaler, self.lr_scheduler = model, optimizer, scaler, lr_scheduler
        self._clock = clock
        self._lock = threading.Lock()
        self._errors = 0
        self._logged_kinds: set[str] = set()
        self._unknown_values = UnknownValues(self._error)  # a value the catalogue lacks: one error each
        self._closed = False
        if dist.is_available() and dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        else:
            self.rank, self.world_size = 0, 1
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank if self.world_size > 1 else 0))
        self.step = 0
        self.loss_device: torch.Tensor | None = None
        self.overhead_seconds_total = 0.0
        self._step_overhead = 0.0
        self._last_end = clock()
        self._step_row: torch.Tensor | None = None
        self._amp_skipped = 0
        self._published: dict[str, float] = {}
        #: What the user's scheduler asked for at each step taken (read before lr_scale applies).
        self.scheduled_lr = ScheduledLr()
        self.control: Any = None
        self._memory_trace: Any = None
        #: Under ``trainguard preflight``: the script stops at its pre-flight, and never trains.
        self._preflight_only = os.environ.get(PREFLIGHT_ONLY_ENV, "") not in ("", "0")
        self.verifier: Any = None  # trainer_agent/diagnostics/verify.py, built with the measurement
        #: The last memory trace's owners of retained memory, worst first (``trace_memory``).
        self.memory_report: list[Any] | None = None
        self.snapshots: SnapshotStore | None = None
        if config.snapshot_every is not None:
            self.snapshots = SnapshotStore(model, optimizer, every=config.snapshot_every, keep=config.snapshot_keep,
                                           extra_state=self._snapshot_extra, load_extra=self._load_snapshot_extra,
                                           backend=snapshot_backend)
        elif snapshot_backend is not None:
            raise ValueError("snapshot_backend needs AgentConfig(snapshot_every=N)")
        self._server: MetricsServer | None = None
        self._handles: list[Any] = []
        self.forward: ForwardTimer | None = None
        self.comm: CommTiming | None = None  # AgentConfig.comm_timing (trainer_agent/measure/comm_timing.py)
        self.schedule = ReportSchedule(config.report_every, config.sync_every)
        self._build_measurement(model, optimizer)
        self.data = DataRelay.build(data_monitor, config, self._error)
        self.gpu = None  # GPU health via NVML, read at scrape time (trainer_agent/measure/gpu_health.py)
        if self.device.type == "cuda":
            from trainer_agent.measure.gpu_health import GpuHealth

            self.gpu = GpuHealth.open(self.device.index if self.device.index is not None else torch.cuda.current_device())
        self.registry = registry if registry is not None else CollectorRegistry()
        # A rank serves its own values; the job's (the same on every rank) only where the config says.
        scopes = exported_scopes(self.rank, job_metrics=config.job_metrics, per_layer=config.per_layer)
        self._collector = AgentCollector(self._current_values, job=job, run=run, rank=self.rank, scopes=scopes)
        try:
            self._register_hooks(model, optimizer)
            self._start_export()
            if config.controller is not None or config.skips_steps:
                # Built last: it registers this rank's /metrics endpoint, and a restarted run that the
                # controller holds paused waits in here, before its first step, with /metrics served.
                self.control = self._build_control(on_checkpoint)
        except BaseException:
            # A refused configuration or registry leaves no hooks, thread or port behind.
            self.close()
            raise

    # ------------------------------------------------------------------ wiring

    def _build_measurement(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        cfg = self.config
        self.params = ParamIndex(model, optimizer, cfg.layer_depth)
        self.device = self.params.device
        self.layers = self.params.layers
        self.meter = StepMeter(self.params, cfg, self.schedule, scaler=self.scaler,
                               data_parallel=self.world_size > 1, step=lambda: self.step,
                               on_error=self._error, clock=self._clock)
        fingerprint = None
        # Fingerprints compare what every rank holds in full (data parallelism), or, with sharded
        # parameters, what the placements replicate: the local shards of the ranks that differ
        # only along Replicate mesh dimensions (HSDP's replicate dimension, TP's replicated norms).
        # Plain FSDP replicates nothing: no fingerprint.
        if cfg.fingerprint and self.world_size > 1:
            fingerprint = for_ranks(self.params, self.world_size)
            self.meter.fingerprint = fingerprint
        if self.params.sharding is None:  # a rank's shards are not a replica's gradient: no recompute check
            from trainer_agent.diagnostics.verify import GradientVerifier

            self.verifier = GradientVerifier(self, every=cfg.verify_every, rel_tol=cfg.verify_rel_tol)
            if cfg.verify_every == 1:
                self.verifier.arm()
        exchange = RankExchange(self.world_size, rank=self.rank,
                                with_state=cfg.controller is not None and self.world_size > 1,
                                extra_width=fingerprint.width() if fingerprint is not None else 0)
        per_layer = cfg.per_layer == "all" or (cfg.per_layer == "rank0" and self.rank == 0)
        self.reports = ReportPipeline(self.params, self.meter, exchange, optimizer=optimizer,
                                      report_every=cfg.report_every, grad_noise=self.meter.grad_noise,
                                      per_layer=per_layer, clock=self._clock, fingerprint=fingerprint,
                                      desync_rel_tol=cfg.desync_rel_tol, on_published=self._on_published,
                                      on_error=self._error)
        self.reports.mfu_per_token_rate = flops.mfu_per_token_rate(model, self.device, cfg.flops_per_token, cfg.peak_flops)

    def _register_hooks(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self._handles = [
            optimizer.register_step_pre_hook(self._pre_step),
            optimizer.register_step_post_hook(self._post_step),
        ]
        # One hook per layer on ordinary steps; every parameter only on the steps that read each
        # incoming gradient (``_sync_grad_hooks``).
        hooks = GradHooks(self.params.params, self.params.layer_ids.tolist(), self._sentinel_hook, self._grad_hook)
        self.meter.hooks = hooks
        self._handles.append(hooks)
        self._sync_grad_hooks()
        if self.params.sharding is not None:
            self._handles.append(model.register_forward_hook(self.meter.watch_output))
        self.forward = ForwardTimer(model, self.schedule, self.device, step=lambda: self.step,
                                    clock=self._clock, on_error=self._error)
        self._handles += self.forward.handles
        if self.config.comm_timing:
            self.comm = CommTiming(model, on_error=self._error, clock=self._clock)
            self._handles.append(self.comm)
        self.input_wait = InputWait(model, self._clock)
        self.registry.register(self._collector)

    def _start_export(self) -> None:
        cfg = self.config
        if cfg.metrics_port is None:
            return
        port = cfg.metrics_port + self.local_rank if cfg.metrics_port else 0
        if port > 65535:
            raise ValueError(f"metrics_port {cfg.metrics_port} + local rank {self.local_rank} is past "
                             f"65535: choose a lower base port")
        try:
            self._server = MetricsServer(self.registry, host=cfg.metrics_host, port=port)
        except OSError as exc:  # e.g. the host address cannot be bound: train without /metrics, say so
            self._error("metrics_server", exc)

    def _build_control(self, on_checkpoint: Callable[..., Any] | None) -> Any:
        from trainer_agent.control.plane import ControlContext, ControlPlane

        ctx = ControlContext(job=self.job, run=self.run, rank=self.rank, world_size=self.world_size,
                             local_rank=self.local_rank, config=self.config, schedule=self.schedule,
                             optimizer=self.optimizer, metrics_url=self.metrics_url,
                             step=lambda: self.step, grad_norm=self._grad_norm_before_step,
                             accumulation_steps=self.accumulation_base,
                             named_parameters=self.model.named_parameters)
        on_rollback = self.snapshots.restore if self.snapshots is not None else None
        return ControlPlane(ctx, on_checkpoint=on_checkpoint, on_rollback=on_rollback, on_error=self._error,
                            on_diagnose=self._diagnose, on_data_skip=self._quarantine_batch)

    def _quarantine_batch(self) -> None:
        """A step skipped for its data: the watched loader leaves the batch's samples out from now
        on, across a resume too (``TokenLoader.quarantine_last``)."""
        quarantine = getattr(self._loader, "quarantine_last", None)
        if quarantine is not None:
            quarantine()
        located = getattr(self._loader, "located_last", None)
        client = self.control.client if self.control is not None else None
        if located is not None and client is not None:  # the leader: the data incident names every rank's samples
            from trainguard.protocol.wire import QuarantinedSamples, QuarantineReport

            where = located()
            if where:
                client.post_quarantine(QuarantineReport(step=self.step, samples=[
                    QuarantinedSamples(shard=shard[-1024:], indices=idx) for shard, idx in list(where.items())[:256]]))

    def _snapshot_extra(self) -> dict[str, Any]:
        """What a snapshot holds besides the model and optimizer state."""
        guard = self._spike_guard()
        return {
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "spike_guard": guard.state_dict() if guard is not None else None,
        }

    def _load_snapshot_extra(self, extra: dict[str, Any]) -> None:
        if self.lr_scheduler is not None and extra["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        if self.scaler is not None and extra["scaler"] is not None:
            self.scaler.load_state_dict(extra["scaler"])
        guard = self._spike_guard()
        if guard is not None and extra["spike_guard"] is not None:
            guard.load_state_dict(extra["spike_guard"])
            guard.consecutive = 0  # the restored state is a healthy one

    def _grad_norm_before_step(self) -> Any:
        """The gradient norm the skip decision reads (``NonfiniteSkip``), before any hook of the
        step runs: the step's scheduled LR is recorded here too, so a step that is then skipped
        still shows what the schedule asked for."""
        try:
            self.scheduled_lr.observe(self.optimizer, self.step)
        except Exception as exc:
            self._error("scheduled_lr", exc)
        return self.meter.grad_norm

    def _spike_guard(self) -> Any:
        skip = getattr(self.control, "skip", None)
        return skip.guard if skip is not None else None

    def _diagnose(self, command: str, step: int) -> None:
        """The controller's diagnostic commands, applied at ``step`` on every rank."""
        if command in ("verify", "verify_float32"):
            if self.verifier is not None:
                self.verifier.arm(float32=command == "verify_float32")  # the next step, on every rank
        elif command == "memory_trace":
            self.trace_memory(self.config.memory_trace_steps)

    # ------------------------------------------------------------------ errors

    def _error(self, kind: str, exc: BaseException) -> None:
        with self._lock:
            self._errors += 1
            first = kind not in self._logged_kinds
            self._logged_kinds.add(kind)
        if first:
            log.warning("trainguard agent: %s failed; training goes on, further %s errors are only "
                        "counted in trainguard_agent_errors_total", kind, kind, exc_info=exc)

    # ------------------------------------------------------------------ (1) backward, (2) step hooks

    def _sync_grad_hooks(self) -> None:
        """Hook every parameter for the step in progress only when it reads every incoming
        gradient: the verifier's armed step, the noise scale's report step (``StepMeter``)."""
        hooks = self.meter.hooks
        if hooks is not None:
            verifier = self.verifier
            hooks.want((verifier is not None and verifier.armed) or self.meter.wants_every_grad())

    def _sentinel_hook(self, grad: torch.Tensor) -> None:
        verifier = self.verifier
        if verifier is not None and verifier.recomputing:
            return  # the agent's own recompute is not the step's
        self.meter.sentinel(grad)

    def _grad_hook(self, index: int, grad: torch.Tensor) -> None:
        t0 = self._clock()
        try:
            verifier = self.verifier
            if verifier is not None and verifier.armed:
                if verifier.recomputing:
                    return  # the agent's own recompute is not the step's
                verifier.on_grad(index, grad)
            self.meter.on_grad(index, grad)
        except Exception as exc:  # never raise into backward
            self._error("gradient_hook", exc)
        finally:
            self._step_overhead += self._clock() - t0

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> tuple | None:
        if self._preflight_only:  # ``trainguard preflight`` on a script that trains before any pre-flight
            raise PreflightOnly(None, self.rank)
        t0 = self._clock()
        replaced = None
        try:  # a closure's later evaluations (LBFGS) are not the step's: trainer_agent/measure/optim.py
            replaced = optim.with_step_closure(args, kwargs, functools.partial(optim.unmeasured, self.meter))
        except Exception as exc:
            self._error("optimizer_closure", exc)
        try:
            self.scheduled_lr.observe(optimizer, self.step)  # before lr_scale multiplies it below
        except Exception as exc:
            self._error("scheduled_lr", exc)
        if self.control is not None:
            try:
                self.control.before_optimizer_step()
            except Exception as exc:
                self._error("control_before_step", exc)
        try:
            with torch.no_grad():  # the hook runs outside the optimizer's no_grad: record no graph
                self.meter.before_step(optimizer)
        except Exception as exc:
            self._error("optimizer_pre_step", exc)
        finally:
            self._step_overhead += self._clock() - t0
        return replaced

    def _post_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        t0 = self._clock()
        try:
            with torch.no_grad():  # the hook runs outside the optimizer's no_grad: record no graph
                self.meter.after_step()
        except Exception as exc:
            self._error("optimizer_post_step", exc)
        finally:
            self._step_overhead += self._clock() - t0
        if self.verifier is not None:
            self.verifier.after_optimizer_step()
        if self.control is not None:
            try:
                self.control.after_optimizer_step()
            except Exception as exc:
                self._error("control_after_step", exc)

    # ------------------------------------------------------------------ data

    def observe_batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None:
        """Hand a batch of token ids to the data monitor (if any) without a host sync: the
        ``DataFeed`` copies device tensors non-blocking into pinned memory and a worker thread
        observes them; a bad batch (e.g. an id outside the vocabulary) is counted in
        ``trainguard_agent_errors_total``."""
        if self.data is None:
            return
        t0 = self._clock()
        try:
            self.data.submit(input_ids, attention_mask)
        except Exception as exc:
            self._error("data_monitor", exc)
        finally:
            self._step_overhead += self._clock() - t0

    # ------------------------------------------------------------------ (3) end of step

    def end_step(self, loss: torch.Tensor | float, tokens: int | None = None) -> None:
        """Close the optimizer step: call once per optimizer step, after ``optimizer.step()``
        (with accumulation: after the step that follows the last micro-batch). ``loss`` may be a
        device tensor (not read here) or a float; ``tokens`` is this rank's token count."""
        if self.snapshots is not None and self.snapshots.due(self.step + 1):
            # Before this step's report is built: the report names the snapshot of its own step.
            try:
                skip = getattr(self.control, "skip", None)
                self.snapshots.take_unless_skipped(self.step + 1, skip.skipped if skip is not None else 0)
            except Exception as exc:
                self._error("snapshot", exc)
        t0 = self._clock()
        agreed: list[int] | None = None
        try:
            with torch.no_grad():
                agreed = self._end_step(loss, tokens, t0)
        except Exception as exc:
            self._error("end_step", exc)
            agreed = self._join_exchange()
        finally:
            self.meter.reset()
            if self.forward is not None:
                self.forward.reset()
            self._step_overhead += self._clock() - t0 + self.meter.overhead
            self.overhead_seconds_total += self._step_overhead
            self._step_overhead = self.meter.overhead = 0.0
        if self._memory_trace is not None:
            try:
                if self._memory_trace.on_end_step():
                    self._memory_trace = None
            except Exception as exc:
                self._error("memory_trace", exc)
                self._memory_trace.stop()
                self._memory_trace = None
        if self.verifier is not None:
            try:
                self.verifier.on_end_step(self.step)
            except Exception as exc:
                self._error("verify", exc)
        if self.control is not None:
            try:
                self.control.on_end_step(self.step, agreed)
            except Exception as exc:
                self._error("control_end_step", exc)
        try:
            self._sync_grad_hooks()  # for the next step (the verifier or the controller may have armed it)
        except Exception as exc:
            self._error("gradient_hook", exc)
        if self.input_wait is not None:
            self.input_wait.step_ended()  # last: a pause above is not input wait

    def _end_step(self, loss: torch.Tensor | float, tokens: int | None, t0: float) -> list[int] | None:
        st = self.meter.state
        self.step += 1
        duration, self._last_end = t0 - self._last_end, t0
        if self.comm is not None:
            self.comm.step_ended(duration)
        if self.scaler is not None and self.scaler.is_enabled() and not st.stepped and st.backwards:
            self._amp_skipped += 1  # GradScaler.step skipped optimizer.step: inf/NaN gradients
        if isinstance(loss, torch.Tensor):
            loss_t = loss.detach().to(self.device, torch.float64)
            if loss_t.dim():
                loss_t = loss_t.reshape(())
        else:
            loss_t = torch.full((), float(loss), dtype=torch.float64, device=self.device)  # a fill, no copy
        self.loss_device = loss_t
        self._step_row = self.reports.record_step(self.step, loss_t, st.grad_share)
        self._publish()
        if not self.schedule.is_report(self.step):
            return None
        forward_s = self.forward.take() if self.forward is not None else float("nan")
        wait = self.input_wait.take() if self.input_wait is not None else float("nan")
        host = HostStep(self.step, duration, tokens, forward_s, self._amp_skipped, input_wait=wait,
                        micro_batches=st.backwards, world_size=self.world_size,
                        verify_mismatch=self.verifier.take() if self.verifier is not None else math.nan,
                        verify_float32=self.verifier.take_float32() if self.verifier is not None else math.nan,
                        gpu_xid=self._take_xid(), scheduled_lr=self.scheduled_lr.take(),
                        comm=self.comm.take() if self.comm is not None else {})
        overhead = self._step_overhead + self.meter.overhead + (self._clock() - t0)
        sketch = self._sketch() if self.reports.exchange.with_state else None
        agreed = self.reports.build(st, loss_t, host, overhead, self._proposal(), sketch)
        self._publish()
        return agreed

    def _take_xid(self) -> float:
        """The last XID error of this rank's GPU since the last report (NaN: none or no NVML)."""
        if self.gpu is None:
            return math.nan
        try:
            return self.gpu.take_xid()
        except Exception as exc:
            self._error("gpu_health", exc)
            return math.nan

    def _sketch(self) -> Any:
        """This rank's sketch of the sequences it observed since the last report (None without a
        data monitor); an error leaves it out (the rank's row still enters the collective)."""
        try:
            return self.data.take_sketch() if self.data is not None else None
        except Exception as exc:
            self._error("data_sketch", exc)
            return None

    def _proposal(self) -> list[int] | None:
        return self.control.proposal() if self.control is not None else None

    def _join_exchange(self) -> list[int] | None:
        """After an error in ``_end_step`` on a report step: enter the step's collective with a
        NaN row if it was not entered (see ``ReportPipeline.join_exchange``)."""
        if not self.schedule.is_report(self.step):
            return None
        try:
            return self.reports.join_exchange(self.step, self._proposal())
        except Exception as exc:
            self._error("end_step", exc)
            return None

    # ------------------------------------------------------------------ publication

    def _publish(self, block: bool = False) -> None:
        """Reports whose copy completed become host values (all of them with ``block``)."""
        self.reports.publish(block=block)

    def _on_published(self, values: dict[str, float], rank_values: Mapping[str, list[float]]) -> None:
        self._advise_batch_size(values)
        if self.data is not None:
            self.data.refresh()
        with self._lock:
            self._published = values
        if self.rank == 0:  # the cross-rank part: off the training thread (ReportPipeline.off_thread)
            current = self._current_values() if self.control is not None else values
            light = (lambda: self._on_ranks(current, rank_values.light())) if isinstance(rank_values, RankVectors) else None
            self.reports.off_thread(lambda: self._on_ranks(current, rank_values), light)

    def _on_ranks(self, values: dict[str, float], rank_values: Mapping[str, list[float]]) -> None:
        """Leader: a published report's every-rank part (on the cross-rank worker with several ranks)."""
        desync = getattr(rank_values, "desync", None) or []
        if desync:
            log.warning("trainguard: ranks disagree at step %d (relative difference above %g): %s",
                        int(values.get("trainguard_step", -1)), self.config.desync_rel_tol,
                        "; ".join(f"{d.kind} of layer {d.layer!r} on rank(s) {list(d.ranks)}: {d.rel_diff:.3g}"
                                  for d in desync[:8]))
        if self.control is not None:
            self.control.on_report(values, rank_values)

    def _advise_batch_size(self, values: dict[str, float]) -> None:
        """Feed the report's noise scale to the batch-size advisor; its running recommendation
        joins the report's values (host floats only)."""
        b = values.get("trainguard_grad_noise_scale")
        if b is not None:
            self.batch_size_advisor.update(b, values.get("trainguard_grad_variance", math.nan))
        recommended = self.batch_size_advisor.recommended()
        if not math.isnan(recommended):
            values["trainguard_recommended_batch_size"] = recommended

    def _current_values(self) -> dict[str, float]:
        """Host values only: called by the /metrics collector from the HTTP thread."""
        with self._lock:
            values = dict(self._published)
            errors = self._errors
        if self.data is not None:
            values.update(self.data.values)
            errors += self.data.errors
        if self.snapshots is not None:
            newest = self.snapshots.newest_step
            if newest is not None:
                values["trainguard_snapshot_step"] = float(newest)
            values["trainguard_rollbacks_total"] = float(self.snapshots.rollbacks)
        for kind, source in (("loader_values", self._loader), ("control_values", self.control)):
            if source is not None:
                try:
                    values.update(source.values())
                except Exception as exc:
                    self._error(kind, exc)
                    errors += 1
        if self.verifier is not None:
            values.update(self.verifier.values())
        values.update(self.reports.worker_values())
        if self.gpu is not None:
            try:
                values.update(self.gpu.read())
            except Exception as exc:
                self._error("gpu_health", exc)
                errors += 1
        values["trainguard_agent_errors_total"] = float(errors + self._unknown_values.check(values))
        return values

    # ------------------------------------------------------------------ public API

    @property
    def rank_values(self) -> dict[str, list[float]]:
        return self.reports.rank_values

    def preflight(self, batch: Any, loss_fn: Callable[[nn.Module, Any], Any] | None = None, *,
                  declared_params: int | None = None, clip_grad_norm: float | None | str = "unknown",
                  fatal: bool | tuple[str, ...] | None = None, loader: Any = None,
                  amp_dtype: torch.dtype | None = None, pad_id: int | None = None,
                  max_length: int | None = None) -> Any:
        """Run the pre-flight checks on ``batch`` before the first step (``trainer_agent/diagnostics/preflight.py``):
        one forward/backward and a simulated optimizer step that leave the weights, gradients,
        optimizer state, buffers and RNG states unchanged. ``loss_fn(model, batch)`` returns the
        loss (default: ``model(batch)``, or its ``.loss``); ``declared_params``: the model size the
        optimizer checks assume; ``clip_grad_norm``: what the loop clips to (None: no clipping).
        ``loader``: the loader the loop reads (its throughput and prefetch depth are checked, its
        position restored); ``amp_dtype``: the autocast dtype the loop trains in (float16 is
        assumed with an enabled GradScaler); ``pad_id`` / ``max_length``: the padding token and the
        longest sequence, for the loss-boundary inputs (``max_length`` defaults to the model
        config's). Sends the result to the controller (rank 0) and logs it; returns a ``PreflightReport``.
        ``fatal`` (default ``config.preflight_fatal``): ``RuntimeError`` for a failed check.
        Under ``trainguard preflight`` (``$TRAINGUARD_PREFLIGHT_ONLY``) raises ``PreflightOnly``
        after the checks: the script stops there, and the command prints the table.
        ``ValueError`` for bad arguments or after the first step."""
        from trainer_agent.diagnostics.preflight import raise_if_fatal, run_preflight, to_wire

        report = run_preflight(self, batch, loss_fn, declared_params=declared_params, clip_grad_norm=clip_grad_norm,
                               timeout=self.config.request_timeout_s, loader=loader, amp_dtype=amp_dtype,
                               pad_id=pad_id, max_length=max_length)
        client = self.control.client if self.control is not None else None
        if client is not None:
            why = client.post_preflight(to_wire(report, self.rank))
            if why is not None:
                log.warning("trainguard: the controller did not take the pre-flight result: %s", why)
        if self._preflight_only:
            raise PreflightOnly(report, self.rank)  # ``trainguard preflight``: the checks only
        raise_if_fatal(report, self.config.preflight_fatal if fatal is None else fatal)
        return report

    def verify_step(self, batch: Any, loss_fn: Callable[[nn.Module, Any], Any] | None = None) -> Any:
        """Call once per step after the backward pass(es) and before ``optimizer.step()``; when the
        step is due (``AgentConfig.verify_every``, ``request_verify``, the controller's ``verify``
        command) recompute its gradient on ``batch`` (the step's last micro-batch) and compare it
        with the one it produced (``trainer_agent/diagnostics/verify.py``); every rank calls it. ``loss_fn(model,
        batch)`` returns the loss the loop called ``backward`` on (inside the same autocast, divided
        by the accumulation steps if the loop does), before the GradScaler's scale (default
        ``model(batch)``, or its ``.loss``). Not under sharded parameters (always None). Returns a ``VerifyResult``, or None when the
        step is not due or the check failed (counted in ``trainguard_agent_errors_total``).
        Weights, gradients, optimizer state, buffers and the RNG stream are left as they were.
        ``ValueError`` when called after ``optimizer.step()`` of a due step."""
        verifier = self.verifier
        if verifier is None or not verifier.armed:
            return None
        t0 = self._clock()
        try:
            return verifier.verify(batch, loss_fn)
        except ValueError:
            raise
        except Exception as exc:
            self._error("verify", exc)
            return None
        finally:
            self._step_overhead += self._clock() - t0

    def request_verify(self, *, float32: bool = False) -> None:
        """Check the gradient of the next step whose forward pass starts after this call; call it
        on every rank at the same point of the loop. ``float32``: also recompute that step with
        mixed precision off and measure how far its gradient is from the step's
        (``trainguard_verify_float32_rel_diff``; ``trainer_agent/diagnostics/verify.py``)."""
        if self.verifier is not None:
            self.verifier.arm(float32=float32)
            self._sync_grad_hooks()

    def trace_memory(self, steps: int = 3) -> None:
        """Attribute memory retained across steps to the layers or the training loop for the next
        ``steps`` steps (``trainer_agent/diagnostics/memory_trace.py``; expensive while it runs). The result
        goes to the log and to ``memory_report``. ``ValueError`` for a bad ``steps``; a trace
        already running is replaced."""
        from trainer_agent.diagnostics.memory_trace import MemoryTrace

        if self._memory_trace is not None:
            self._memory_trace.stop()
        self.memory_report = None
        self._memory_trace = MemoryTrace(self.model, steps, self._memory_done, device=self.device)

    def _memory_done(self, report: list[Any]) -> None:
        self.memory_report = report
        log.warning("trainguard memory trace (rank %d): memory kept alive across steps, per step: %s", self.rank,
                    "; ".join(f"{r.owner}: {r.bytes_per_step / 2**20:.2f} MiB in {r.tensors} tensor(s)"
                              for r in report[:8]) or "nothing")
        client = self.control.client if self.control is not None else None
        if client is not None:  # the leader: the run's status and the memory_growth alert show it
            from trainguard.protocol.wire import MemoryOwnerEntry, MemoryReport

            trace = self._memory_trace
            forward = trace.cuda_forward if trace is not None else {}
            client.post_memory_report(MemoryReport(
                rank=self.rank, step=self.step, steps=trace.steps if trace is not None else 1,
                device="cuda" if self.device.type == "cuda" else "cpu",
                owners=[MemoryOwnerEntry(owner=r.owner[:512], bytes_per_step=r.bytes_per_step, tensors=r.tensors)
                        for r in report[:32]],
                allocator_growth_bytes_per_step=trace.cuda_growth_per_step if trace is not None else None,
                layer_forward_bytes=[MemoryOwnerEntry(owner=k[:512], bytes_per_step=max(v, 0.0), tensors=0)
                                     for k, v in list(forward.items())[:32]]))

    @property
    def desync(self) -> list[DesyncFinding]:
        """Layers whose gradient or parameter fingerprints differed across ranks by more than
        ``config.desync_rel_tol`` at the last published report (worst first; empty when in sync,
        with one rank, and on ranks other than the leader, which compares)."""
        return self.reports.desync

    @property
    def grad_norm_device(self) -> torch.Tensor | None:
        return self.meter.grad_norm

    @property
    def step_finite_device(self) -> torch.Tensor | None:
        """0-dim bool device tensor: the loss and gradient norm of the last ``end_step`` were
        finite (None before the first). Computed when read (two device ops, no sync)."""
        row = self._step_row
        return None if row is None else torch.isfinite(row).all()

    def latest(self) -> dict[str, float]:
        """``{sample key: value}`` as of the last reported step, plus the data-quality and
        control values and the live error count. Waits for a report still being copied."""
        try:
            self._publish(block=True)  # SYNC (CUDA): only if a report copy is still in flight
            if self.data is not None:
                self.data.refresh(flush=True)  # batches submitted so far (worker thread)
        except Exception as exc:
            self._error("publish", exc)
        return self._current_values()

    def watch_loader(self, loader: Any) -> None:
        """Export the reader metrics of ``loader`` (``trainer_agent.data.sharded_dataset.TokenLoader``, or
        anything with a thread-safe ``values()`` of catalogue metrics) with this rank's."""
        self._loader = _checked_loader(loader)

    @property
    def accumulation_steps(self) -> int | None:
        """Micro-batches per optimizer step the loop should run now: the run's own
        (``attach(accumulation_steps=...)``) until the controller's ``accumulation`` command
        changes it, at the same step on every rank (None when the run did not opt in)."""
        if self.control is not None and self.control.accumulation_steps is not None:
            return self.control.accumulation_steps
        return self.accumulation_base

    @property
    def metrics_url(self) -> str | None:
        """URL of this rank's ``/metrics``; None when ``metrics_port`` is None."""
        return self._server.url if self._server is not None else None

    @property
    def should_stop(self) -> bool:
        """True once the controller has asked this run to stop."""
        if self.control is None:
            return False
        try:
            return bool(self.control.should_stop)
        except Exception as exc:
            self._error("control_should_stop", exc)
            return False

    @property
    def exit_code(self) -> int:
        """The exit status the training script should end with once :attr:`should_stop`: 0, or
        ``EXIT_HARDWARE_FAULT`` (75) when the controller stopped the run because a node is faulty,
        so that torchrun, SLURM or Kubernetes restart it without that node (``sys.exit(agent.exit_code)``)."""
        try:
            return int(self.control.exit_code) if self.control is not None else 0
        except Exception as exc:
            self._error("control_should_stop", exc)
            return 0

    def state_dict(self) -> dict[str, Any]:
        """The agent's counters and control state, for the training checkpoint; with an
        ``lr_scheduler`` given to ``attach``, also its ``state_dict()`` (so that restoring the
        agent restores the schedule to the same step, e.g. when rolling back to a checkpoint)."""
        state: dict[str, Any] = {
            "version": 1,
            "step": self.step,
            # SYNC: checkpoint time only; reads one device scalar.
            "nonfinite_steps_total": float((self.reports.nonfinite_steps + self.reports.interval_nonfinite()).item()),
            "amp_skipped_steps_total": self._amp_skipped,
        }
        if self.control is not None:
            state["control"] = self.control.state_dict()
        if self.lr_scheduler is not None:
            state["lr_scheduler"] = self.lr_scheduler.state_dict()
        state["scheduled_lr"] = self.scheduled_lr.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned; ``ValueError`` for a foreign dict."""
        if not isinstance(state, Mapping) or state.get("version") != 1:
            raise ValueError("not a trainguard agent state dict (version 1)")
        try:
            step = int(state["step"])
            nonfinite = float(state["nonfinite_steps_total"])
            skipped = int(state["amp_skipped_steps_total"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed trainguard agent state dict: {exc}") from None
        if step < 0 or skipped < 0 or not nonfinite >= 0:
            raise ValueError("malformed trainguard agent state dict: negative counters")
        self.step = step
        self.reports.nonfinite_steps.fill_(nonfinite)
        self.reports.interval.zero_()  # steps before the restore are not part of the restored run
        self._amp_skipped = skipped
        if self.control is not None and "control" in state:
            self.control.load_state_dict(state["control"])
        if self.lr_scheduler is not None and "lr_scheduler" in state:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if "scheduled_lr" in state:  # (older checkpoints lack it: the envelope starts afresh)
            self.scheduled_lr.load_state_dict(state["scheduled_lr"])

    def close(self, timeout: float | None = None) -> None:
        """Publish the last report, remove the hooks, stop the control plane and the /metrics
        server. Returns within about ``timeout`` seconds (default ``config.close_timeout_s``),
        plus the time a snapshot backend's ``close()`` (if it has one) takes to finish a pending
        write."""
        if self._closed:
            return
        self._closed = True
        if self._memory_trace is not None:
            self._memory_trace.stop()
            self._memory_trace = None
        if self.verifier is not None:
            self.verifier.close()
        if self.gpu is not None:
            self.gpu.close()
        deadline = time.monotonic() + (self.config.close_timeout_s if timeout is None else timeout)
        try:
            self._publish(block=True)  # SYNC: the last report
        except Exception as exc:
            self._error("publish", exc)
        self.reports.flush(max(0.0, deadline - time.monotonic()), stop=True)  # the leader's last reports go on
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.forward is not None:
            self.forward.remove()
        if self.input_wait is not None:
            self.input_wait.remove()
        if self.data is not None:
            self.data.close(max(0.0, deadline - time.monotonic()))
        backend = self.snapshots.backend if self.snapshots is not None else None
        if backend is not None and callable(getattr(backend, "close", None)):
            try:  # a pending snapshot write ends before the process (and its process group) does
                backend.close()
            except Exception as exc:
                self._error("snapshot_close", exc)
        if self.control is not None:
            try:
                self.control.close(max(0.0, deadline - time.monotonic()))
            except Exception as exc:
                self._error("control_close", exc)
        if self._server is not None:
            self._server.close(max(0.0, deadline - time.monotonic()))
        try:
            self.registry.unregister(self._collector)
        except KeyError:
            pass


def attach(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Any,
    *,
    job: str,
    run: str,
    scaler: Any = None,
    config: AgentConfig | None = None,
    lr_scheduler: Any = None,
    data_monitor: Any = None,
    on_checkpoint: Callable[..., Any] | None = None,
    snapshot_backend: SnapshotBackend | None = None,
    controller: str | None = None,
    token: str | None = None,
    registry: CollectorRegistry | None = None,
    loader: Any = None,
    accumulation_steps: int | None = None,
) -> Agent:
    """Attach an agent to ``model`` and ``optimizer``; see the module docstring.

    ``optimizer`` is a ``torch.optim.Optimizer`` or a framework's wrapper of one: accelerate's
    ``AcceleratedOptimizer`` (what the Hugging Face ``Trainer`` hands to callbacks), Lightning's
    ``LightningOptimizer``, or any object holding the real optimizer in ``.optimizer``. The agent
    hooks the real optimizer (``Agent.optimizer``), so steps through the wrapper are seen.
    ``optimizer.step(closure)`` is supported (trainer_agent/measure/optim.py): the step's gradient is the
    closure's first evaluation.

    ``controller``/``token`` override the config's. ``lr_scheduler`` (optional) is saved and
    restored with the agent's ``state_dict`` and with the in-memory snapshots a rollback restores
    (``AgentConfig.snapshot_every``; ``snapshot_backend`` keeps the model and optimizer state
    elsewhere than in host memory, see ``trainer_agent/control/snapshots.py``). ``loader``: a
    ``TokenLoader`` whose reader metrics (prefetch depth, tokens/s read) this rank exports.
    ``accumulation_steps``: the run's own micro-batches per optimizer step, given to let the
    controller change them (the loop then reads ``agent.accumulation_steps`` before each step).
    Mistakes in the arguments raise
    ``ValueError`` here, before training starts.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    optimizer = optim.unwrap_optimizer(optimizer)  # ValueError naming what was passed
    for what, value in (("job", job), ("run", run)):
        try:
            _NAME.validate_python(value)
        except ValidationError:
            raise ValueError(f"{what} must match [A-Za-z0-9][A-Za-z0-9._:-]{{0,127}}, got {value!r}") from None
    if scaler is not None and not (hasattr(scaler, "is_enabled") and hasattr(scaler, "step")):
        raise ValueError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
    if config is None:
        config = AgentConfig()
    elif not isinstance(config, AgentConfig):
        raise ValueError(f"config must be an AgentConfig, got {type(config).__name__}")
    if controller is not None or token is not None:
        config = replace(config, controller=controller if controller is not None else config.controller,
                         token=token if token is not None else config.token)
    if lr_scheduler is not None and not (hasattr(lr_scheduler, "state_dict") and hasattr(lr_scheduler, "load_state_dict")):
        raise ValueError(f"lr_scheduler must have state_dict() and load_state_dict(), got {type(lr_scheduler).__name__}")
    if data_monitor is not None and not (hasattr(data_monitor, "observe_batch") and hasattr(data_monitor, "values")):
        raise ValueError("data_monitor must have observe_batch() and values() (trainer_agent.DataMonitor)")
    if loader is not None:
        _checked_loader(loader)
    agent = Agent(model, optimizer, job=job, run=run, config=config, scaler=scaler,
                  lr_scheduler=lr_scheduler, data_monitor=data_monitor,
                  on_checkpoint=on_checkpoint, snapshot_backend=snapshot_backend,
                  registry=registry, accumulation_steps=accumulation_steps)
    if loader is not None:
        agent.watch_loader(loader)
    return agent


def _checked_loader(loader: Any) -> Any:
    if not callable(getattr(loader, "values", None)):
        raise ValueError(f"loader must have values() (trainer_agent.data.sharded_dataset.TokenLoader), got {type(loader).__name__}")
    return loader
