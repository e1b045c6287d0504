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

Where each metric is measured (metric names, units and formulas: ``trainer_agent/catalog.py``):

(1) **End of every backward pass** (an autograd engine callback queued by the first gradient hook
    of the pass; it runs after DDP has finished its all-reduce): per-tensor norms of the
    accumulated gradients, so the last backward before ``optimizer.step`` gives ``grad_norm``
    *before* any clipping the user does afterwards, divided by the GradScaler's scale.
    For the gradient noise scale, per-parameter gradient hooks measure the incoming gradient of
    every further backward pass of the step (the first one equals the accumulated gradient);
    under data parallelism every pass is measured there, before the all-reduce.
(2) **Optimizer step hooks** (``register_step_pre_hook``/``register_step_post_hook``): the LR
    each param group actually used; the weights before the step are copied into one reusable
    buffer (``AgentConfig.update_ratio``), and one pass over it and the new weights gives
    ``||W_before - W_after||`` (``update_ratio``, ``effective_lr``, per-layer update ratio) and
    the parameter norms (``stats.update_sq_norms``). A GradScaler that skips the step skips these
    hooks: ``end_step`` counts the step in ``trainguard_amp_skipped_steps_total`` (no device read
    needed to know it).
(3) **end_step**: the step's (loss, gradient norm) row of the report interval, step time and
    tokens/s; on a report step (``step % report_every == 0``) the interval's rows give the
    non-finite accounting, and all device values are concatenated into one float64 vector and
    copied to the host — on CUDA with a non-blocking copy into pinned memory, read at a later
    ``end_step`` once the copy's event has completed.

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
assumed (sharded gradients, as under FSDP, are not supported). Absent with one micro-batch on
one rank.

Host-device synchronisation happens only where a comment says ``SYNC``. The ``/metrics``
collector and ``latest()`` read host values only (``latest()`` may wait for a report copy that is
still in flight; that is its one sync point).

The agent never raises into the training loop: an internal error is logged once per kind, counted
in ``trainguard_agent_errors_total``, and training goes on.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
import time
from collections import deque
from dataclasses import replace
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from prometheus_client.registry import CollectorRegistry
from pydantic import TypeAdapter, ValidationError
from torch import nn

from trainguard.protocol.wire import Name
from trainer_agent import stats
from trainer_agent.batch_size import BatchSizeAdvisor
from trainer_agent.config import AgentConfig
from trainer_agent.inputs import InputWait
from trainer_agent.exporter import AgentCollector, MetricsServer, sample_key

__all__ = ["Agent", "attach", "RANK_FIELDS"]

log = logging.getLogger(__name__)

#: Per-rank values gathered from every rank at each report step when ``world_size > 1``; on every
#: rank ``Agent.rank_values[field][r]`` is rank ``r``'s value of that report.
RANK_FIELDS: tuple[str, ...] = (
    "loss",
    "grad_norm",
    "micro_sq_sum",
    "micro_count",
    "nonfinite_steps_total",
    "step_duration_seconds",
    "tokens_per_second",
    "input_wait_seconds",
)

_NAME = TypeAdapter(Name)
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")
#: Reports whose device-to-host copy may be in flight at once (the host waits beyond that).
_MAX_IN_FLIGHT = 4
#: Incoming gradients the noise-scale hooks hold at most before norming them (bytes).
_HELD_GRAD_BYTES = 32 << 20


class _StepState:
    """What the hooks learn during one optimizer step; reset by ``end_step``."""

    __slots__ = (
        "backwards",
        "micro_norms",
        "grad_norms",
        "grad_norm",
        "grad_nonfinite",
        "scale",
        "stepped",
        "snapshot_taken",
        "before_sq",
        "delta_sq",
        "param_sq",
        "lrs",
    )

    def __init__(self) -> None:
        self.backwards = 0
        #: Per backward pass: ||incoming gradient|| over all parameters (float64 device scalar,
        #: times the loss scale).
        self.micro_norms: list[torch.Tensor] = []
        #: Per-parameter ||accumulated grad|| at the end of the last backward (float32/64 device
        #: vector in the agent's parameter order, times the loss scale; 0 without a gradient).
        self.grad_norms: torch.Tensor | None = None
        #: The step's global pre-clip gradient norm, unscaled (float64 device scalar).
        self.grad_norm: torch.Tensor | None = None
        self.grad_nonfinite: torch.Tensor | None = None
        #: Loss scale at the last backward (device scalar) or None without an enabled scaler.
        self.scale: torch.Tensor | None = None
        self.stepped = False
        self.snapshot_taken = False
        self.before_sq: torch.Tensor | None = None
        self.delta_sq: torch.Tensor | None = None
        self.param_sq: torch.Tensor | None = None
        #: LR per param group as used by the step (float, or a device tensor for tensor LRs).
        self.lrs: list[float | torch.Tensor] | None = None


class _Report:
    """One report in flight from the device to the host."""

    __slots__ = ("step", "keys", "buffer", "event", "host", "ranks")

    def __init__(self, step: int, keys: list[str], buffer: torch.Tensor, event: Any,
                 host: dict[str, float], ranks: int) -> None:
        self.step = step
        self.keys = keys
        self.buffer = buffer
        self.event = event
        self.host = host
        self.ranks = ranks

    def ready(self) -> bool:
        return self.event is None or self.event.query()


