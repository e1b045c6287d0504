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
    needed to know it); a fused optimizer skips it in its own kernel (``optimizer.found_inf``,
    counted on the device), with its gradients still scaled in these hooks (``optim.applied_grad_scale``).
    A GradScaler not passed to ``attach`` is found here, at the first step it takes
    (``AgentHooks.find_scaler``).
(3) **end_step**: the step's (loss, gradient norm) row of the report interval, step time and
    tokens/s; on a report step (``ReportSchedule.is_report``) the interval's rows give the
    non-finite accounting, every rank enters the report step's one collective (its row of
    per-rank values, and the controller's desired state), and all device values are concatenated
    into one float64 vector and copied to the host — on CUDA with a non-blocking copy into pinned
    memory, read at a later ``end_step`` once the copy's event has completed.
(4) **Forward hooks** on the model: the wall time inside forward on report steps
    (``trainguard_forward_seconds``, ``trainer_agent/measure/forward_timer.py``), and the time each step
    waited for its batch, from the end of ``end_step`` to the next forward
    (``trainguard_input_wait_seconds``, ``trainer_agent/measure/inputs.py``). A copy of the model
    (an EMA, a reference model, ``torch.save(model)``) carries inert hooks in their place
    (``trainer_agent/measure/module_hooks.py``): it copies, and its forward passes are not measured.

