"""(3) The report pipeline: the step's row of the report interval, the report built on the device,
the report step's collective, and the device-to-host copy published at a later ``end_step``.

On a report step (``ReportSchedule.is_report``) every device value of the report is concatenated
into one float64 vector, together with the ranks' gathered rows, and copied to the host: on CUDA
with a non-blocking copy into pinned memory, read at a later ``end_step`` once the copy's event has
completed; on the CPU the vector is the host copy. Host-device syncs: only where a comment says
``SYNC``.

With sharded parameters (``ParamIndex.sharding``: FSDP2, HSDP, tensor parallel) each rank holds
only its shares of the per-parameter sums (``trainer_agent/measure/sharding.py``). The report step adds
them up over the ranks in one more collective, an ``all_reduce`` of one float64 vector (the
interval's per-step squared gradient norms, the per-parameter squared gradient, weight, update
and W_before norms, the non-finite counts), before anything is derived from them; every metric is
then the global one, equal on every rank. Steps that are not report steps issue no collective.

After the report step's gather a rank other than the leader (rank 0) keeps only its own row: its
host work per report does not grow with the world size. The leader copies every rank's row (and
sketch, and the fingerprint comparison) to the host with its report; the cross-rank part of a
published report is a :class:`RankVectors`, resolved once, off the training thread, by the
leader's :class:`CrossRankWorker` (the per-rank vectors, the fingerprint findings, the data
overlap of ``trainer_agent/measure/sketch.py``), which then hands it on (the controller's report).
"""

from __future__ import annotations

import functools
import logging
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from trainer_agent.measure import stats
from trainer_agent.report.cross_rank import MAX_QUEUED, CrossRankWorker, RankVectors
from trainer_agent.report.exporter import sample_key
from trainer_agent.measure.fingerprint import DesyncFinding, Fingerprinter
from trainer_agent.measure.optim import state_age
from trainer_agent.report.fingerprint_rounds import FingerprintRounds, failed_ranks
from trainer_agent.report.in_flight import InFlight, pack
from trainer_agent.report.interval_rows import IntervalRows
from trainer_agent.measure.triage_stats import UpdateModel
from trainer_agent.measure.params import ParamIndex
from trainer_agent.report.rank_row import RowInputs, rank_row
from trainer_agent.report.host_derived import HostDerived, PerTensor, layer_vectors, noise_scale_values, update_values
from trainer_agent.report.exchange import RankExchange
from trainer_agent.report.host_step import HostStep
from trainer_agent.report.shard_sums import ShardSums
from trainer_agent.measure.step_state import StepState
from trainer_agent.measure.step_stats import StepMeter

__all__ = ["CrossRankWorker", "HostStep", "InFlight", "RankVectors", "ReportPipeline", "MAX_IN_FLIGHT", "MAX_QUEUED"]

log = logging.getLogger(__name__)

#: Reports whose device-to-host copy may be in flight at once (the host waits beyond that).
MAX_IN_FLIGHT = 4

class _LayerKeys:
    """The per-layer sample keys and the layer of each parameter, made once (host)."""

    def __init__(self, index: ParamIndex) -> None:
        self._index = index
        self._keys: dict[tuple[str, ...], list[str]] = {}
        self._layer_of: np.ndarray | None = None

    def layer_of(self) -> np.ndarray:
        if self._layer_of is None:
            self._layer_of = np.asarray(self._index.layer_ids.tolist(), dtype=np.int64)
        return self._layer_of

    def keys(self, *metrics: str) -> list[str]:
        keys = self._keys.get(metrics)
        if keys is None:
            keys = self._keys[metrics] = [sample_key(m, layer=layer) for layer in self._index.layers for m in metrics]
        return keys


