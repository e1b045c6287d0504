"""(3) The report pipeline: the step's row of the report interval, the report built on the device,
the report step's collective, and the device-to-host copy published at a later ``end_step``.

On a report step (``ReportSchedule.is_report``) every device value of the report is concatenated
into one float64 vector, together with the ranks' gathered rows, and copied to the host: on CUDA
with a non-blocking copy into pinned memory, read at a later ``end_step`` once the copy's event has
completed; on the CPU the vector is the host copy. Host-device syncs: only where a comment says
``SYNC``.

With sharded parameters (``ParamIndex.sharding``: FSDP2, HSDP, tensor parallel) each rank holds
only its shares of the per-parameter sums (``trainer_agent/sharding.py``). The report step adds
them up over the ranks in one more collective, an ``all_reduce`` of one float64 vector (the
interval's per-step squared gradient norms, the per-parameter squared gradient, weight, update
and W_before norms, the non-finite counts), before anything is derived from them; every metric is
then the global one, equal on every rank. Steps that are not report steps issue no collective.

After the report step's gather a rank other than the leader (rank 0) keeps only its own row: its
host work per report does not grow with the world size. The leader copies every rank's row (and
sketch, and the fingerprint comparison) to the host with its report; the cross-rank part of a
published report is a :class:`RankVectors`, resolved once, off the training thread, by the
leader's :class:`CrossRankWorker` (the per-rank vectors, the fingerprint findings, the data
overlap of ``trainer_agent/sketch.py``), which then hands it on (the controller's report).
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from trainer_agent import stats
from trainer_agent.exporter import sample_key
from trainer_agent.fingerprint import DesyncFinding, Fingerprinter, desync, findings
from trainer_agent.triage import UpdateModel
from trainer_agent.params import ParamIndex
from trainer_agent.rank_row import RowInputs, rank_row
from trainer_agent.report_host import HostDerived, PerTensor, layer_vectors, noise_scale_values, update_values
from trainer_agent.ranks import RANK_FIELDS, RankExchange
from trainer_agent.sharding import local
from trainer_agent.step_stats import StepMeter, StepState, unscale

__all__ = ["CrossRankWorker", "HostStep", "InFlight", "RankVectors", "ReportPipeline", "MAX_IN_FLIGHT", "MAX_QUEUED"]

log = logging.getLogger(__name__)

#: Reports whose device-to-host copy may be in flight at once (the host waits beyond that).
MAX_IN_FLIGHT = 4

#: The leader's published reports waiting for the cross-rank worker with their whole cross-rank
#: work; beyond that the oldest runs its light form instead (the report sent without the
#: comparisons that grow with the world), and only past ``LIGHT_QUEUED`` more is one dropped
#: (counted): the training thread never waits for the worker.
MAX_QUEUED = 8
LIGHT_QUEUED = 64

Decode = Callable[[np.ndarray], tuple[dict[str, list[float]], list[DesyncFinding]]]


@dataclass(frozen=True, slots=True)
class HostStep:
    """What the host knows about the step being reported (no device value)."""

    step: int
    duration: float
    tokens: int | None
    forward_seconds: float
    amp_skipped: int
    input_wait: float = math.nan
    """Mean wait per step for the batch since the last report (``trainer_agent/inputs.py``)."""
    micro_batches: int = 0
    """Backward passes of the step on this rank (the batch size without ``tokens``)."""
    world_size: int = 1
    verify_mismatch: float = math.nan
    """Relative difference of the last gradient recompute check since the last report
    (``trainer_agent/verify.py``; NaN: none)."""
    verify_float32: float = math.nan
    """Relative difference of the last float32 recompute since the last report (NaN: none)."""
    gpu_xid: float = math.nan
    """Last critical XID code of this rank's GPU since the last report (0: none; NaN: not watched)."""
    scheduled_lr: Mapping[str, float] = field(default_factory=dict)
    """What the user's scheduler asked for in the interval (``ScheduledLr.take``: host floats)."""
    comm: Mapping[str, float] = field(default_factory=dict)
    """The interval's gradient communication times (``CommTiming.take``; empty without it)."""


