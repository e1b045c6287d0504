"""What the agent measures during one optimizer step, in the hooks: (1) backward, (2) optimizer step.

:class:`StepMeter` holds the hook bodies; the :class:`~trainer_agent.agent.Agent` facade registers
them, times them and keeps their errors out of the training loop. Every value stays on the device
(no host-device sync here). What they learn is a :class:`~trainer_agent.measure.step_state.StepState`,
which the report pipeline (``trainer_agent/report/pipeline.py``) reads when the step ends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from trainer_agent.measure import optim, stats, triage_stats as triage
from trainer_agent.compat import torch_hooks, torch_private
from trainer_agent.compat.foreach_results import results_vector
from trainer_agent.config import AgentConfig
from trainer_agent.measure.backward_pass import BackwardPass
from trainer_agent.measure.grad_hooks import GradHooks
from trainer_agent.measure.update_snapshot import UpdateSnapshot
from trainer_agent.measure.layer_stats import LayerGradStats
from trainer_agent.measure.params import ParamIndex
from trainer_agent.measure.schedule import ReportSchedule
from trainer_agent.measure.step_state import StepState, unscale

__all__ = ["StepMeter", "GradHooks"]


class StepMeter:
    """Gradient and update measurements of the step in progress (``state``).

    ``step`` is a callable returning the steps completed so far (the facade's counter); the step
    in progress is ``step() + 1``.
    """

    def __init__(self, index: ParamIndex, config: AgentConfig, schedule: ReportSchedule, *,
                 scaler: Any, data_parallel: bool, step: Callable[[], int],
                 on_error: Callable[[str, BaseException], None], clock: Callable[[], float]) -> None:
        self.index = index
        self.config = config
        self.schedule = schedule
        self.scaler = scaler
        self.data_parallel = data_parallel
        #: The noise-scale measurement: needs each rank's full incoming gradient, which sharded
        #: parameters (FSDP2's reduce-scattered gradients) do not have: off with sharding, and with
        #: sparse gradients (not hooked; the step's norm, which counts them, would not match).
        self.grad_noise = config.grad_noise and index.sharding is None and not index.sparse
        #: Norms of the (scaled) gradients accumulate in float64 under an enabled GradScaler: the
        #: square of a scaled float32 gradient can overflow float32 (scale 2^127), never float64
        #: (the largest float32 squared is ~1e77), so the unscaled norm stays right for any finite
        #: scale; without a scaler float32 accumulation (the fused fast path) is kept.
        self.wide = scaler is not None and scaler.is_enabled()
        self._step = step
        self._on_error = on_error
        self._clock = clock
        self.state = StepState()
        #: Set by the agent under data parallelism, or with replicated shards (``trainer_agent/measure/fingerprint.py``).
        self.fingerprint: Any = None
        #: Wall time spent in the backward-end callbacks of this step (the facade adds it up).
        self.overhead = 0.0
        #: ||accumulated grad|| times the loss scale, at the last backward end (device scalar).
        self.scaled_grad_norm: torch.Tensor | None = None
        self.last_lrs: list[float | torch.Tensor] | None = None
        self.backward_pass = BackwardPass(len(index.buckets), self._dtype)
        self._snapshot = UpdateSnapshot(index)
        #: The triage's per-layer gradient statistics, fused (its index tensors cached).
        self.layer_stats = LayerGradStats(index.layer_ids, len(index.layers), index.device)
        #: The parameters' tensor hooks (set by the agent): sentinels, and every parameter on the
        #: steps that read incoming gradients (:meth:`wants_every_grad`).
        self.hooks: GradHooks | None = None
        #: Backward passes of the last finished step (None before the first): without data
        #: parallelism the report step's hooks are added only after accumulation was seen.
        self._last_backwards: int | None = None

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The step's pre-clip global gradient norm so far (device scalar), None before the first
        backward of the step."""
        return self.state.grad_norm

    def reset(self) -> StepState:
        """Start the next step; returns the finished step's state."""
        finished, self.state = self.state, StepState()
        self._last_backwards = finished.backwards
        self.backward_pass.queued = False
        self.backward_pass.clear()  # a backward pass that raised never reached its end
        return finished

    # ------------------------------------------------------------------ (1) backward

    def on_grad(self, index: int, grad: torch.Tensor) -> None:
        """Tensor hook of ``index.params[index]``: the incoming gradient of one backward pass,
        before it is accumulated into ``.grad`` (and before any DDP all-reduce).

        For the noise scale its norm is needed, taken in a few fused calls per pass
        (:class:`~trainer_agent.measure.backward_pass.BackwardPass`)."""
        self.begin_backward()
        if self.grad_noise and (self.data_parallel or self.state.backwards >= 1):
            if self.index.params[index].grad is not None:
                self.backward_pass.hold(self.index.bucket_of[index], grad)
            elif self.backward_pass.grads_stay:
                self.backward_pass.fresh(index, grad)
            else:
                self.backward_pass.norm(grad)

    def wants_every_grad(self) -> bool:
        """Whether the step in progress needs every incoming gradient from its first backward
        pass on (the per-parameter hooks): the noise scale on a report step under data
        parallelism, where every pass is measured before the all-reduce. Without data
        parallelism the first pass's gradient is the accumulated one, and the hooks are added
        at its end (``_backward_end``); other steps need none (the noise scale is reported from
        the report step's micro-batches only)."""
        return self.grad_noise and self.data_parallel and self.schedule.is_report(self._step() + 1)

    def sentinel(self, grad: torch.Tensor) -> None:
        """Tensor hook of the sentinel parameters (:class:`GradHooks`): starts the end-of-backward
        measurement of the pass."""
        if not self.backward_pass.queued:
            try:
                self.begin_backward()
            except Exception as exc:  # never raise into backward
                self._on_error("gradient_hook", exc)

    def _dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float64 if self.wide else stats.norm_dtype(dtype)

    def begin_backward(self) -> None:
        """Called by the first gradient hook of a backward pass (or the model output's hook):
        queues the end-of-backward measurement once per pass."""
        if not self.backward_pass.queued:
            self.backward_pass.queued = True
            self.backward_pass.norms = []
            self.backward_pass.begin(self._last_backwards is None)
            torch_hooks.queue_backward_callback(self._backward_end_outer)

    def watch_output(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """Forward hook on the model, for sharded parameters: FSDP2 hands the gradients to its
        sharded parameters at the end of backward without running their tensor hooks, so a hook
        on the model's output (the first tensor requiring a gradient) starts the end-of-backward
        measurement instead; it runs after FSDP2's reduce-scatter (queued later, see
        ``_backward_end_outer``)."""
        if not torch.is_grad_enabled():
            return
        for t in torch_private.tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._output_grad)
                return

    def _output_grad(self, grad: torch.Tensor) -> None:
        try:
            self.begin_backward()
        except Exception as exc:  # never raise into backward
            self._on_error("gradient_hook", exc)

    def _backward_end_outer(self) -> None:
        # Re-queue, so that this runs after callbacks queued later in the same backward pass,
        # in particular DDP's, which finishes the gradient all-reduce. The noted incoming
        # gradients are normed first, before DDP's callback copies the all-reduced ones over them.
        t0 = self._clock()
        try:
            self.backward_pass.norm_fresh(self.index.params, self.index.bucket_of)
        except Exception as exc:
            self.backward_pass.missed = True  # this pass's noise-scale norm is absent, the step's measured
            self._on_error("backward_end", exc)
        self.overhead += self._clock() - t0
        try:
            torch_hooks.queue_backward_callback(self._backward_end)
        except Exception as exc:
            self.backward_pass.queued = False
            self._on_error("backward_end", exc)

    def _backward_end(self) -> None:
        t0 = self._clock()
        try:
            self.backward_pass.queued = False
            self.backward_pass.norm_held()
            if self.index.sharding is None and not self.index.has_grad():
                # (stops at the first gradient) A pass that wrote no .grad (``torch.autograd.grad``,
                # e.g. a loop that sets .grad itself from it): not a backward of this step; the
                # optimizer's pre-hook measures the gradients it is given. (FSDP2 holds a no_sync
                # pass's gradients unsharded, with .grad still None: measured as before.)
                return
            st = self.state
            first = st.backwards == 0
            self.measure_grads()
            if self.grad_noise:
                if first and not self.data_parallel:
                    # The first backward of a step accumulates into zeroed gradients.
                    st.micro_norms.append(self.scaled_grad_norm)
                elif self.backward_pass.norms:
                    st.micro_norms.append(torch.linalg.vector_norm(results_vector(self.backward_pass.norms),
                                                                   dtype=torch.float64))
                elif self.hooks is not None and not self.hooks.full:
                    st.micro_missed = True  # a pass without the hooks: its incoming norm is unknown
                st.micro_missed |= self.backward_pass.missed
            st.backwards += 1
            hooks = self.hooks
            if (first and self.grad_noise and not self.data_parallel and hooks is not None and not hooks.full
                    and self._last_backwards != 1 and self.schedule.is_report(self._step() + 1)):
                # The step's further passes, when the last step had some: their incoming gradients.
                hooks.want(True)
            if st.micro_missed:
                st.micro_norms = []  # the noise scale of this step is absent rather than wrong
        except Exception as exc:
            self._on_error("backward_end", exc)
        finally:
            self.backward_pass.clear()
            self.overhead += self._clock() - t0

    def measure_grads(self) -> None:
        """Per-tensor norms of the current ``.grad`` (and, on report steps, their non-finite
        element count) into the state. One fused norm per bucket. An ordinary step under DDP with
        ``gradient_as_bucket_view``, or under FSDP2, takes only the norm, from DDP's flat buckets or
        FSDP2's flat gradient buffers (``ParamIndex.bucket_views``): no work per tensor; so does an
        ordinary step on an accelerator whose buckets hold many small gradients
        (``one_copy_norm.OneCopyNorm``: one copy and one norm per bucket)."""
        st = self.state
        report = self.schedule.is_report(self._step() + 1)
        views, sharding = self.index.bucket_views, self.index.sharding
        if views is not None and not report:
            scaled = views.norm(self.index.device, wide=self.wide)
            if scaled is not None:  # (no sparse gradient under sharding)
                self._total_only(scaled, None if sharding is None else views.shared(scaled))
                return
        if not report and self.index.one_copy is not None:  # one copy, one norm per bucket
            scaled = self.index.one_copy.norm(self.index.flat_grads(), self.index.device)
            if scaled is not None:
                self._total_only(scaled, None)
                return
        grads = self.index.grads()
        st.grad_norms = stats.bucket_norms(grads, self.index.device, wide=self.wide, staged_ok=report)
        st.scale = self.scale_tensor()
        if report and views is not None and views.wants_find():
            views.find([p.grad for p in self.index.params])  # on a report step, which reads every gradient anyway
        if report and sharding is None:
            st.grad_nonfinite = stats.bucket_nonfinite(grads, self.index.device, st.grad_norms)
        elif report:  # count each element once: the kept replica's shards only
            flat = [g for b in grads for g in b]
            st.grad_nonfinite = stats.nonfinite_count([flat[i] for i in sharding.kept], self.index.device,
                                                      st.grad_norms.index_select(0, sharding.kept_index))
        self.scaled_grad_norm = torch.linalg.vector_norm(st.grad_norms, dtype=torch.float64)
        if sharding is None:
            self.scaled_grad_norm = self._with_sparse(self.scaled_grad_norm, report)
            st.grad_norm = st.grad_share = unscale(self.scaled_grad_norm, st.scale)
        else:
            st.grad_norm = unscale(self.scaled_grad_norm, st.scale)
            sq = st.grad_norms.to(torch.float64).square()
            st.grad_share = unscale(sharding.shares(sq).sum(), st.scale, power=2)

    def _total_only(self, scaled: torch.Tensor, shared: torch.Tensor | None) -> None:
        """An ordinary step's norm without per-tensor norms: ``scaled`` the dense gradients' (as
        the loss scale leaves them), ``shared`` this rank's share of their square under sharding."""
        st = self.state
        st.grad_norms = None
        st.scale = self.scale_tensor()
        self.scaled_grad_norm = self._with_sparse(scaled, False)
        st.grad_norm = unscale(self.scaled_grad_norm, st.scale)
        st.grad_share = st.grad_norm if shared is None else unscale(shared, st.scale, power=2)

    def _with_sparse(self, scaled: torch.Tensor, report: bool) -> torch.Tensor:
        """``scaled`` (the dense gradients' norm) with the sparse gradients' (``ParamIndex.sparse``)
        added in, and on a report step their non-finite elements added to the count."""
        if not self.index.sparse:
            return scaled
        count = report and self.state.grad_nonfinite is not None
        sq, bad = stats.sparse_sq_norm([p.grad for p in self.index.sparse], self.index.device, count=count)
        if bad is not None:
            self.state.grad_nonfinite = self.state.grad_nonfinite + bad
        return (scaled.square() + sq).sqrt()

    def adopt_scaler(self, scaler: Any) -> None:
        """Measure with ``scaler`` from now on (a ``GradScaler`` found stepping the optimizer,
        ``AgentHooks.find_scaler``), the step in progress included: its gradients, measured at the
        end of backward, carry the scale the scaler holds until its ``update()``."""
        self.scaler, self.wide = scaler, scaler.is_enabled()
        st = self.state
        if st.backwards and st.scale is None and st.grad_norm is not None:
            st.scale = self.scale_tensor()
            shared = st.grad_share is st.grad_norm  # else sharded: this rank's share of the sum of squares
            st.grad_norm = unscale(st.grad_norm, st.scale)
            st.grad_share = st.grad_norm if shared else unscale(st.grad_share, st.scale, power=2)

    def scale_tensor(self) -> torch.Tensor | None:
        scaler = self.scaler
        scale = torch_private.grad_scaler_scale(scaler) if scaler is not None and scaler.is_enabled() else None
        if scale is None:
            return None
        # GradScaler keeps its scale in a device tensor (get_scale() would sync); update() changes
        # it in place, so keep a copy of the value the gradients carry.
        return scale.detach().to(self.index.device, torch.float64, copy=True).reshape(())

    # ------------------------------------------------------------------ (2) optimizer step

    def before_step(self, optimizer: torch.optim.Optimizer, *, closure_pending: bool = False) -> None:
        """Optimizer pre-hook body (under ``no_grad``): LRs used, W_before snapshot, and the
        gradients the step applies (:meth:`step_grads`). ``closure_pending``: the step's closure
        runs after this hook (``optim.closure_pending``): its gradients are read after its first
        evaluation (``optim.StepClosure``), not here, where ``.grad`` holds an earlier step's."""
        self.state.lrs = triage.group_lrs(optimizer)
        if not closure_pending:
            self.step_grads(optimizer)
        mode = self.config.update_ratio
        if mode == "every" or (mode == "report" and self.schedule.is_report(self._step() + 1)):
            self._snapshot.take(self.state)

    def step_grads(self, optimizer: torch.optim.Optimizer) -> None:
        """The gradients the optimizer is about to use (all-reduced, unscaled and clipped): their
        norm when no backward pass measured it, and on report steps their per-layer moments and
        fingerprints. Under ``no_grad``."""
        st = self.state
        # A step on which no parameter has a gradient (all .grad None: a skipped batch, a step
        # without a backward pass) has no gradient values: absent, not a norm of 0 (sharded
        # parameters: measured as before, FSDP2 may hold them elsewhere).
        graded = self.index.sharding is not None or self.index.has_grad()
        if st.grad_norm is None and graded:
            # No backward pass went through the hooks (gradients set by hand): measure what the
            # optimizer is about to use.
            self.measure_grads()
        report = self.schedule.is_report(self._step() + 1)
        # Under sharding (FSDP2/TP) a rank holds only its shards: per-layer statistics of them are
        # not the layer's, so they are left out (absent, never wrong).
        grads = self.index.grads() if report and (self.config.triage or self.fingerprint is not None) else None
        if report:  # a layer the step leaves without a gradient has no update ratio
            st.ungraded = self.index.ungraded(grads)
        if self.config.triage and report and self.index.sharding is None and graded:
            st.grad_stats = self.layer_stats.measure(self.index.params, scale=optim.applied_grad_scale(optimizer),
                                                     grads=grads)
        if self.fingerprint is not None and report:
            # Per layer; their squared norms are the statistics' when those measured every gradient.
            st.grad_fp = self.fingerprint.layer_values(grads, skip=self.index.pending_grads(),
                                                       sq=st.grad_stats.device_sq() if st.grad_stats else None)

    def after_step(self) -> None:
        """Optimizer post-hook body (under ``no_grad``): ||W_after - W_before||, ||W_after||."""
        st = self.state
        st.stepped = True
        if st.snapshot_taken:
            # Refresh the snapshot with W_after when the next step is measured too.
            self._snapshot.measure(st, refresh=self.config.update_ratio == "every" or self.config.report_every == 1)
        else:
            self._snapshot.forget()
            if self.schedule.is_report(self._step() + 1):
                self._snapshot.measure_params(st)

    def lrs(self, st: StepState, optimizer: torch.optim.Optimizer) -> list[float | torch.Tensor]:
        """The LRs the finished step ``st`` used (the last ones seen when no step was taken)."""
        lrs = st.lrs
        if lrs is None:
            lrs = self.last_lrs
        if lrs is None:
            lrs = triage.group_lrs(optimizer)
        self.last_lrs = lrs
        return lrs