class Agent:
    """Measures a training loop and exports the results; see the module docstring.

    Attributes for the control plane (``trainer_agent/control.py``):

    - ``step``: optimizer steps completed (``end_step`` calls).
    - ``grad_norm_device``: 0-dim float64 device tensor, the pre-clip global gradient norm of the
      step in progress (set at the end of each backward pass, so it is valid in
      ``before_optimizer_step``), or ``None`` before the first backward of the step.
    - ``loss_device``: 0-dim float64 device tensor of the loss of the last ``end_step``.
    - ``step_finite_device``: 0-dim bool device tensor, loss and gradients of the last ``end_step``
      were finite.
    - ``rank_values``: ``{field: [value of rank 0, rank 1, ...]}`` for ``RANK_FIELDS``, gathered
      at the last published report (single rank: lists of one).
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
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.perf_counter,
        accumulation_steps: int | None = None,
    ) -> None:
        if accumulation_steps is not None and (type(accumulation_steps) is not int or accumulation_steps < 1):
            raise ValueError(f"accumulation_steps must be a positive integer, got {accumulation_steps!r}")
        #: The run's own accumulation steps when it lets the controller change them (else None).
        self.accumulation_base = accumulation_steps
        self.config = config
        self.job = job
        self.run = run
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler
        self.lr_scheduler = lr_scheduler
        self._clock = clock
        self._lock = threading.Lock()
        self._errors = 0
        self._logged_kinds: set[str] = set()
        self._closed = False

        if dist.is_available() and dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        else:
            self.rank, self.world_size = 0, 1
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank if self.world_size > 1 else 0))
        self._data_parallel = self.world_size > 1

        self._setup_params(model, optimizer)
        self._per_layer = config.per_layer == "all" or (config.per_layer == "rank0" and self.rank == 0)

        self.step = 0
        self.grad_norm_device: torch.Tensor | None = None
        self.loss_device: torch.Tensor | None = None
        self.rank_values: dict[str, list[float]] = {}
        self.overhead_seconds_total = 0.0
        # Non-finite steps before the current report interval (device scalar: no sync).
        self._nonfinite_steps = torch.zeros((), dtype=torch.float64, device=self.device)
        # One row per step of the report interval, (loss, pre-clip gradient norm or 0), on the
        # device: a step costs one small copy; the report derives from the rows the interval's
        # non-finite steps, its first non-finite loss (the loss the report then carries, so a NaN
        # between two reports is not lost) and its largest finite gradient norm. Zeroed (all
        # finite) after each report. 16 bytes per step of report_every.
        self._interval = torch.zeros(config.report_every, 2, dtype=torch.float64, device=self.device)
        self._zero = torch.zeros((), dtype=torch.float64, device=self.device)
        self._step_row: torch.Tensor | None = None
        self._scaled_grad_norm: torch.Tensor | None = None
        self._amp_skipped = 0
        self._snapshot: list[list[torch.Tensor]] | None = None  # per bucket, like _param_buckets
        # Version counters of the parameters when the CPU update pass last copied W_after into
        # the snapshot (None: the snapshot is not the current weights).
        self._snapshot_versions: tuple[int, ...] | None = None
        self._norm_cache: dict = {}
        self._param_sq_prev: tuple[torch.Tensor, tuple[int, ...]] | None = None
        self._state = _StepState()
        self._in_backward = False
        self._hook_norms: list[torch.Tensor] = []
        # Incoming gradients held for one fused norm per bucket (see _grad_hook), their bytes.
        self._held_grads: list[list[torch.Tensor]] = [[] for _ in self._param_buckets]
        self._held_bytes = 0
        self._bucket_of = [k for k, bucket in enumerate(self._param_buckets) for _ in bucket]
        self._step_overhead = 0.0
        self._last_end = clock()
        self._pending: deque[_Report] = deque()  # reports in flight, oldest first
        self._gathered_step = -1  # the step whose report entered the ranks' all-gather last
        self._layer_keys: dict[str, list[str]] = {}
        self._published: dict[str, float] = {}
        self._data_values: dict[str, float] = {}
        self.batch_size_advisor = BatchSizeAdvisor()
        self._loader: Any = None
        self._input_wait: InputWait | None = None

        self.data_monitor = data_monitor
        self._data_feed: Any = None
        if self.data_monitor is None and config.vocab_size is not None:
            from trainer_agent.data import DataMonitor

            self.data_monitor = DataMonitor(config.vocab_size, special_ids=config.special_ids)
        if self.data_monitor is not None:
            from trainer_agent.data import DataFeed

            self._data_feed = DataFeed(self.data_monitor)

        self.control: Any = None
        self._server: MetricsServer | None = None
        self._handles: list[Any] = []
        self.registry = registry if registry is not None else CollectorRegistry()
        self._collector = AgentCollector(self._current_values, job=job, run=run, rank=self.rank)
        try:
            self._handles = [
                optimizer.register_step_pre_hook(self._pre_step),
                optimizer.register_step_post_hook(self._post_step),
            ]
            self._handles += [p.register_hook(functools.partial(self._grad_hook, i)) for i, p in enumerate(self._params)]
            self.registry.register(self._collector)
            self._input_wait = InputWait(model, clock)
            if config.metrics_port is not None:
                port = config.metrics_port + self.local_rank if config.metrics_port else 0
                if port > 65535:
                    raise ValueError(f"metrics_port {config.metrics_port} + local rank {self.local_rank} is past "
                                     f"65535: choose a lower base port")
                try:
                    self._server = MetricsServer(self.registry, host=config.metrics_host, port=port)
                except OSError as exc:  # e.g. the port is taken: train without /metrics, say so
                    self._error("metrics_server", exc)

            if config.controller is not None or config.skip_nonfinite:
                from trainer_agent.control import ControlPlane

                # Built last: it registers this rank's /metrics endpoint, and a restarted run that the
                # controller holds paused waits in here, before its first step, with /metrics served.
                self.control = ControlPlane(agent=self, on_checkpoint=on_checkpoint, on_error=self._error)
        except BaseException:
            # A refused configuration or registry leaves no hooks, thread or port behind.
            self.close()
            raise

    # ------------------------------------------------------------------ setup

    def _setup_params(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        names = {id(p): n for n, p in model.named_parameters()}
        seen: set[int] = set()
        params: list[torch.Tensor] = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        if not params:
            raise ValueError("the optimizer holds no trainable parameter (requires_grad=True)")
        # Bucket after bucket of one (device, dtype): one fused call per bucket, every step.
        params = [params[i] for bucket in stats.buckets(params) for i in bucket]
        self._params = params
        self._param_buckets: list[list[torch.Tensor]] = []
        for p in params:
            if not self._param_buckets or (p.device, p.dtype) != (self._param_buckets[-1][0].device,
                                                                  self._param_buckets[-1][0].dtype):
                self._param_buckets.append([])
            self._param_buckets[-1].append(p)
        # Stand-in for a missing gradient (norm 0) that keeps its bucket's fused path.
        self._grad_zeros = [torch.zeros((), dtype=b[0].dtype, device=b[0].device) for b in self._param_buckets]
        self.device = params[0].device
        self._numel = sum(p.numel() for p in params)
        depth = self.config.layer_depth
        layers: dict[str, int] = {}
        ids = []
        for p in params:
            name = names.get(id(p), "unnamed")
            while name.startswith(_WRAPPER_PREFIXES):  # DDP / DataParallel / torch.compile wrappers
                name = name.split(".", 1)[1]
            module = name.rsplit(".", 1)[0] if "." in name else name
            layer = ".".join(module.split(".")[:depth])
            ids.append(layers.setdefault(layer, len(layers)))
        self.layers: list[str] = list(layers)
        self._layer_ids = torch.tensor(ids, dtype=torch.long, device=self.device)

    # ------------------------------------------------------------------ errors and timing

    def _error(self, kind: str, exc: BaseException) -> None:
        with self._lock:
            self._errors += 1
            first = kind not in self._logged_kinds
            self._logged_kinds.add(kind)
        if first:
            log.warning("trainguard agent: %s failed; training goes on, further %s errors are only "
                        "counted in trainguard_agent_errors_total", kind, kind, exc_info=exc)

    def _is_report(self, step: int) -> bool:
        return step % self.config.report_every == 0

    # ------------------------------------------------------------------ (1) backward

    def _grad_hook(self, index: int, grad: torch.Tensor) -> None:
        """Tensor hook of every trainable parameter (``index`` in ``_params``): sees the incoming
        gradient of one backward pass before it is accumulated into ``.grad`` (and before any
        DDP all-reduce).

        For the noise scale its norm is needed. When the parameter already holds a ``.grad``
        (accumulation into it, in place) the tensor is held and normed with the others of its
        bucket in one fused call, when ``_HELD_GRAD_BYTES`` are held or at the end of the pass:
        the extra memory is bounded by that. Into an empty ``.grad`` autograd moves the incoming
        tensor without a copy only if nothing else references it, so that one is normed at once.
        """
        t0 = self._clock()
        try:
            if not self._in_backward:
                self._in_backward = True
                self._hook_norms = []
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_end_outer)
            if self.config.grad_noise and (self._data_parallel or self._state.backwards >= 1):
                if self._params[index].grad is None:
                    self._hook_norms.append(torch.linalg.vector_norm(grad, dtype=stats.norm_dtype(grad.dtype)))
                else:
                    self._held_grads[self._bucket_of[index]].append(grad)
                    self._held_bytes += grad.numel() * grad.element_size()
                    if self._held_bytes >= _HELD_GRAD_BYTES:
                        self._norm_held_grads()
        except Exception as exc:  # never raise into backward
            self._error("gradient_hook", exc)
        finally:
            self._step_overhead += self._clock() - t0

    def _norm_held_grads(self) -> None:
        for held in self._held_grads:
            if held:
                self._hook_norms += torch._foreach_norm(held, 2, dtype=stats.norm_dtype(held[0].dtype))
        self._release_held_grads()

    def _release_held_grads(self) -> None:
        for held in self._held_grads:
            held.clear()
        self._held_bytes = 0

    def _backward_end_outer(self) -> None:
        # Re-queue, so that this runs after callbacks queued later in the same backward pass,
        # in particular DDP's, which finishes the gradient all-reduce.
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)
        except Exception as exc:
            self._in_backward = False
            self._error("backward_end", exc)

    def _backward_end(self) -> None:
        t0 = self._clock()
        try:
            self._in_backward = False
            self._norm_held_grads()
            st = self._state
            first = st.backwards == 0
            self._measure_grads(st)
            if self.config.grad_noise:
                if first and not self._data_parallel:
                    # The first backward of a step accumulates into zeroed gradients.
                    assert st.grad_norms is not None
                    st.micro_norms.append(self._scaled_grad_norm)
                elif self._hook_norms:
                    st.micro_norms.append(torch.linalg.vector_norm(torch.stack(self._hook_norms),
                                                                   dtype=torch.float64))
            st.backwards += 1
        except Exception as exc:
            self._error("backward_end", exc)
        finally:
            self._hook_norms = []
            self._release_held_grads()
            self._step_overhead += self._clock() - t0

    def _measure_grads(self, st: _StepState) -> None:
        """Per-tensor norms of the current ``.grad`` (and, on report steps, their non-finite
        element count) into ``st``; sets ``grad_norm_device``. One fused norm per bucket."""
        grads = [[p.grad if p.grad is not None else zero for p in bucket]
                 for bucket, zero in zip(self._param_buckets, self._grad_zeros)]
        st.grad_norms = stats.bucket_norms(grads, self.device)
        st.scale = self._scale_tensor()
        if self._is_report(self.step + 1):
            st.grad_nonfinite = stats.nonfinite_count([g for b in grads for g in b], self.device, st.grad_norms)
        self._scaled_grad_norm = torch.linalg.vector_norm(st.grad_norms, dtype=torch.float64)
        st.grad_norm = self.grad_norm_device = self._unscale(self._scaled_grad_norm, st.scale)

    def _scale_tensor(self) -> torch.Tensor | None:
        scaler = self.scaler
        if scaler is None or not scaler.is_enabled() or getattr(scaler, "_scale", None) is None:
            return None
        # GradScaler keeps its scale in the device tensor `_scale` (get_scale() would sync);
        # update() changes it in place, so keep a copy of the value the gradients carry.
        return scaler._scale.detach().to(self.device, torch.float64, copy=True).reshape(())

    @staticmethod
    def _unscale(value: torch.Tensor, scale: torch.Tensor | None, power: int = 1) -> torch.Tensor:
        return value if scale is None else value / scale**power

    # ------------------------------------------------------------------ (2) optimizer step

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        t0 = self._clock()
        if self.control is not None:
            try:
                self.control.before_optimizer_step()
            except Exception as exc:
                self._error("control_before_step", exc)
        try:
            with torch.no_grad():  # the hook runs outside the optimizer's no_grad: record no graph
                self._pre_step_measure(optimizer)
        except Exception as exc:
            self._error("optimizer_pre_step", exc)
        finally:
            self._step_overhead += self._clock() - t0

    def _pre_step_measure(self, optimizer: torch.optim.Optimizer) -> None:
        st = self._state
        st.lrs = [g["lr"].detach().clone() if isinstance(g["lr"], torch.Tensor) else float(g["lr"])
                  for g in optimizer.param_groups]
        if st.grad_norms is None:
            # No backward pass went through the agent's hooks (gradients set by hand):
            # measure what the optimizer is about to use.
            self._measure_grads(st)
        mode = self.config.update_ratio
        if mode == "every" or (mode == "report" and self._is_report(self.step + 1)):
            versions = self._versions()
            if self._snapshot is None:
                self._snapshot = [[torch.empty_like(p, memory_format=torch.contiguous_format) for p in b]
                                  for b in self._param_buckets]
            # The CPU update pass of a measured step leaves W_after in the snapshot: if no
            # parameter changed since (autograd's version counters, read on the host, count
            # in-place writes), it already holds W_before.
            if self._snapshot_versions != versions:
                for snap, bucket in zip(self._snapshot, self._param_buckets):
                    torch._foreach_copy_(snap, bucket)
            self._snapshot_versions = None  # the post-step hook consumes it
            st.snapshot_taken = True
            # ||W_before|| is the last measured ||W_after|| under the same condition.
            if self._param_sq_prev is not None and self._param_sq_prev[1] == versions:
                st.before_sq = self._param_sq_prev[0]

    def _post_step_measure(self) -> None:
        st = self._state
        st.stepped = True
        self._param_sq_prev = None
        if st.snapshot_taken:
            assert self._snapshot is not None
            # Refresh the snapshot with W_after when the next step is measured too.
            next_measured = self.config.update_ratio == "every" or self.config.report_every == 1
            st.delta_sq, st.param_sq, before_sq, refreshed = stats.update_sq_norms(
                self._snapshot, self._param_buckets, self.device, self._norm_cache,
                before_norms=st.before_sq is None, refresh=next_measured)
            if st.before_sq is None:
                st.before_sq = before_sq
            versions = self._versions()
            self._param_sq_prev = (st.param_sq, versions)
            self._snapshot_versions = versions if refreshed else None
        elif self._is_report(self.step + 1):
            st.param_sq = stats.bucket_norms(self._param_buckets, self.device).to(torch.float64).square()
            self._param_sq_prev = (st.param_sq, self._versions())

    def _versions(self) -> tuple[int, ...]:
        return tuple(p._version for p in self._params)

    def _post_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        t0 = self._clock()
        try:
            with torch.no_grad():  # the hook runs outside the optimizer's no_grad: record no graph
                self._post_step_measure()
        except Exception as exc:
            self._error("optimizer_post_step", exc)
        finally:
            self._step_overhead += self._clock() - t0
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
        if self._data_feed is None:
            return
        t0 = self._clock()
        try:
            self._data_feed.submit(input_ids, attention_mask)
        except Exception as exc:
            self._error("data_monitor", exc)
        finally:
            self._step_overhead += self._clock() - t0

    # ------------------------------------------------------------------ (3) end of step

    def end_step(self, loss: torch.Tensor | float, tokens: int | None = None) -> None:
        """Close the optimizer step: call once per optimizer step, after ``optimizer.step()``
        (with accumulation: after the step that follows the last micro-batch). ``loss`` may be a
        device tensor (not read here) or a float; ``tokens`` is this rank's token count."""
        t0 = self._clock()
        summary: dict[str, float] = {}
        try:
            with torch.no_grad():
                summary = self._end_step(loss, tokens, t0)
        except Exception as exc:
            self._error("end_step", exc)
            self._join_report_gather()
        finally:
            self._state = _StepState()
            self._in_backward = False
            self._release_held_grads()  # a backward pass that raised never reached its end
            self.grad_norm_device = None
            now = self._clock()
            self._step_overhead += now - t0
            self.overhead_seconds_total += self._step_overhead
            self._step_overhead = 0.0
        if self.control is not None:
            try:
                self.control.on_end_step(self.step, summary)
            except Exception as exc:
                self._error("control_end_step", exc)
        if self._input_wait is not None:
            self._input_wait.step_ended()  # last: a pause above is not input wait

    def _end_step(self, loss: torch.Tensor | float, tokens: int | None, t0: float) -> dict[str, float]:
        st = self._state
        self.step += 1
        step = self.step
        duration = t0 - self._last_end
        self._last_end = t0
        if self.scaler is not None and self.scaler.is_enabled() and not st.stepped and st.backwards:
            self._amp_skipped += 1  # GradScaler.step skipped optimizer.step: inf/NaN gradients

        if isinstance(loss, torch.Tensor):
            loss_t = loss.detach().to(self.device, torch.float64)
            if loss_t.dim():
                loss_t = loss_t.reshape(())
        else:
            loss_t = torch.full((), float(loss), dtype=torch.float64, device=self.device)  # a fill, no copy
        self.loss_device = loss_t
        grad_norm = st.grad_norm
        # The step's row of the interval: (loss, grad norm); a step without one counts it as 0.
        row = torch.stack([loss_t, grad_norm if grad_norm is not None else self._zero])
        self._interval[(step - 1) % self.config.report_every].copy_(row)
        self._step_row = row

        published = self._publish()
        if self._is_report(step):
            if len(self._pending) >= _MAX_IN_FLIGHT:
                # SYNC: only when the device runs _MAX_IN_FLIGHT reports behind the host.
                published = self._publish(block=True, limit=1) or published
            self._pending.append(self._build_report(st, step, loss_t, grad_norm, duration, tokens, t0))
            published = self._publish() or published
        return published

    def _build_report(self, st: _StepState, step: int, loss_t: torch.Tensor,
                      grad_norm: torch.Tensor | None, duration: float, tokens: int | None,
                      t0: float) -> _Report:
        dev: dict[str, torch.Tensor] = {}  # sample key -> device scalar
        vectors: list[tuple[list[str], torch.Tensor]] = []  # per-layer: (sample keys, device vector)
        host: dict[str, float] = {"trainguard_step": float(step)}
        rows = self._interval
        finite = rows * 0 == 0  # x * 0 is NaN exactly where x is NaN or +-Inf
        loss_finite = finite[:, 0]
        self._nonfinite_steps += self._interval_nonfinite(finite)
        # A non-finite loss anywhere in the interval is the interval's loss: the first one.
        # (index_select: indexing with a device tensor could read it on the host)
        first_bad = rows[:, 0].index_select(0, torch.argmin(loss_finite.to(torch.uint8)).reshape(1))[0]
        dev["trainguard_loss"] = torch.where(loss_finite.all(), loss_t, first_bad)
        dev["trainguard_nonfinite_steps_total"] = self._nonfinite_steps.clone()
        if grad_norm is not None:
            dev["trainguard_grad_norm"] = grad_norm
            dev["trainguard_grad_norm_max"] = torch.where(finite[:, 1], rows[:, 1], 0.0).amax()
        rows.zero_()  # after its last reader above (device order)
        if st.grad_nonfinite is not None:
            dev["trainguard_nonfinite_grads"] = st.grad_nonfinite

        param_sq = st.param_sq
        if param_sq is None:
            param_sq = stats.bucket_norms(self._param_buckets, self.device).to(torch.float64).square()
        param_sq_sum = param_sq.sum()
        dev["trainguard_param_norm"] = param_sq_sum.sqrt()
        dev["trainguard_param_scale"] = (param_sq_sum / self._numel).sqrt()
        if st.delta_sq is not None and st.before_sq is not None:
            delta = st.delta_sq.sum().sqrt()
            dev["trainguard_update_ratio"] = delta / st.before_sq.sum().sqrt()
            if grad_norm is not None:
                dev["trainguard_effective_lr"] = delta / grad_norm

        lrs = st.lrs if st.lrs is not None else self._last_lrs()
        self._lrs = lrs
        for i, lr in enumerate(lrs):
            key = sample_key("trainguard_learning_rate", group=str(i))
            if isinstance(lr, torch.Tensor):
                dev[key] = lr.to(self.device, torch.float64).reshape(())
            else:
                host[key] = lr

        state_tensors = [t for s in self.optimizer.state.values() for t in s.values()
                         if isinstance(t, torch.Tensor)]
        dev["trainguard_optimizer_state_nonfinite"] = stats.nonfinite_count(state_tensors, self.device)

        scale_now = self._scale_tensor()
        if scale_now is not None:
            dev["trainguard_loss_scale"] = scale_now
        host["trainguard_amp_skipped_steps_total"] = float(self._amp_skipped)
        host["trainguard_step_duration_seconds"] = duration
        wait = self._input_wait.take() if self._input_wait is not None else math.nan
        if not math.isnan(wait):
            host["trainguard_input_wait_seconds"] = wait
        if tokens or st.backwards:
            host["trainguard_global_batch_size"] = float((tokens or st.backwards) * self.world_size)
        if tokens is not None:
            host["trainguard_tokens_per_second"] = tokens / duration if duration > 0 else math.inf
        host.update(self._memory())

        if self._per_layer:
            self._layer_metrics(st, param_sq, vectors)

        micro_count = len(st.micro_norms)
        micro_sum = (torch.linalg.vector_norm(torch.stack(st.micro_norms)).square() if st.micro_norms
                     else self._zero)
        micro_sum = self._unscale(micro_sum, st.scale, power=2)
        host["trainguard_agent_overhead_seconds"] = self._step_overhead + (self._clock() - t0)

        gathered = None
        small_sum, total_count = micro_sum, micro_count
        if self._data_parallel:
            local = torch.stack([
                loss_t, grad_norm if grad_norm is not None else torch.full_like(loss_t, math.nan),
                micro_sum, torch.full_like(loss_t, micro_count), self._nonfinite_steps.clone(),
                torch.full_like(loss_t, duration),
                torch.full_like(loss_t, host.get("trainguard_tokens_per_second", math.nan)),
                torch.full_like(loss_t, wait),
            ])
            gathered = self._all_gather(local).to(self.device)
            small_sum = gathered[:, RANK_FIELDS.index("micro_sq_sum")].sum()
            total_count = micro_count * self.world_size  # every rank runs the same loop
        if self.config.grad_noise and total_count >= 2 and grad_norm is not None:
            # Small gradients k*h_j have the expectation of the accumulated gradient H.
            micro_size = tokens / micro_count if tokens else 1.0
            small_sq = micro_count**2 * small_sum / total_count
            b_simple, trace = stats.noise_scale(small_sq, grad_norm * grad_norm, total_count, micro_size)
            dev["trainguard_grad_noise_scale"] = b_simple
            dev["trainguard_grad_variance"] = trace

        keys = list(dev)
        pieces = [torch.stack([v if v.dim() == 0 and v.dtype == torch.float64 else v.reshape(()).to(torch.float64)
                               for v in dev.values()])]
        for vector_keys, values in vectors:
            keys += vector_keys
            pieces.append(values.to(torch.float64))
        if gathered is not None:
            pieces.append(gathered.reshape(-1))
        ranks = self.world_size if gathered is not None else 0
        vec = torch.cat(pieces)
        if vec.device.type == "cuda":
            buffer = torch.empty(vec.shape, dtype=vec.dtype, pin_memory=True)
            buffer.copy_(vec, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            return _Report(step, keys, buffer, event, host, ranks)
        return _Report(step, keys, vec, None, host, ranks)

    def _layer_metrics(self, st: _StepState, param_sq: torch.Tensor,
                       vectors: list[tuple[list[str], torch.Tensor]]) -> None:
        n = len(self.layers)

        def add(metric: str, values: torch.Tensor) -> None:
            keys = self._layer_keys.get(metric)
            if keys is None:
                keys = self._layer_keys[metric] = [sample_key(metric, layer=layer) for layer in self.layers]
            vectors.append((keys, values))

        if st.grad_norms is not None:
            g = stats.segment_sum(st.grad_norms.to(torch.float64).square(), self._layer_ids, n).sqrt()
            add("trainguard_layer_grad_norm", self._unscale(g, st.scale))
        add("trainguard_layer_param_norm", stats.segment_sum(param_sq, self._layer_ids, n).sqrt())
        if st.delta_sq is not None and st.before_sq is not None:
            delta = stats.segment_sum(st.delta_sq, self._layer_ids, n).sqrt()
            before = stats.segment_sum(st.before_sq, self._layer_ids, n).sqrt()
            add("trainguard_layer_update_ratio", delta / before)

    def _join_report_gather(self) -> None:
        """After an error in ``_end_step``: if this report step's all-gather was not entered,
        enter it with a NaN row, so an error on one rank never leaves the others waiting in the
        collective (nor pairs their gather with this rank's next collective)."""
        if not (self._data_parallel and self._is_report(self.step) and self._gathered_step != self.step):
            return
        try:
            self._all_gather(torch.full((len(RANK_FIELDS),), math.nan, dtype=torch.float64, device=self.device))
        except Exception as exc:
            self._error("end_step", exc)

    def _all_gather(self, local: torch.Tensor) -> torch.Tensor:
        self._gathered_step = self.step  # entered (even if it fails): never entered twice per step
        backend = dist.get_backend()
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        # For gloo with CUDA parameters this .to() is a device-to-host copy: a SYNC, once per report.
        src = local.to(device)
        out = torch.empty(self.world_size * src.numel(), dtype=src.dtype, device=device)
        dist.all_gather_single(out, src)
        return out.view(self.world_size, src.numel())

    def _last_lrs(self) -> list[float | torch.Tensor]:
        previous = getattr(self, "_lrs", None)
        if previous is not None:
            return previous
        return [g["lr"].detach().clone() if isinstance(g["lr"], torch.Tensor) else float(g["lr"])
                for g in self.optimizer.param_groups]

    def _memory(self) -> dict[str, float]:
        if self.device.type == "cuda":
            # Allocator statistics kept on the host: no device sync.
            allocated = float(torch.cuda.memory_allocated(self.device))
            reserved = float(torch.cuda.memory_reserved(self.device))
            peak = float(torch.cuda.max_memory_allocated(self.device))
        else:
            allocated, peak = stats.host_memory()
            reserved = allocated
        return {
            "trainguard_memory_allocated_bytes": allocated,
            "trainguard_memory_reserved_bytes": reserved,
            "trainguard_memory_peak_bytes": peak,
        }

    # ------------------------------------------------------------------ publication

    def _publish(self, block: bool = False, limit: int | None = None) -> dict[str, float]:
        """Turn the reports in flight whose copies have completed into host values, oldest
        first; with ``block``, wait for the oldest ``limit`` (default: all) of them. Returns the
        newest published values, or {} when nothing was published."""
        published: dict[str, float] = {}
        waits = len(self._pending) if limit is None else limit
        while self._pending and ((block and waits > 0) or self._pending[0].ready()):
            waits -= 1
            published = self._publish_one(self._pending.popleft())
        return published

    def _publish_one(self, report: _Report) -> dict[str, float]:
        if report.event is not None:
            report.event.synchronize()  # SYNC: waits for the report's copy only (no-op when done)
        flat = report.buffer.tolist()  # host memory (pinned buffer or CPU tensor): no device read
        n = len(report.keys)
        values = dict(zip(report.keys, flat[:n]))
        if report.ranks:
            width = len(RANK_FIELDS)
            rows = [flat[n + r * width: n + (r + 1) * width] for r in range(report.ranks)]
            self.rank_values = {f: [row[i] for row in rows] for i, f in enumerate(RANK_FIELDS)}
        else:
            self.rank_values = {
                "loss": [values["trainguard_loss"]],
                "grad_norm": [values.get("trainguard_grad_norm", math.nan)],
                "nonfinite_steps_total": [values["trainguard_nonfinite_steps_total"]],
                "step_duration_seconds": [report.host["trainguard_step_duration_seconds"]],
                "tokens_per_second": [report.host.get("trainguard_tokens_per_second", math.nan)],
                "input_wait_seconds": [report.host.get("trainguard_input_wait_seconds", math.nan)],
            }
        values.update(report.host)
        self._advise_batch_size(values)
        self._refresh_data_values()
        with self._lock:
            self._published = values
        return dict(values)

    def _advise_batch_size(self, values: dict[str, float]) -> None:
        """Feed the report's noise scale to the batch-size advisor; its running recommendation
        joins the report's values (host floats only)."""
        b = values.get("trainguard_grad_noise_scale")
        if b is not None:
            self.batch_size_advisor.update(b, values.get("trainguard_grad_variance", math.nan))
        recommended = self.batch_size_advisor.recommended()
        if not math.isnan(recommended):
            values["trainguard_recommended_batch_size"] = recommended

    def _refresh_data_values(self) -> None:
        if self._data_feed is not None:
            try:
                self._data_values = {k: float(v) for k, v in self._data_feed.values().items()}
            except Exception as exc:
                self._error("data_monitor", exc)

    def _current_values(self) -> dict[str, float]:
        """Host values only: called by the /metrics collector from the HTTP thread."""
        with self._lock:
            values = dict(self._published)
            errors = self._errors
        values.update(self._data_values)
        for kind, source in (("loader_values", self._loader), ("control_values", self.control)):
            if source is not None:
                try:
                    values.update(source.values())
                except Exception as exc:
                    self._error(kind, exc)
                    with self._lock:
                        errors = self._errors
        if self._data_feed is not None:
            errors += self._data_feed.errors  # bad batches, counted by the feed's worker thread
            errors += self._data_feed.dropped  # batches the data monitor fell too far behind to see
        values["trainguard_agent_errors_total"] = float(errors)
        return values

    def _interval_nonfinite(self, finite: torch.Tensor | None = None) -> torch.Tensor:
        """Non-finite steps among the report interval's rows (device scalar; unused rows are 0)."""
        if finite is None:
            finite = self._interval * 0 == 0
        return (~finite.all(dim=1)).sum()

    # ------------------------------------------------------------------ public API

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
            if self._data_feed is not None:
                self._data_feed.flush(timeout=1.0)  # batches submitted so far (worker thread)
                self._refresh_data_values()
        except Exception as exc:
            self._error("publish", exc)
        return self._current_values()

    def watch_loader(self, loader: Any) -> None:
        """Export the reader metrics of ``loader`` (``trainer_agent.dataset.TokenLoader``, or
        anything with a thread-safe ``values()`` of catalogue metrics) with this rank's."""
        self._loader = _checked_loader(loader)

    def take_data_sketch(self) -> Any:
        """The bottom-k sketch of the sequences observed since the last call (int64 row, see
        ``trainer_agent.sketch``), or None without a data monitor that keeps one."""
        take = getattr(self.data_monitor, "take_sketch", None)
        if take is None:
            return None
        return take()  # batches still queued in the data feed count in the next interval

    @property
    def metrics_url(self) -> str | None:
        """URL of this rank's ``/metrics``; None when ``metrics_port`` is None."""
        return self._server.url if self._server is not None else None

    @property
    def accumulation_steps(self) -> int | None:
        """Micro-batches per optimizer step the loop should run now: the run's own
        (``attach(accumulation_steps=...)``) until the controller's ``accumulation`` command
        changes it, at the same step on every rank (None when the run did not opt in)."""
        if self.control is not None and self.control.accumulation_steps is not None:
            return self.control.accumulation_steps
        return self.accumulation_base

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

    def state_dict(self) -> dict[str, Any]:
        """The agent's counters and control state, for the training checkpoint."""
        state: dict[str, Any] = {
            "version": 1,
            "step": self.step,
            # SYNC: checkpoint time only; reads one device scalar.
            "nonfinite_steps_total": float((self._nonfinite_steps + self._interval_nonfinite()).item()),
            "amp_skipped_steps_total": self._amp_skipped,
        }
        if self.control is not None:
            state["control"] = self.control.state_dict()
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
        self._nonfinite_steps.fill_(nonfinite)
        self._interval.zero_()  # steps before the restore are not part of the restored run
        self._amp_skipped = skipped
        if self.control is not None and "control" in state:
            self.control.load_state_dict(state["control"])

    def close(self, timeout: float | None = None) -> None:
        """Publish the last report, remove the hooks, stop the control plane and the /metrics
        server. Returns within about ``timeout`` seconds (default ``config.close_timeout_s``)."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + (self.config.close_timeout_s if timeout is None else timeout)
        try:
            self._publish(block=True)  # SYNC: the last report
        except Exception as exc:
            self._error("publish", exc)
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._input_wait is not None:
            self._input_wait.remove()
        if self._data_feed is not None:
            self._data_feed.close(max(0.0, deadline - time.monotonic()))
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


def _checked_loader(loader: Any) -> Any:
    if not callable(getattr(loader, "values", None)):
        raise ValueError(f"loader must have values() (trainer_agent.dataset.TokenLoader), got {type(loader).__name__}")
    return loader


def attach(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    job: str,
    run: str,
    scaler: Any = None,
    config: AgentConfig | None = None,
    lr_scheduler: Any = None,
    data_monitor: Any = None,
    on_checkpoint: Callable[..., Any] | None = None,
    controller: str | None = None,
    token: str | None = None,
    registry: CollectorRegistry | None = None,
    loader: Any = None,
    accumulation_steps: int | None = None,
) -> Agent:
    """Attach an agent to ``model`` and ``optimizer``; see the module docstring.

    ``controller``/``token`` override the config's. ``loader``: a ``TokenLoader`` whose reader
    metrics (prefetch depth, tokens/s read) this rank exports. ``accumulation_steps``: the run's
    own micro-batches per optimizer step, given to let the controller change them (the loop then
    reads ``agent.accumulation_steps`` before each step). Mistakes in the arguments raise
    ``ValueError`` here, before training starts.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
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
    if data_monitor is not None and not (hasattr(data_monitor, "observe_batch") and hasattr(data_monitor, "values")):
        raise ValueError("data_monitor must have observe_batch() and values() (trainer_agent.DataMonitor)")
    if loader is not None:
        _checked_loader(loader)
    agent = Agent(model, optimizer, job=job, run=run, config=config, scaler=scaler,
                  lr_scheduler=lr_scheduler, data_monitor=data_monitor,
                  on_checkpoint=on_checkpoint, registry=registry, accumulation_steps=accumulation_steps)
    if loader is not None:
        agent.watch_loader(loader)
    return agent