class RankVectors(Mapping[str, list[float]]):
    """The leader's per-rank vectors of one published report, ``{field: [rank 0, rank 1, ...]}``:
    the ``RANK_FIELDS`` columns, the fingerprint vectors and ``data_overlap``, made from the host
    copy of the gathered rows once, on first use (thread-safe: the cross-rank worker resolves it;
    any other reader waits for that or resolves it itself). ``desync``: the layers whose
    fingerprints differ. ``matrix``: the rows as they arrived, (world, RANK_FIELDS) float64."""

    def __init__(self, matrix: np.ndarray, *, sketches: np.ndarray | None = None,
                 compared: np.ndarray | None = None, decode: Decode | None = None,
                 compare: Callable[[], torch.Tensor] | None = None) -> None:
        """``compared``: the fingerprint comparison's host vector, or ``compare``: what makes it
        (at resolution); ``decode``: its findings."""
        self.matrix = matrix
        self._sketches, self._compared, self._decode, self._compare = sketches, compared, decode, compare
        self._lock = threading.Lock()
        self._vectors: dict[str, list[float]] | None = None
        self._desync: list[DesyncFinding] = []

    @property
    def world(self) -> int:
        return self.matrix.shape[0]

    def column(self, name: str) -> np.ndarray:
        """One ``RANK_FIELDS`` column (a view of :attr:`matrix`, no resolution)."""
        return self.matrix[:, RANK_FIELDS.index(name)]

    def resolve(self) -> dict[str, list[float]]:
        """The vectors (computed on the first call, by whichever thread makes it)."""
        with self._lock:
            if self._vectors is None:
                vectors = RankExchange.unpack_rows(self.matrix, self.world)
                if self._compare is not None:
                    self._compared = self._compare().cpu().numpy()
                if self._decode is not None and self._compared is not None:
                    found, self._desync = self._decode(self._compared)
                    vectors.update(found)
                if self._sketches is not None:
                    overlap = RankExchange.data_overlap(self._sketches)
                    if overlap is not None:
                        vectors["data_overlap"] = overlap
                self._vectors = vectors
                self._sketches = self._compared = self._compare = None  # done with them
            return self._vectors

    @property
    def desync(self) -> list[DesyncFinding]:
        """Layers whose fingerprints differ across ranks by more than the tolerance (worst first)."""
        self.resolve()
        return self._desync

    def light(self) -> "LightRankVectors":
        """The ``RANK_FIELDS`` columns alone (no data overlap, no fingerprint comparison: NaN in
        the report, which the rules read as no verdict): what the leader sends when its
        cross-rank worker falls behind."""
        with self._lock:
            if self._vectors is not None:
                return LightRankVectors(self._vectors, self._desync)
        return LightRankVectors(RankExchange.unpack_rows(self.matrix, self.world), [])

    def __getitem__(self, key: str) -> list[float]:
        return self.resolve()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.resolve())

    def __len__(self) -> int:
        return len(self.resolve())