Modules, by subpackage: ``measure/`` (``params``: parameter buckets and layers; ``step_stats``:
the hook bodies of (1) and (2), ``step_state``: what they learn; ``schedule``: which steps
report; ``forward_timer`` and ``inputs``: (4); ``sketch`` and ``fingerprint``: what the report
step's row carries; ``batch_size``: the recommended batch size from the noise scale), ``report/``
(the report pipeline of (3),
``exchange``: the report step's collective, ``client``: HTTP), ``data/`` (data quality; its sketch
of the sequences seen rides in the row), ``control/`` (acting for the controller: the agreement,
the actuators, ``spike_guard`` and ``snapshots``), ``diagnostics/`` (the recompute check, the
memory trace and the pre-flight). This module is the facade that wires them; ``agent_parts/``
holds its collaborators: ``wiring`` (what ``Agent.__init__`` builds), ``step_end`` (``end_step``
and the publication of reports), ``loop_control`` (accumulation, stop, checkpoint state),
``hooks`` (the hooks of (1), (2) and (4), timed, their errors kept out of the loop), ``export``
(``/metrics`` and the values it serves), ``diagnostic_calls`` (the loop's calls to the pre-flight, the
recompute check and the memory trace), ``diagnostics`` (the diagnostics run on
``train_parts.TrainParts``), ``errors`` (errors logged once per kind); ``measure/step_clock``
keeps the step count and the overhead accounting.

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
wrong. The incoming gradients' norms are a few fused calls per pass, not one per tensor, wherever
``.grad`` keeps them until the pass ends (``trainer_agent/measure/backward_pass.py``).

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

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from prometheus_client.registry import CollectorRegistry
from torch import nn

from trainer_agent.agent_parts.errors import ErrorLog
from trainer_agent.agent_parts.export import MetricsExport
from trainer_agent.agent_parts.hooks import AgentHooks
from trainer_agent.agent_parts.attach_args import checked_args, checked_loader
from trainer_agent.agent_parts.diagnostic_calls import DiagnosticCalls
from trainer_agent.agent_parts.loop_control import LoopControl
from trainer_agent.agent_parts.step_end import StepEnd
from trainer_agent.agent_parts.wiring import AgentWiring
from trainer_agent.config import MAX_TIMEOUT_S, AgentConfig
from trainer_agent.data.relay import DataRelay
from trainer_agent.measure.fingerprint import DesyncFinding
from trainer_agent.report.exchange import RANK_FIELDS
from trainer_agent.measure.schedule import ReportSchedule, ScheduledLr
from trainer_agent.control.snapshots import SnapshotBackend
from trainer_agent.measure.step_clock import StepClock

__all__ = ["Agent", "attach", "RANK_FIELDS"]


def _delegate(owner: str, name: str, *, writable: bool = False, doc: str | None = None) -> property:
    """``Agent.<attribute>``: a collaborator's, read (and with ``writable``, written) through."""
    put = (lambda self, value: setattr(getattr(self, owner), name, value)) if writable else None
    return property(lambda self: getattr(getattr(self, owner), name), put, doc=doc or f"``{owner}.{name}``")


class Agent(AgentWiring, StepEnd, LoopControl, DiagnosticCalls):
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


    step = _delegate("clock", "step", writable=True)
    overhead_seconds_total = _delegate("clock", "overhead_total")
    loss_device = _delegate("clock", "loss")
    model, optimizer, scaler = (_delegate("parts", n) for n in ("model", "optimizer", "scaler"))
    params, meter, device, layers = (_delegate("parts", n) for n in ("params", "meter", "device", "layers"))
    forward, comm, input_wait = (_delegate("hooks", n) for n in ("forward", "comm", "input_wait"))
    verifier = _delegate("diagnostics", "verifier")
    rank_values, grad_norm_device = _delegate("reports", "rank_values"), _delegate("meter", "grad_norm")
    memory_report = _delegate("diagnostics", "memory_report", doc="The last memory trace's owners of retained "
                              "memory, worst first (``trace_memory``).")
    gpu = _delegate("export", "gpu", writable=True, doc="GPU health via NVML, read at scrape time (gpu_health.py).")
    registry, batch_size_advisor = _delegate("export", "registry"), _delegate("export", "batch_size_advisor")
    metrics_url = _delegate("export", "url", doc="URL of this rank's ``/metrics``; None when ``metrics_port`` is None.")

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
        self.config, self.job, self.run, self.lr_scheduler = config, job, run, lr_scheduler
        self.errors = ErrorLog()
        self._closed = False
        if dist.is_available() and dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        else:
            self.rank, self.world_size = 0, 1
        self.clock = StepClock(clock)
        #: What the user's scheduler asked for at each step taken (read before lr_scale applies).
        self.scheduled_lr = ScheduledLr()
        self.control: Any = None
        self.snapshots = self._build_snapshots(model, optimizer, snapshot_backend)
        self.schedule = ReportSchedule(config.report_every, config.sync_every)
        self._build_measurement(model, optimizer, scaler)
        self.data = DataRelay.build(data_monitor, config, self.errors.error)
        if self.data is not None:  # its bad and dropped batches are agent errors too
            self.errors.count_also(lambda data=self.data: data.errors)
        self.export = MetricsExport(config, self.errors, registry, job=job, run=run, rank=self.rank,
                                    device=self.device, data=self.data, snapshots=self.snapshots,
                                    verifier=self.diagnostics.verifier, reports=self.reports)
        self.hooks = AgentHooks(self.parts.meter, self.clock, self.scheduled_lr, verifier=self.diagnostics.verifier,
                                on_error=self.errors.error, preflight_only=self.diagnostics.preflight_only,
                                rank=self.rank, on_scaler=self._adopt_scaler if scaler is None else None)
        try:
            self._start(on_checkpoint)
        except BaseException:
            # A refused configuration or registry leaves no hooks, thread or port behind.
            self.close()
            raise

    # The wiring: ``AgentWiring`` (agent_parts/wiring.py); (3) the end of step and the reports it
    # publishes: ``StepEnd`` (agent_parts/step_end.py); what the loop reads between steps and the
    # checkpoint state: ``LoopControl`` (agent_parts/loop_control.py).

    # ------------------------------------------------------------------ data

    def observe_batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None:
        """Hand a batch of token ids to the data monitor (if any) without a host sync: the
        ``DataFeed`` copies device tensors non-blocking into pinned memory and a worker thread
        observes them; a bad batch (e.g. an id outside the vocabulary) is counted in
        ``trainguard_agent_errors_total``."""
        if self.data is None:
            return
        clock = self.clock
        t0 = clock.now()
        try:
            self.data.submit(input_ids, attention_mask)
        except Exception as exc:
            self.errors.error("data_monitor", exc)
        finally:
            clock.overhead += clock.now() - t0

    # ------------------------------------------------------------------ public API

    @property
    def desync(self) -> list[DesyncFinding]:
        """Layers whose gradient or parameter fingerprints differed across ranks by more than
        ``config.desync_rel_tol`` at the last published report (worst first; empty when in sync,
        with one rank, and on ranks other than the leader, which compares)."""
        return self.reports.desync

    @property
    def step_finite_device(self) -> torch.Tensor | None:
        """0-dim bool device tensor: the loss and gradient norm of the last ``end_step`` were
        finite (None before the first). Computed when read (two device ops, no sync)."""
        row = self.clock.row
        return None if row is None else torch.isfinite(row).all()

    def latest(self) -> dict[str, float]:
        """``{sample key: value}`` as of the last reported step, plus the data-quality and
        control values, the live error count and, on the leader, the ranks' agreement of the last
        report its cross-rank work resolved: what ``/metrics`` serves. Waits for a report still
        being copied."""
        try:
            self.reports.publish(block=True)  # SYNC (CUDA): only if a report copy is still in flight
            if self.data is not None:
                self.data.refresh(flush=True)  # batches submitted so far (worker thread)
        except Exception as exc:
            self.errors.error("publish", exc)
        return self.export.scraped_values()

    def watch_loader(self, loader: Any) -> None:
        """Export the reader metrics of ``loader`` (``trainer_agent.data.sharded_dataset.TokenLoader``, or
        anything with a thread-safe ``values()`` of catalogue metrics) with this rank's."""
        self.export.loader = checked_loader(loader)

    def close(self, timeout: float | None = None) -> None:
        """Publish the last report, remove the hooks, stop the control plane and the /metrics
        server. Returns within about ``timeout`` seconds (default ``config.close_timeout_s``),
        plus the time a snapshot backend's ``close()`` (if it has one) takes to finish a pending
        write."""
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not 0 <= timeout <= MAX_TIMEOUT_S):
            raise ValueError(f"timeout must be None or a number of seconds in [0, {MAX_TIMEOUT_S:g}], got {timeout!r}")
        if self._closed:
            return
        self._closed = True
        self.diagnostics.close()
        if self.export.gpu is not None:
            self.export.gpu.close()
        deadline = time.monotonic() + (self.config.close_timeout_s if timeout is None else timeout)
        try:
            self.reports.publish(block=True)  # SYNC: the last report
        except Exception as exc:
            self.errors.error("publish", exc)
        self.reports.flush(max(0.0, deadline - time.monotonic()), stop=True)  # the leader's last reports go on
        self.hooks.remove()
        if self.data is not None:
            try:
                self.data.close(max(0.0, deadline - time.monotonic()))
            except Exception as exc:  # (the /metrics server below closes all the same)
                self.errors.error("data_close", exc)
        backend = self.snapshots.backend if self.snapshots is not None else None
        if backend is not None and callable(getattr(backend, "close", None)):
            try:  # a pending snapshot write ends before the process (and its process group) does
                backend.close()
            except Exception as exc:
                self.errors.error("snapshot_close", exc)
        if self.control is not None:
            try:
                self.control.close(max(0.0, deadline - time.monotonic()))
            except Exception as exc:
                self.errors.error("control_close", exc)
        self.export.close(max(0.0, deadline - time.monotonic()))


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
    optimizer, config = checked_args(model, optimizer, job=job, run=run, scaler=scaler, config=config,
                                     controller=controller, token=token, lr_scheduler=lr_scheduler,
                                     data_monitor=data_monitor, loader=loader)
    agent = Agent(model, optimizer, job=job, run=run, config=config, scaler=scaler,
                  lr_scheduler=lr_scheduler, data_monitor=data_monitor,
                  on_checkpoint=on_checkpoint, snapshot_backend=snapshot_backend,
                  registry=registry, accumulation_steps=accumulation_steps)
    if loader is not None:
        agent.watch_loader(loader)
    return agent