class ReportPipeline:
    """Builds, gathers, copies and publishes reports; keeps the report interval's rows."""

    def __init__(self, index: ParamIndex, meter: StepMeter, exchange: RankExchange, *,
                 optimizer: torch.optim.Optimizer, report_every: int, grad_noise: bool,
                 per_layer: bool, clock: Callable[[], float], fingerprint: Fingerprinter | None = None,
                 desync_rel_tol: float = 1e-5,
                 on_published: Callable[[dict[str, float], Mapping[str, list[float]]], None] | None = None,
                 on_error: Callable[[str, BaseException], None] | None = None) -> None:
        self.index = index
        #: Called on the training thread with (values, rank values) once per report, whichever
        #: call publishes it; the rank values are a :class:`RankVectors` on the leader of several
        #: ranks (do not resolve it there: hand it to :meth:`off_thread`).
        self.on_published = on_published
        #: The leader's thread for the cross-rank work (started on first use).
        self.worker = CrossRankWorker(on_error=on_error)
        self.fingerprint = fingerprint
        #: The fingerprints: a whole-model screen in every report, the per-layer values when the screens differ.
        self.rounds = None if fingerprint is None else FingerprintRounds(
            fingerprint, world=exchange.world_size, rank=exchange.rank, tol=desync_rel_tol, group=exchange.group)
        self.update_model = UpdateModel(optimizer, index.params, index.device)
        #: flops_per_token / peak_flops of one device (``trainer_agent/measure/flops.py``): MFU per token/s.
        self.mfu_per_token_rate: float | None = None
        self.meter = meter
        self.exchange = exchange
        self.optimizer = optimizer
        self.device = index.device
        self.grad_noise = grad_noise
        self.per_layer = per_layer
        self.rows = IntervalRows(report_every, self.device)
        self.zero = self.rows.zero
        self.pending: deque[InFlight] = deque()  # reports in flight, oldest first
        self.gathered_step = -1  # the step whose rows entered the exchange last
        self.shards = ShardSums(index, optimizer, self.rows.interval, self.zero)
        self._rank_values: Mapping[str, list[float]] = {}
        self._layer_keys = _LayerKeys(index)

    # ------------------------------------------------------------------ every step

    @property
    def world_size(self) -> int:
        return self.exchange.world_size

    @property
    def interval(self) -> torch.Tensor:
        """The report interval's rows (see :class:`IntervalRows`)."""
        return self.rows.interval

    @property
    def nonfinite_steps(self) -> torch.Tensor:
        """Non-finite steps before the current report interval (device scalar)."""
        return self.rows.nonfinite_steps

    def record_step(self, step: int, loss_t: torch.Tensor | None, grad_norm: torch.Tensor | None) -> torch.Tensor:
        """The step's row of the interval (:meth:`IntervalRows.record`)."""
        return self.rows.record(step, loss_t, grad_norm)

    def interval_nonfinite(self, nan_where_bad: torch.Tensor | None = None) -> torch.Tensor:
        """Non-finite steps among the report interval's rows (:meth:`IntervalRows.nonfinite`)."""
        return self.rows.nonfinite(nan_where_bad)

    # ------------------------------------------------------------------ report steps

    def build(self, st: StepState, loss_t: torch.Tensor | None, host_step: HostStep, overhead: float,
              state: Sequence[int] | None, sketch: Sequence[int] | None = None, *,
              amp_fused: torch.Tensor | None = None) -> list[int] | None:
        """Build the report of ``host_step.step``, enter the exchange with ``state`` (the leader's
        proposal, or None) and ``sketch`` (this rank's sequences, or None), queue the copy.
        ``amp_fused``: the steps a fused optimizer skipped itself (device count, ``StepClock``).
        Returns the agreed desired state (None without one)."""
        if len(self.pending) >= MAX_IN_FLIGHT:
            self.publish(block=True, limit=1)  # SYNC: only when the device runs that far behind
        if self.index.sharding is not None:
            self.shards.sum(host_step.step, st)
        dev: dict[str, torch.Tensor] = {}  # sample key -> device scalar
        derived = HostDerived()  # what the host derives from the copy (trainer_agent/report/host_derived.py)
        host = self._host_values(host_step)
        if amp_fused is not None:
            dev["trainguard_amp_skipped_steps_total"] = amp_fused + host.pop("trainguard_amp_skipped_steps_total")
        self.rows.values(dev, loss_t, st.grad_norm, derived)
        param = self._param_values(dev, st, derived)
        self._optimizer_values(dev, host, st)
        if self.per_layer:
            self._layer_metrics(st, param, derived)
        host["trainguard_agent_overhead_seconds"] = overhead
        fields, micro_count = self._rank_fields(dev, st, host, host_step.gpu_xid)
        ex = self.exchange
        extra = self._fingerprints(host_step.step, st)
        gathered, leader_state, detail = self.enter_exchange(host_step.step, ex.pack(fields, state, sketch, extra=extra))
        every_row = ex.fields(gathered)
        compared = sketches = compare = decode = None
        if ex.leader:  # every rank's rows; the others keep their own (O(1) whatever the world size)
            # the noise scale is the job's (every rank's micro-batch sums): the leader's value
            if self.grad_noise:
                derived.job(functools.partial(noise_scale_values, micro_count=micro_count,
                                              world_size=self.world_size, tokens=host_step.tokens))
            rows = every_row  # where the collective left them (host rows stay on the host)
            sketches = ex.sketches(gathered)
            if self.rounds is not None:
                rounds, screens = self.rounds, ex.extra(gathered)
                decode = rounds.decoder(host_step.step, detail is not None)
                if screens.device.type == "cpu":  # host rows (gloo): compared on the cross-rank worker
                    compare = lambda: rounds.compare(  # noqa: E731
                        screens, detail, torch.from_numpy(failed_ranks(every_row.numpy())))
                else:  # device rows: compared on the device, no sync
                    compared = rounds.compare(screens.to(self.device), detail, failed_ranks(every_row).to(self.device))
        else:
            rows = every_row[ex.rank:ex.rank + 1].to(self.device)
        agreed = ex.agreed(leader_state, state)
        self.pending.append(pack(host_step.step, dev, rows, host, leader=ex.leader, device=self.device,
                                 decode=decode, compared=compared, sketches=sketches, compare=compare,
                                 derived=derived))
        return agreed

    def enter_exchange(self, step: int, row: torch.Tensor) -> tuple[torch.Tensor, list[int] | None, torch.Tensor | None]:
        """The report step's collectives: the gather of every rank's ``row`` and, when the
        fingerprints' screens differ, the gather of their per-layer rows to the leader
        (``trainer_agent/report/fingerprint_rounds.py``: every rank decides alike from the rows).
        Returns (the gathered rows, the leader's state part, the per-layer rows on the leader)."""
        self.gathered_step = step  # entered (even if it fails): never entered twice per step
        ex, rounds = self.exchange, self.rounds
        gathered = ex.gather(row)
        differ = None
        if rounds is not None:
            rows = gathered.numpy() if gathered.device.type == "cpu" else gathered  # host rows: read with numpy
            differ = rounds.differ(ex.extra(rows), ex.fields(rows))
        leader_state, differ = ex.head(gathered, differ)
        if not differ or rounds is None:
            return gathered, leader_state, None
        return gathered, leader_state, rounds.gather_detail(step, gathered.device)

    def join_exchange(self, step: int, state: Sequence[int] | None) -> list[int] | None:
        """After an error while building the report of ``step``: if its exchange was not entered,
        enter it with a NaN row (and a valid state part), so an error on one rank never leaves
        the others waiting in the collective (nor pairs theirs with this rank's next one)."""
        if self.gathered_step == step:
            return None
        self.shards.enter_nan(step)
        return self.exchange.agreed(self.enter_exchange(step, self.exchange.nan_row(self.device, state))[1], state)

    def _host_values(self, h: HostStep) -> dict[str, float]:
        host = {"trainguard_step": float(h.step), "trainguard_amp_skipped_steps_total": float(h.amp_skipped)}
        if not h.warm_up:  # (the warm-up's times are not a step's: absent)
            host["trainguard_step_duration_seconds"] = h.duration
            host["trainguard_forward_seconds"] = h.forward_seconds
        if h.tokens is not None and not h.warm_up:
            host["trainguard_tokens_per_second"] = h.tokens / h.duration if h.duration > 0 else math.inf
            if self.mfu_per_token_rate is not None and h.duration > 0:
                host["trainguard_mfu"] = host["trainguard_tokens_per_second"] * self.mfu_per_token_rate
        if not math.isnan(h.input_wait):
            host["trainguard_input_wait_seconds"] = h.input_wait
        if h.tokens or h.micro_batches:
            host["trainguard_global_batch_size"] = float((h.tokens or h.micro_batches) * h.world_size)
        if not math.isnan(h.verify_mismatch):  # a check in this interval (trainer_agent/diagnostics/verify.py)
            host["trainguard_verify_rel_diff"] = h.verify_mismatch
        if not math.isnan(h.verify_float32):  # a float32 recompute in this interval
            host["trainguard_verify_float32_rel_diff"] = h.verify_float32
        if h.gpu_xid > 0:  # an XID error in this interval
            host["trainguard_gpu_last_xid"] = h.gpu_xid
        host.update(h.scheduled_lr)
        if not math.isnan(h.trainable_elements):
            host["trainguard_trainable_elements"] = h.trainable_elements
        if not math.isnan(h.run_changes):
            host["trainguard_run_changes_total"] = h.run_changes
        if not math.isnan(h.compile_steps):
            host["trainguard_compile_steps_total"] = h.compile_steps
        if not math.isnan(h.optimizer_class):
            host["trainguard_optimizer_class"] = h.optimizer_class
        host.update(h.comm)
        host.update(stats.memory(self.device))
        return host

    def _param_values(self, dev: dict[str, torch.Tensor], st: StepState, derived: HostDerived) -> PerTensor:
        """The parameter norm (a row value: on the device); the rest of the parameter and update
        values derived on the host (``report_host.update_values``) from the per-tensor squares."""
        if st.grad_nonfinite is not None:
            dev["trainguard_nonfinite_grads"] = st.grad_nonfinite
        param_sq = st.param_sq if st.param_sq is not None else self.index.sq_norms()
        dev["trainguard_param_norm"] = param_sq.sum().sqrt()
        update = st.delta_sq is not None and st.before_sq is not None
        at = PerTensor(param=derived.vector(param_sq),
                        delta=derived.vector(st.delta_sq) if update else None,  # type: ignore[arg-type]
                        before=derived.vector(st.before_sq) if update else None,  # type: ignore[arg-type]
                        moments=(derived.vector(st.grad_stats.values), st.grad_stats) if st.grad_stats is not None
                        else None)
        lrs = None if st.lrs is None else [
            sample_key("trainguard_learning_rate", group=str(i)) if isinstance(lr, torch.Tensor) else lr
            for i, lr in enumerate(st.lrs)]
        applied = _largest_host_lr(st.lrs)
        derived.job(functools.partial(update_values, numel=self.index.numel, param=at.param, delta=at.delta,
                                      before=at.before, moments=at.moments, lrs=lrs, model=self.update_model,
                                      applied=applied if applied is not None and applied > 0 else None))
        return at

    def _optimizer_values(self, dev: dict[str, torch.Tensor], host: dict[str, float], st: StepState) -> None:
        for i, lr in enumerate(self.meter.lrs(st, self.optimizer)):
            key = sample_key("trainguard_learning_rate", group=str(i))
            if isinstance(lr, torch.Tensor):
                dev[key] = lr.to(self.device, torch.float64).reshape(())
            else:
                host[key] = lr
        if self.shards.state_nonfinite is not None:  # sharded: summed over the ranks
            dev["trainguard_optimizer_state_nonfinite"] = self.shards.state_nonfinite
        else:
            state_tensors = [t for s in self.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
            dev["trainguard_optimizer_state_nonfinite"] = stats.nonfinite_count(state_tensors, self.device)
        age = state_age(self.optimizer)  # a device count rides with the report's copy: no sync
        if isinstance(age, torch.Tensor):
            dev["trainguard_optimizer_state_steps"] = age.to(self.device, torch.float64)
        elif age is not None:
            host["trainguard_optimizer_state_steps"] = age
        scale_now = self.meter.scale_tensor()
        if scale_now is not None:
            dev["trainguard_loss_scale"] = scale_now

    def _layer_metrics(self, st: StepState, at: PerTensor, derived: HostDerived) -> None:
        """The per-layer vectors, derived on the host (``report_host.layer_vectors``): the
        per-tensor squares summed per layer, the gradient statistics from their moments."""
        derived.job(functools.partial(
            layer_vectors, layer_of=self._layer_keys.layer_of(), keys=self._layer_keys.keys,
            grads=derived.vector(st.grad_norms) if st.grad_norms is not None else None,
            scale=derived.scalar(st.scale) if st.grad_norms is not None and st.scale is not None else None,
            param=at.param, delta=at.delta, before=at.before, moments=at.moments, ungraded=st.ungraded))

    def _rank_fields(self, dev: dict[str, torch.Tensor], st: StepState,
                     host: dict[str, float], gpu_xid: float = math.nan) -> tuple[torch.Tensor, int]:
        """This rank's ``RANK_FIELDS`` row (float64 device vector, in that order; ``rank_row``)."""
        return rank_row(dev, host, RowInputs(st, gpu_xid, _filler(dev["trainguard_loss"]), self.zero)), len(st.micro_norms)

    def _fingerprints(self, step: int, st: StepState) -> torch.Tensor | None:
        """This rank's fingerprint part of the row (the screen of ``fingerprint_rounds.py``; the
        per-layer values kept for a detail round): the gradients the optimizer used (measured in
        its pre-hook; NaN when no step was taken) and the parameters now, per layer."""
        fp, rounds = self.fingerprint, self.rounds
        if fp is None or rounds is None:
            return None
        # this rank's squared norms of its tensors, when the report has them (no sharding: the
        # sums over the ranks replace them there)
        sq = st.param_sq if st.param_sq is not None and self.index.sharding is None else None
        params = fp.layer_values(self.index.buckets, sq=sq)
        grads = st.grad_fp if st.grad_fp is not None else torch.full_like(params, math.nan)
        return rounds.row(step, grads, params)

    # ------------------------------------------------------------------ publication

    def publish(self, block: bool = False, limit: int | None = None) -> dict[str, float]:
        """Turn the reports in flight whose copies have completed into host values, oldest first;
        with ``block``, wait for the oldest ``limit`` (default: all) of them. Calls
        :attr:`on_published` per report; returns the newest values ({} if none)."""
        published: dict[str, float] = {}
        waits = len(self.pending) if limit is None else limit
        while self.pending and ((block and waits > 0) or self.pending[0].ready()):
            waits -= 1
            report = self.pending.popleft()
            published, rank_values = report.read()
            if self.world_size > 1 and isinstance(self._rank_values, RankVectors):
                self.worker.release(self._rank_values)  # the previous report's, freed off this thread
            self._rank_values = rank_values
            if self.on_published is not None:
                self.on_published(published, self._rank_values)
        return published

    @property
    def rank_values(self) -> dict[str, list[float]]:
        """The last published report's per-rank vectors: every rank's on the leader (resolved
        here if the worker has not yet), this rank's own (lists of one) on the others."""
        rv = self._rank_values
        return rv.resolve() if isinstance(rv, RankVectors) else dict(rv)

    @property
    def desync(self) -> list[DesyncFinding]:
        """Layers whose fingerprints differed across ranks at the last published report (the
        leader's; empty elsewhere)."""
        rv = self._rank_values
        return rv.desync if isinstance(rv, RankVectors) else []

    def off_thread(self, job: Callable[[], None], light: Callable[[], None] | None = None) -> None:
        """Run the leader's cross-rank ``job`` (resolving a :class:`RankVectors`, sending it on)
        on :attr:`worker`, or ``light`` there should the worker fall behind (see
        :class:`CrossRankWorker`); with one rank, ``job`` at once (nothing grows with the world)."""
        if self.world_size == 1:
            job()
        else:
            self.worker.submit(job, light)

    def worker_values(self) -> dict[str, float]:
        """How often the leader's cross-rank worker fell behind (none with one rank: no worker runs)."""
        if self.world_size == 1:
            return {}
        return {"trainguard_agent_cross_rank_lightened_total": float(self.worker.lightened),
                "trainguard_agent_cross_rank_dropped_total": float(self.worker.dropped)}

    def flush(self, timeout: float | None = None, *, stop: bool = False) -> bool:
        """Wait for the cross-rank jobs queued so far (see ``CrossRankWorker.flush``)."""
        return self.worker.flush(timeout, stop=stop)


def _largest_host_lr(lrs: Sequence[float | torch.Tensor] | None) -> float | None:
    """The largest of a step's LRs when all are host floats (None otherwise: no device read)."""
    if not lrs or any(isinstance(lr, torch.Tensor) for lr in lrs):
        return None
    top = max(float(lr) for lr in lrs)
    return top if math.isfinite(top) else None


def _filler(like: torch.Tensor) -> Callable[[float], torch.Tensor]:
    """``full(x)``: a 0-dim float64 tensor of ``x`` on ``like``'s device (a fill: no copy)."""
    return lambda x: torch.full_like(like, x)