class CrossRankWorker:
    """The leader's daemon thread for the cross-rank work of its published reports: runs the jobs
    :meth:`submit` queues, oldest first, off the training thread. At most ``max_queued`` wait
    whole; beyond that the oldest whole job is replaced by its ``light`` form (``lightened``,
    logged once: e.g. the report sent with its per-rank columns but without the overlaps and the
    fingerprint comparison, so that a NaN it carries still reaches the controller), and a job
    without one, or past ``light_queued`` light jobs, is dropped (``dropped``, logged once). A
    job's exception is logged and passed to ``on_error``; the next job runs."""

    def __init__(self, name: str = "trainguard-ranks", *, max_queued: int = MAX_QUEUED,
                 light_queued: int = LIGHT_QUEUED,
                 on_error: Callable[[str, BaseException], None] | None = None) -> None:
        self.name, self.max_queued, self.light_queued, self.on_error = name, max_queued, light_queued, on_error
        self.dropped = 0
        self.lightened = 0
        # [job, light] per queued report, oldest first; the light ones (light None) form a prefix
        # of ``_light`` entries, since the oldest whole job is always the one made light.
        self._jobs: deque[list[Any]] = deque()
        self._light = 0
        self._cond = threading.Condition()
        self._busy = False
        self._closing = False
        self._thread: threading.Thread | None = None
        # Objects handed over by release(), dropped here when a later job is taken
        self._garbage: deque[Any] = deque()

    def release(self, obj: Any) -> None:
        """Have the worker drop ``obj`` (never waits). A resolved report's per-rank vectors hold
        a Python float per rank and field: at 32,768 ranks, freeing them and the gathered rows
        costs ~5 ms of CPU, which must not land on the training thread. The newest object handed
        over is kept until the next one arrives, so the caller's own last reference has surely
        gone before the worker drops it (:meth:`_run`)."""
        with self._cond:
            if not self._closing:
                self._garbage.append(obj)
            stale = self._garbage.popleft() if len(self._garbage) > 2 else None  # no job came to drop them
        del stale

    def submit(self, job: Callable[[], None], light: Callable[[], None] | None = None) -> None:
        """Queue ``job`` (never waits), with ``light``: what to run instead should the queue
        overflow before its turn. Starts the thread on first use."""
        with self._cond:
            if self._closing:
                return
            if len(self._jobs) - self._light >= self.max_queued:
                oldest = self._jobs[self._light]
                if oldest[1] is not None:
                    oldest[0], oldest[1] = oldest[1], None
                    self._light += 1
                    self.lightened += 1
                    if self.lightened == 1:
                        log.warning("trainguard: the leader's cross-rank work falls behind the reports; the "
                                    "oldest waiting report goes without its cross-rank comparisons (data overlap, "
                                    "fingerprints): reports come faster than %s can resolve them", self.name)
                else:
                    del self._jobs[self._light]
                    self._drop()
            if self._light > self.light_queued:
                self._jobs.popleft()
                self._light -= 1
                self._drop()
            self._jobs.append([job, light])
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _drop(self) -> None:
        self.dropped += 1
        if self.dropped == 1:
            log.warning("trainguard: the leader's cross-rank work falls behind the reports; the oldest waiting "
                        "report is dropped (reports come faster than %s can send them)", self.name)

    def flush(self, timeout: float | None = None, *, stop: bool = False) -> bool:
        """Wait until every queued job has run (at most ``timeout`` s); with ``stop``, then end
        the thread (later submissions are ignored). True when nothing was left."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._jobs or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cond.wait(left)
            done = not (self._jobs or self._busy)
            if stop:
                self._closing = True
                self._jobs.clear()
                self._garbage.clear()
                self._light = 0
                self._cond.notify_all()
            return done

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._jobs or self._closing):
                    self._cond.wait()
                if not self._jobs:
                    self._garbage.clear()
                    return
                job = self._jobs.popleft()[0]
                if self._light:
                    self._light -= 1
                self._busy = True
                garbage = [self._garbage.popleft() for _ in range(len(self._garbage) - 1)]
            garbage.clear()  # freed here, off the training thread (see release)
            try:
                job()
            except Exception as exc:  # noqa: BLE001 - one report's failure must not stop the next
                if self.on_error is not None:
                    self.on_error("cross_rank", exc)
                else:
                    log.warning("trainguard: cross-rank work of a report failed: %r", exc)
            finally:
                job = None  # noqa: F841 - holds the report (and the agent) no longer than it runs
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


class LightRankVectors(dict):
    """Per-rank vectors of a report sent without its cross-rank comparisons (``RankVectors.light``)."""

    def __init__(self, vectors: Mapping[str, list[float]], desync: list[DesyncFinding]) -> None:
        super().__init__(vectors)
        self.desync = desync


class InFlight:
    """One report on its way from the device to the host. ``ranks``: the rows in the buffer
    (every rank's on the leader, this rank's own elsewhere); ``sketch_len``: the leader's sketch
    part after them (0 without one); ``desync_len``: the fingerprint comparison before them.
    ``rows`` / ``sketches``: the same parts as host tensors kept apart (rows the collective left
    on the host: not copied into the buffer); ``compare``: makes the fingerprint comparison later
    (instead of ``desync_len`` values in the buffer); ``derived``: the host-derived values'
    inputs, right after the keyed values (``trainer_agent/report_host.py``)."""

    __slots__ = ("step", "keys", "buffer", "event", "host", "ranks", "desync_len", "decode", "sketch_len", "leader",
                 "rows", "sketches", "compare", "derived")

    def __init__(self, step: int, keys: list[str], buffer: torch.Tensor, event: Any,
                 host: dict[str, float], ranks: int, desync_len: int = 0, decode: Decode | None = None,
                 sketch_len: int = 0, leader: bool = True, rows: torch.Tensor | None = None,
                 sketches: torch.Tensor | None = None, compare: Callable[[], torch.Tensor] | None = None,
                 derived: HostDerived | None = None) -> None:
        self.step, self.keys, self.buffer, self.event, self.host, self.ranks = step, keys, buffer, event, host, ranks
        self.derived = derived
        self.compare = compare
        self.desync_len, self.decode, self.sketch_len, self.leader = desync_len, decode, sketch_len, leader
        self.rows, self.sketches = rows, sketches

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def read(self) -> tuple[dict[str, float], dict[str, list[float]] | RankVectors]:
        """(values, rank values) on the host: O(values) here; on the leader of several ranks the
        rank values are a :class:`RankVectors` (views of the buffer, resolved later)."""
        if self.event is not None:
            self.event.synchronize()  # SYNC: waits for the report's copy only (no-op when done)
        n = len(self.keys)
        d = n + (self.derived.length if self.derived is not None else 0)
        at = d + self.desync_len
        flat = self.buffer.numpy()  # a view (pinned buffer or CPU tensor): no device read
        values = dict(zip(self.keys, flat[:n].tolist()))
        if not self.leader or (self.ranks == 1 and self.decode is None and not self.sketch_len):
            # one rank's values (this rank's own); lists of one
            own = self.rows.numpy()[:1] if self.rows is not None else flat[at:at + len(RANK_FIELDS)].reshape(1, -1)
            self._derive(values, flat[n:d], own)
            return values, {f: [v] for f, v in zip(RANK_FIELDS, own[0].tolist())}
        if self.rows is not None:
            rows = self.rows.numpy()
            sketches = self.sketches.numpy() if self.sketches is not None else None
        else:
            rows = flat[at:at + self.ranks * len(RANK_FIELDS)].reshape(self.ranks, len(RANK_FIELDS))
            sketches = flat[flat.size - self.sketch_len:].reshape(self.ranks, -1) if self.sketch_len else None
        self._derive(values, flat[n:d], rows)
        return values, RankVectors(rows, sketches=sketches, decode=self.decode, compare=self.compare,
                                   compared=flat[d:at] if self.decode is not None and self.compare is None else None)

    def _derive(self, values: dict[str, float], flat: np.ndarray, rows: np.ndarray) -> None:
        if self.derived is not None:
            self.derived.apply(values, flat, rows)
        values.update(self.host)


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
        self.update_model = UpdateModel(optimizer, index.params, index.device)
        #: flops_per_token / peak_flops of one device (``trainer_agent/flops.py``): MFU per token/s.
        self.mfu_per_token_rate: float | None = None
        self.desync_rel_tol = desync_rel_tol
        self.meter = meter
        self.exchange = exchange
        self.optimizer = optimizer
        self.device = index.device
        self.grad_noise = grad_noise
        self.per_layer = per_layer
        self._clock = clock
        self.world_size = exchange.world_size
        # Non-finite steps before the current report interval (device scalar: no sync).
        self.nonfinite_steps = torch.zeros((), dtype=torch.float64, device=self.device)
        # One row per step of the report interval, (loss, pre-clip gradient norm or 0), on the
        # device: a step costs one small copy; the report derives from the rows the interval's
        # non-finite steps, its first non-finite loss (the loss the report then carries, so a NaN
        # between two reports is not lost) and its largest finite gradient norm. Zeroed (all
        # finite) after each report. 16 bytes per step of report_every.
        self.interval = torch.zeros(report_every, 2, dtype=torch.float64, device=self.device)
        self.zero = torch.zeros((), dtype=torch.float64, device=self.device)
        self.pending: deque[InFlight] = deque()  # reports in flight, oldest first
        self.gathered_step = -1  # the step whose rows entered the exchange last
        self.summed_step = -1  # the step whose shares entered the sharded sum last
        # Optimizer-state non-finite count summed over the ranks (sharded parameters only).
        self._state_nonfinite: torch.Tensor | None = None
        self._rank_values: Mapping[str, list[float]] = {}
        self._layer_keys: dict[tuple[str, ...], list[str]] = {}
        self._layer_of: np.ndarray | None = None  # the layer of each parameter, on the host

    # ------------------------------------------------------------------ every step

    def record_step(self, step: int, loss_t: torch.Tensor, grad_norm: torch.Tensor | None) -> torch.Tensor:
        """The step's row of the interval: (loss, grad norm); a step without one counts it as 0.
        With sharded parameters ``grad_norm`` is the step's ``StepState.grad_share`` (a share of
        the squared norm), turned into the global norm at the report."""
        row = torch.stack([loss_t, grad_norm if grad_norm is not None else self.zero])
        self.interval[(step - 1) % self.interval.shape[0]].copy_(row)
        return row

    def interval_nonfinite(self, nan_where_bad: torch.Tensor | None = None) -> torch.Tensor:
        """Non-finite steps among the report interval's rows (device scalar; unused rows are 0).
        ``nan_where_bad``: ``interval * 0``, if made already (NaN exactly where a value is NaN or
        +-Inf, else 0): a row's sum is NaN, which ``count_nonzero`` counts, exactly when it holds
        a non-finite value."""
        if nan_where_bad is None:
            nan_where_bad = self.interval * 0
        return torch.count_nonzero(nan_where_bad.sum(dim=1))

    # ------------------------------------------------------------------ report steps

    def build(self, st: StepState, loss_t: torch.Tensor, host_step: HostStep, overhead: float,
              state: Sequence[int] | None, sketch: Sequence[int] | None = None) -> list[int] | None:
        """Build the report of ``host_step.step``, enter the exchange with ``state`` (the leader's
        proposal, or None) and ``sketch`` (this rank's sequences, or None), queue the copy.
        Returns the agreed desired state (None without one)."""
        if len(self.pending) >= MAX_IN_FLIGHT:
            self.publish(block=True, limit=1)  # SYNC: only when the device runs that far behind
        if self.index.sharding is not None:
            self.sum_shards(host_step.step, st)
        dev: dict[str, torch.Tensor] = {}  # sample key -> device scalar
        derived = HostDerived()  # what the host derives from the copy (trainer_agent/report_host.py)
        host = self._host_values(host_step)
        self._interval_values(dev, loss_t, st.grad_norm)
        param = self._param_values(dev, st, derived)
        self._optimizer_values(dev, host, st)
        if self.per_layer:
            self._layer_metrics(st, param, derived)
        host["trainguard_agent_overhead_seconds"] = overhead
        fields, micro_count = self._rank_fields(dev, st, host, host_step.gpu_xid)
        extra = self._fingerprints(st)
        gathered = self.enter_exchange(host_step.step, self.exchange.pack(fields, state, sketch, extra=extra))
        ex = self.exchange
        every_row = ex.fields(gathered)
        compared = sketches = compare = None
        if ex.leader:  # every rank's rows; the others keep their own (O(1) whatever the world size)
            # the noise scale is the job's (every rank's micro-batch sums): the leader's value
            if self.grad_noise:
                derived.job(functools.partial(noise_scale_values, micro_count=micro_count,
                                              world_size=self.world_size, tokens=host_step.tokens))
            rows = every_row  # where the collective left them (host rows stay on the host)
            sketches = ex.sketches(gathered)
            if self.fingerprint is not None:
                fp, extra = self.fingerprint, ex.extra(gathered)
                if extra.device.type == "cpu":  # host rows (gloo): compared on the cross-rank worker
                    compare = lambda: desync(extra, fp.layers, fp.k, fp.groups)  # noqa: E731
                else:  # device rows: compared on the device, no sync
                    compared = desync(extra.to(self.device), fp.layers, fp.k, fp.groups)
        else:
            rows = every_row[ex.rank:ex.rank + 1].to(self.device)
        agreed = ex.agreed(gathered, state)
        self.pending.append(self._pack(host_step.step, dev, rows, host, compared, sketches, compare, derived))
        return agreed

    def _shard_width(self) -> int:
        return self.interval.shape[0] + 4 * len(self.index.params) + 4

    def sum_shards(self, step: int, st: StepState) -> None:
        """Sharded parameters: replace this rank's shares in ``st`` and in the interval's gradient
        column by their sums over the ranks (one ``all_reduce``; see the module docstring). If
        building the vector fails, the collective is still entered (with NaN) and the error
        raised afterwards, so no other rank waits alone."""
        sharding = self.index.sharding
        assert sharding is not None
        n = len(self.index.params)
        error: Exception | None = None
        try:
            vector = self._shares(st, n)
        except Exception as exc:  # noqa: BLE001 - re-raised after the collective
            error = exc
            vector = torch.full((self._shard_width(),), math.nan, dtype=torch.float64, device=self.device)
        self.summed_step = step  # entered (even if it fails): never entered twice per step
        total = sharding.sum_over_ranks(vector)
        if error is not None:
            raise error
        r = self.interval.shape[0]
        grad_sq, param_sq, delta_sq, before_sq = total[r:r + 4 * n].view(4, n).unbind(0)
        grad_nonfinite, state_nonfinite, have_grads, have_update = total[r + 4 * n:].unbind(0)
        world = sharding.world_size
        self.interval[:, 1] = total[:r].sqrt()
        self._state_nonfinite = state_nonfinite
        st.param_sq = param_sq
        if st.grad_norms is not None:
            # The meter's flags agree on every rank (same schedule, same steps taken): a rank
            # that lacks a value lacks it everywhere; have_* only guards the derivation.
            st.grad_norms = torch.where(have_grads == world, grad_sq, math.nan).sqrt()
            st.grad_norm = unscale(st.grad_norms.square().sum().sqrt(), st.scale)
            st.grad_nonfinite = grad_nonfinite
        if st.delta_sq is not None and st.before_sq is not None:
            st.delta_sq = torch.where(have_update == world, delta_sq, math.nan)
            st.before_sq = before_sq

    def _shares(self, st: StepState, n: int) -> torch.Tensor:
        sharding = self.index.sharding
        assert sharding is not None
        zeros = torch.zeros(n, dtype=torch.float64, device=self.device)
        param_sq = st.param_sq if st.param_sq is not None else self.index.sq_norms()
        have_update = st.delta_sq is not None and st.before_sq is not None
        columns = [
            st.grad_norms.to(torch.float64).square() if st.grad_norms is not None else zeros,
            param_sq,
            st.delta_sq if have_update else zeros,
            st.before_sq if have_update else zeros,
        ]
        kept = sharding.kept
        params = self.index.params
        state_tensors = [local(t) for i in kept for t in self.optimizer.state.get(params[i], {}).values()
                         if isinstance(t, torch.Tensor)]
        scalars = torch.stack([
            st.grad_nonfinite if st.grad_nonfinite is not None else self.zero,
            stats.nonfinite_count(state_tensors, self.device).to(torch.float64),
            self.zero + (st.grad_norms is not None),
            self.zero + have_update,
        ])
        scalars[:2] *= sharding.count_share
        return torch.cat([self.interval[:, 1], sharding.shares(torch.stack(columns)).reshape(-1), scalars])

    def enter_exchange(self, step: int, row: torch.Tensor) -> torch.Tensor:
        self.gathered_step = step  # entered (even if it fails): never entered twice per step
        return self.exchange.gather(row)

    def join_exchange(self, step: int, state: Sequence[int] | None) -> list[int] | None:
        """After an error while building the report of ``step``: if its exchange was not entered,
        enter it with a NaN row (and a valid state part), so an error on one rank never leaves
        the others waiting in the collective (nor pairs theirs with this rank's next one)."""
        if self.gathered_step == step:
            return None
        if self.index.sharding is not None and self.summed_step != step:
            self.summed_step = step
            self.index.sharding.sum_over_ranks(
                torch.full((self._shard_width(),), math.nan, dtype=torch.float64, device=self.device))
        return self.exchange.agreed(self.enter_exchange(step, self.exchange.nan_row(self.device, state)), state)

    def _host_values(self, h: HostStep) -> dict[str, float]:
        host = {"trainguard_step": float(h.step),
                "trainguard_amp_skipped_steps_total": float(h.amp_skipped),
                "trainguard_step_duration_seconds": h.duration,
                "trainguard_forward_seconds": h.forward_seconds}
        if h.tokens is not None:
            host["trainguard_tokens_per_second"] = h.tokens / h.duration if h.duration > 0 else math.inf
            if self.mfu_per_token_rate is not None and h.duration > 0:
                host["trainguard_mfu"] = host["trainguard_tokens_per_second"] * self.mfu_per_token_rate
        if not math.isnan(h.input_wait):
            host["trainguard_input_wait_seconds"] = h.input_wait
        if h.tokens or h.micro_batches:
            host["trainguard_global_batch_size"] = float((h.tokens or h.micro_batches) * h.world_size)
        if not math.isnan(h.verify_mismatch):  # a check in this interval (trainer_agent/verify.py)
            host["trainguard_verify_rel_diff"] = h.verify_mismatch
        if not math.isnan(h.verify_float32):  # a float32 recompute in this interval
            host["trainguard_verify_float32_rel_diff"] = h.verify_float32
        if h.gpu_xid > 0:  # an XID error in this interval
            host["trainguard_gpu_last_xid"] = h.gpu_xid
        host.update(h.scheduled_lr)
        host.update(h.comm)
        host.update(stats.memory(self.device))
        return host

    def _interval_values(self, dev: dict[str, torch.Tensor], loss_t: torch.Tensor,
                         grad_norm: torch.Tensor | None) -> None:
        rows = self.interval
        nan_where_bad = rows * 0  # x * 0 is NaN exactly where x is NaN or +-Inf, else 0
        losses, norms = rows.unbind(1)
        self.nonfinite_steps += self.interval_nonfinite(nan_where_bad)
        # A non-finite loss anywhere in the interval is the interval's loss: the first one (argmin
        # finds the first NaN of the loss column; take: indexing with a device tensor could read it
        # on the host); the column sums to 0 exactly when every loss is finite.
        bad_loss = nan_where_bad.select(1, 0)
        first_bad = losses.take(bad_loss.argmin())
        dev["trainguard_loss"] = torch.where(bad_loss.sum() == 0, loss_t, first_bad)
        # the counter itself: it changes next at the next report, after this report's copy
        # (device order), so no snapshot of it is needed
        dev["trainguard_nonfinite_steps_total"] = self.nonfinite_steps
        if grad_norm is not None:
            dev["trainguard_grad_norm"] = grad_norm
            dev["trainguard_grad_norm_max"] = norms.nan_to_num(0.0, 0.0, 0.0).amax()  # the largest finite one
        rows.zero_()  # after its last reader above (device order)

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
        if self._state_nonfinite is not None:  # sharded: summed over the ranks in sum_shards
            dev["trainguard_optimizer_state_nonfinite"] = self._state_nonfinite
        else:
            state_tensors = [t for s in self.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
            dev["trainguard_optimizer_state_nonfinite"] = stats.nonfinite_count(state_tensors, self.device)
        scale_now = self.meter.scale_tensor()
        if scale_now is not None:
            dev["trainguard_loss_scale"] = scale_now

    def _layer_metrics(self, st: StepState, at: PerTensor, derived: HostDerived) -> None:
        """The per-layer vectors, derived on the host (``report_host.layer_vectors``): the
        per-tensor squares summed per layer, the gradient statistics from their moments."""
        layers = self.index.layers
        if self._layer_of is None:
            self._layer_of = np.asarray(self.index.layer_ids.tolist(), dtype=np.int64)

        def keys_of(*metrics: str) -> list[str]:
            keys = self._layer_keys.get(metrics)
            if keys is None:
                keys = self._layer_keys[metrics] = [sample_key(m, layer=layer) for layer in layers for m in metrics]
            return keys

        derived.job(functools.partial(
            layer_vectors, layer_of=self._layer_of, keys=keys_of,
            grads=derived.vector(st.grad_norms) if st.grad_norms is not None else None,
            scale=derived.scalar(st.scale) if st.grad_norms is not None and st.scale is not None else None,
            param=at.param, delta=at.delta, before=at.before, moments=at.moments))

    def _rank_fields(self, dev: dict[str, torch.Tensor], st: StepState,
                     host: dict[str, float], gpu_xid: float = math.nan) -> tuple[torch.Tensor, int]:
        """This rank's ``RANK_FIELDS`` row (float64 device vector, in that order; ``rank_row``)."""
        return rank_row(dev, host, RowInputs(st, gpu_xid, _filler(dev["trainguard_loss"]), self.zero)), len(st.micro_norms)

    def _fingerprints(self, st: StepState) -> torch.Tensor | None:
        """This rank's fingerprint part of the row: the gradients the optimizer used (measured in
        its pre-hook; NaN when no step was taken) and the parameters now, per layer."""
        fp = self.fingerprint
        if fp is None:
            return None
        # this rank's squared norms of its tensors, when the report has them (no sharding: the
        # sums over the ranks replace them there)
        sq = st.param_sq if st.param_sq is not None and self.index.sharding is None else None
        params = fp.layer_values(self.index.buckets, sq=sq)
        grads = st.grad_fp if st.grad_fp is not None else torch.full_like(params, math.nan)
        return fp.row(grads, params)  # float32 pairs (fingerprint.py)

    def _pack(self, step: int, dev: dict[str, torch.Tensor], rows: torch.Tensor, host: dict[str, float],
              compared: torch.Tensor | None = None, sketches: torch.Tensor | None = None,
              compare: Callable[[], torch.Tensor] | None = None, derived: HostDerived | None = None) -> InFlight:
        """``compared``: the fingerprint comparison, copied with the report; ``compare``: the same
        made later, off the training thread (host rows). ``derived``: its scalars join the keyed
        values' one ``stack``, its vectors follow them (``torch.cat`` promotes them to float64: no
        operator of their own)."""
        scalars = {**dev, **(derived.scalars if derived is not None else {})}
        keys = list(scalars)
        pieces = [torch.stack([v if v.dim() == 0 and v.dtype == torch.float64 else v.reshape(()).to(torch.float64)
                               for v in scalars.values()])]
        if derived is not None:
            pieces += derived.vectors
        decode, desync_len = None, 0
        if compared is not None or compare is not None:
            if compared is not None:
                pieces.append(compared)
                desync_len = compared.numel()
            assert self.fingerprint is not None
            world, names, tol = rows.shape[0], self.fingerprint.names, self.desync_rel_tol
            decode = lambda flat: findings(flat, world, names, tol)  # noqa: E731
        if self.exchange.leader and rows.device.type == "cpu":  # rows the collective left on the host (gloo): kept, not copied
            rows_kept, sketches_kept = rows, sketches
        else:
            rows_kept = sketches_kept = None
            pieces.append(rows.to(self.device).reshape(-1))
            if sketches is not None:  # int64 bits as float64: cat copies bits
                pieces.append(sketches.to(self.device).reshape(-1))
        vec = torch.cat(pieces)
        event = None
        if vec.device.type == "cuda":
            buffer = torch.empty(vec.shape, dtype=vec.dtype, pin_memory=True)
            buffer.copy_(vec, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            vec = buffer
        return InFlight(step, keys, vec, event, host, rows.shape[0], desync_len=desync_len, decode=decode,
                        sketch_len=sketches.numel() if sketches is not None else 0, leader=self.exchange.leader,
                        rows=rows_kept, sketches=sketches_kept, compare=compare, derived=derived)

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
