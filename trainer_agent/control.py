"""The control plane: the agent's actuators, and the agreement of all ranks on the controller's
desired state. This module *acts* on training (LR, pause, checkpoint, stop, skipped steps); the
rest of ``trainer_agent`` only observes.

Built by the agent on every rank when a controller URL is configured or
``AgentConfig.skip_nonfinite`` is set. Every rank must use the same ``controller`` (set or not),
``report_every``, ``sync_every`` and ``skip_nonfinite``: the collectives below are issued by every
rank at the same line of code, at steps chosen from those values and the step number only.

Where it hooks in (``Agent`` calls these; none of them raises into the loop):

=========================  ====================================================================
``__init__``               leader registers the run; all ranks agree on the registration's
                           desired state and apply it before the first step (a restarted run
                           resumes paused / at its lr_scale)
optimizer ``step`` wrapper only with ``skip_nonfinite``: one device sync and one all-reduce of a
                           flag per optimizer step; a non-finite step is not taken at all
``before_optimizer_step``  group LR := scheduler LR x lr_scale (optimizer pre-hook)
``after_optimizer_step``   group LR restored, so the scheduler keeps its own state (post-hook)
``on_end_step(step, …)``   every ``sync_every`` steps the agreement collective; every
                           ``report_every`` steps the same collective also gathers the per-rank
                           report values; the leader queues the report; the agreed state is
                           applied; a pause blocks here
=========================  ====================================================================

**Agreement.** The leader (global rank 0) holds the newest desired state its client has seen.
Every ``sync_every`` steps all ranks take part in one collective on a side *gloo* process group of
CPU tensors (no device sync): a broadcast of seven int64 (``generation, paused, lr_scale`` as the
bits of a float64, ``checkpoint_seq, stop, accumulation_steps, accumulation_lr_rule``), or on report
steps an all-gather that carries the same seven ints from the leader plus seven float64 report values from every rank (published step, step
time, loss, grad norm, grad and param fingerprints, input wait) and the rank's bottom-k sketch of
the sequences it observed since the last report (``trainer_agent/sketch.py``, 64 int64; the leader
turns the sketches into the report's ``data_overlap`` vector). All ranks then apply the same state at the same
step; the leader acks ``{generation, step}``. A generation is applied once: values are absolute,
so re-applying changes nothing, and a checkpoint is taken once per new ``checkpoint_seq``.

**Pause.** ``on_end_step`` blocks on every rank with no collective outstanding. The leader waits on
its client for a newer generation and publishes each one it applies under a fresh key of the
c10d store (``pause/<episode>/<i>``); the other ranks poll those keys (``check`` + a short sleep).
Every rank applies the same sequence of states at the same (paused) step and leaves when one has
``paused=false`` or ``stop=true``. No process-group timeout can expire meanwhile.

**Skipping non-finite steps** (``skip_nonfinite=True``). The optimizer instance's ``step`` is
wrapped; before the real step each rank reads whether its gradient norm is finite — the agent's
global norm measured at the end of backward (after DDP's all-reduce), in float64, so it is finite
exactly when every gradient element is, and no extra pass over the gradients is needed; SYNC: one
device-to-host read per optimizer step — and the ranks all-reduce (max) that flag on the side group.
(Gradients a user changes by hand after backward are not re-read; a rank whose own gradients are
finite still skips when another rank's are not.) If any rank
saw a non-finite gradient, no rank calls the real ``step``: parameters and optimizer state stay
bit-identical and the agent's step hooks do not fire (as for a GradScaler skip). The LR scheduler
keeps its own schedule. A loss that is non-finite while every gradient is finite is not skipped:
the loss reaches the agent only after the step (``end_step``), and such a loss does not depend on
any parameter the step would change.

**Accumulation steps** (runs attached with ``accumulation_steps=k0``, the run's own). The
controller's ``accumulation`` command sets ``k`` (0: back to ``k0``) and a rule; every rank applies it
at the same agreed step boundary: ``accumulation_steps`` becomes ``k`` (the training loop reads
``agent.accumulation_steps`` before each optimizer step and runs that many micro-batches) and the LR
of every group is multiplied, on top of ``lr_scale``, by ``batch_lr_factor(k, k0, rule)``: ``k/k0``
(``linear``), ``sqrt(k/k0)`` (``sqrt``) or 1 (``none``). A run that did not opt in is refused by the
controller and ignores the field.

**Fingerprints.** The report's per-rank ``grad_fingerprint``/``param_fingerprint`` are the global
L2 norms of the gradients and parameters each rank published: data-parallel replicas in sync
compute them bit-identically, so ranks whose fingerprints differ have diverged.
"""

from __future__ import annotations

import itertools
import logging
import math
import socket
import struct
import sys
import time
import types
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from functools import wraps
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from trainguard.protocol.wire import Ack, DesiredState, RankEndpoint, RankValues, Report, RunFinished, RunRegistration
from trainguard.protocol.catalog import BY_NAME
from trainer_agent.client import ControllerClient
from trainer_agent.sketch import EMPTY, SKETCH_K, overlaps

__all__ = ["ControlPlane", "Applied"]

log = logging.getLogger(__name__)

_STATE_LEN = 7  # generation, paused, lr_scale bits, checkpoint_seq, stop, accumulation steps, LR rule
_LR_RULES = ("none", "sqrt", "linear")
_VALUE_FIELDS = ("published_step", "step_time_s", "loss", "grad_norm", "grad_fingerprint", "param_fingerprint",
                 "input_wait_s")
_instances = itertools.count()  # same sequence on every rank: ControlPlanes are built in lockstep


@dataclass(frozen=True, slots=True)
class Applied:
    """One generation applied on this rank (``ControlPlane.history``)."""

    generation: int
    step: int
    paused: bool
    lr_scale: float
    checkpoint_seq: int
    stop: bool
    time: float
    """Wall-clock time (``time.time()``) at which it was applied."""
    accumulation_steps: int = 0
    """Accumulation steps in force from this step (0: the run's own, or the run did not opt in)."""


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _bits_float(i: int) -> float:
    return struct.unpack("<d", struct.pack("<q", i))[0]


def _encode(d: DesiredState) -> list[int]:
    return [d.generation, int(d.paused), _float_bits(d.lr_scale), d.checkpoint_seq, int(d.stop),
            d.accumulation_steps, _LR_RULES.index(d.accumulation_lr_rule)]


def _decode(v: list[int]) -> DesiredState:
    return DesiredState(
        generation=v[0], paused=bool(v[1]), lr_scale=_bits_float(v[2]), checkpoint_seq=v[3], stop=bool(v[4]),
        accumulation_steps=v[5], accumulation_lr_rule=_LR_RULES[v[6]],
    )


def batch_lr_factor(steps: int, own: int, rule: str) -> float:
    """The LR multiplier for ``steps`` accumulation steps against the run's ``own``: the global
    batch changes by steps / own; ``linear`` scales the LR by that ratio, ``sqrt`` by its square
    root, ``none`` not at all."""
    ratio = steps / own
    return {"none": 1.0, "sqrt": math.sqrt(ratio), "linear": ratio}[rule]


def _group_timeout() -> timedelta:
    """The default process group's timeout, so the side group fails no sooner and no later."""
    try:
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))
        return backend.options._timeout
    except Exception:  # noqa: BLE001 - a backend without options: torch's default
        return dist.default_pg_timeout


class ControlPlane:
    """Reports to the controller, agrees with the other ranks on its commands, and applies them.

    ``agent`` provides ``config``, ``job``, ``run``, ``rank``, ``world_size``, ``optimizer``,
    ``step``, ``grad_norm_device``, ``metrics_url`` and ``_current_values()`` (host values of the
    last published report). The keyword arguments after it inject what talks to the world; their
    defaults are the real thing: a new gloo group, the default c10d store, an HTTP transport.
    """

    def __init__(
        self,
        *,
        agent: Any,
        on_checkpoint: Callable[[int], Any] | None = None,
        group: Any = None,
        store: Any = None,
        transport: Any = None,
        long_poll_s: float = 10.0,
        pause_poll_s: float = 0.01,
        on_error: Callable[[str, BaseException], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        cfg = agent.config
        if on_checkpoint is not None and not callable(on_checkpoint):
            raise ValueError("on_checkpoint must be callable as on_checkpoint(step)")
        if not pause_poll_s > 0:
            raise ValueError(f"pause_poll_s must be > 0, got {pause_poll_s}")
        self._agent = agent
        self._cfg = cfg
        self._on_checkpoint = on_checkpoint
        self._on_error = on_error or getattr(agent, "_error", None) or (lambda kind, exc: log.exception(kind))
        self._clock, self._wall = clock, wall_clock
        self._pause_poll_s = pause_poll_s
        self.rank, self.world_size = int(agent.rank), int(agent.world_size)
        self.leader = self.rank == 0
        self._controlled = cfg.controller is not None
        self._instance = next(_instances)

        # applied state (identical on every rank)
        self._generation = 0
        self._lr_scale = 1.0
        self._paused = False
        self._stop = False
        self._checkpoint_seq = 0
        self._skipped = 0
        self._pause_episodes = 0
        #: The run's own accumulation steps (None: the run did not opt in to the command).
        self.own_accumulation: int | None = getattr(agent, "accumulation_base", None)
        self._accumulation = self.own_accumulation
        self._accumulation_desired = (0, "none")  # as last applied: (steps, rule)
        self._batch_lr_factor = 1.0
        self.history: deque[Applied] = deque(maxlen=4096)
        """The generations applied on this rank, oldest first (bounded)."""

        self._saved_lrs: list[Any] | None = None
        self._last_summary: dict[str, float] = {}
        self._last_reported_step = int(agent.step)
        self._broken = False
        self._closed = False

        self._group = group
        self._store = store
        self._own_group = False
        if self.world_size > 1 and self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=_group_timeout())
            self._own_group = True
        if self.world_size > 1 and self._store is None and self._controlled:
            base = dist.distributed_c10d._get_default_store()
            self._store = dist.PrefixStore(f"trainguard/{agent.run}/{self._instance}/", base)

        self._client: ControllerClient | None = None
        endpoints = self._endpoints() if self._controlled else []
        if self._controlled and self.leader:
            registration = RunRegistration(
                job=agent.job,
                run=agent.run,
                world_size=self.world_size,
                ranks=endpoints,
                agent_version=_version(),
                config={
                    "report_every": cfg.report_every,
                    "sync_every": cfg.sync_every,
                    "skip_nonfinite": cfg.skip_nonfinite,
                    **({"accumulation_steps": self.own_accumulation} if self.own_accumulation is not None else {}),
                },
            )
            self._client = ControllerClient(
                cfg.controller,
                registration=registration,
                token=cfg.token,
                request_timeout_s=cfg.request_timeout_s,
                long_poll_s=long_poll_s,
                max_buffered_reports=cfg.max_buffered_reports,
                transport=transport,
                clock=clock,
            )
            self._client.start()

        self._orig_step: Any = None
        if cfg.skip_nonfinite:
            self._wrap_optimizer_step(agent.optimizer)

        if self._controlled:
            self._start()

    # ------------------------------------------------------------------ public surface

    @property
    def should_stop(self) -> bool:
        """True on every rank from the step at which a ``stop`` was applied."""
        return self._stop

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def lr_scale(self) -> float:
        return self._lr_scale

    @property
    def applied_generation(self) -> int:
        return self._generation

    @property
    def accumulation_steps(self) -> int | None:
        """Accumulation steps every rank uses now (None when the run did not opt in)."""
        return self._accumulation

    @property
    def batch_lr_factor(self) -> float:
        """LR multiplier of the accumulation command's rule (1 unless the steps changed)."""
        return self._batch_lr_factor

    @property
    def client(self) -> ControllerClient | None:
        """The leader's controller client (None on other ranks and without a controller)."""
        return self._client

    def values(self) -> dict[str, float]:
        """The control metrics of this rank (host values; safe from the /metrics thread)."""
        out = {
            "trainguard_paused": 1.0 if self._paused else 0.0,
            "trainguard_lr_scale": self._lr_scale,
            "trainguard_applied_generation": float(self._generation),
        }
        if self._cfg.skip_nonfinite:
            out["trainguard_skipped_steps_total"] = float(self._skipped)
        if self._accumulation is not None:
            out["trainguard_accumulation_steps"] = float(self._accumulation)
        if self._client is not None:
            out["trainguard_agent_controller_up"] = 1.0 if self._client.up else 0.0
            out["trainguard_agent_reports_dropped_total"] = float(self._client.reports_dropped)
        return out

    def state_dict(self) -> dict[str, Any]:
        """What a training checkpoint must carry: lr_scale, the applied generation, the last
        checkpoint_seq served, and the skip counter."""
        return {
            "lr_scale": self._lr_scale,
            "applied_generation": self._generation,
            "checkpoint_seq": self._checkpoint_seq,
            "skipped_steps_total": self._skipped,
            "accumulation": list(self._accumulation_desired),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s values. A state the controller already superseded (the
        registration of the restarted run brought a newer generation) keeps the newer lr_scale and
        generation; the checkpoint_seq served is the larger of the two. ``ValueError`` for a
        malformed dict."""
        try:
            lr_scale = float(state["lr_scale"])
            generation = int(state["applied_generation"])
            seq = int(state["checkpoint_seq"])
            skipped = int(state["skipped_steps_total"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed trainguard control state: {exc!r}") from None
        if not (math.isfinite(lr_scale) and lr_scale > 0) or generation < 0 or seq < 0 or skipped < 0:
            raise ValueError(f"malformed trainguard control state: {dict(state)!r}")
        accumulation = state.get("accumulation", (0, "none"))
        try:
            steps, rule = int(accumulation[0]), str(accumulation[1])
        except (TypeError, ValueError, IndexError) as exc:
            raise ValueError(f"malformed trainguard control state: accumulation {accumulation!r} ({exc})") from None
        if steps < 0 or rule not in _LR_RULES:
            raise ValueError(f"malformed trainguard control state: accumulation {accumulation!r}")
        if generation >= self._generation:
            self._generation, self._lr_scale = generation, lr_scale
            self._set_accumulation(steps, rule)
        self._checkpoint_seq = max(self._checkpoint_seq, seq)
        self._skipped = skipped
        self._last_reported_step = int(self._agent.step)  # the agent restores its step first

    def close(self, timeout: float = 5.0) -> bool:
        """Unwrap the optimizer, flush and stop the client within ``timeout`` seconds, and
        release the side process group. True if everything finished in time.

        The leader's client also tells the controller the run finished (``POST
        /v1/runs/{run}/finish`` with the step and why: ``completed``, ``stopped`` when a stop was
        applied, ``error: <type>`` when called while an exception propagates), so the run is not
        reported silent; best effort, within the same deadline."""
        deadline = self._clock() + max(timeout, 0.0)
        self._closed = True
        self._unwrap_optimizer_step()
        ok = True
        if self._client is not None:
            finish = RunFinished(step=max(int(self._agent.step), 0), reason=self._finish_reason())
            ok = self._client.close(max(deadline - self._clock(), 0.0), finish=finish)
        if self._own_group and self._group is not None:
            try:
                dist.destroy_process_group(self._group)
            except Exception as exc:  # noqa: BLE001 - the default group may be gone already
                log.debug("trainguard: side group not destroyed: %r", exc)
            self._group = None
        return ok

    def _finish_reason(self) -> str:
        exc = sys.exc_info()[1]  # set when close() runs in an except/finally block of a failing loop
        if exc is not None:
            return f"error: {type(exc).__name__}"[:200]
        return "stopped" if self._stop else "completed"

    # ------------------------------------------------------------------ LR scale (step hooks)

    def before_optimizer_step(self) -> None:
        """Optimizer pre-hook: each group's LR becomes scheduler LR x lr_scale for this step."""
        if self._saved_lrs is not None:  # the last post-hook did not run (the step raised)
            self.after_optimizer_step()
        scale = self._lr_scale * self._batch_lr_factor
        if scale == 1.0:
            return
        groups = self._agent.optimizer.param_groups
        self._saved_lrs = [g["lr"] for g in groups]
        for g in groups:
            g["lr"] = g["lr"] * scale

    def after_optimizer_step(self) -> None:
        """Optimizer post-hook: restore the scheduler's LR objects (floats or tensors) as they were."""
        saved, self._saved_lrs = self._saved_lrs, None
        if saved is None:
            return
        for g, lr in zip(self._agent.optimizer.param_groups, saved):
            g["lr"] = lr

    # ------------------------------------------------------------------ end of step

    def on_end_step(self, step: int, summary: Mapping[str, float]) -> None:
        """Report (leader), agree (all ranks) and apply; blocks only while paused."""
        if summary:
            self._last_summary = dict(summary)
        if not self._controlled or self._broken or self._closed:
            return
        cfg = self._cfg
        gather = step % cfg.report_every == 0
        if not (gather or step % cfg.sync_every == 0):
            return
        try:
            state, rows, sketches = self._agree(gather)
        except Exception as exc:  # noqa: BLE001 - fail open: the job goes on without control
            self._broken = True
            self._on_error("control_agreement", exc)
            log.error("trainguard: ranks could not agree on the controller's state (%r); control "
                      "is off for the rest of this run, training goes on", exc)
            return
        if gather and self.leader:
            try:
                self._send_report(step, rows, sketches)
            except Exception as exc:  # noqa: BLE001 - a lost report must not keep the leader from applying
                self._on_error("control_report", exc)
        self._apply(state, step)

    # ------------------------------------------------------------------ internals: start

    def _endpoints(self) -> list[RankEndpoint]:
        """Every rank's /metrics endpoint, gathered on the side group (once, at start)."""
        mine: tuple[str, int, int] | None = None
        url = getattr(self._agent, "metrics_url", None)
        if url:
            parsed = urlparse(url)
            host = parsed.hostname or "127.0.0.1"
            if host in ("0.0.0.0", "::"):
                host = socket.getfqdn()
            mine = (host, int(parsed.port or 0), int(getattr(self._agent, "local_rank", 0)))
        found: list[Any] = [mine]
        if self.world_size > 1:
            found = [None] * self.world_size
            dist.all_gather_object(found, mine, group=self._group)
        return [
            RankEndpoint(rank=r, local_rank=e[2], host=e[0], port=e[1])
            for r, e in enumerate(found)
            if e is not None and e[1] > 0
        ]

    def _start(self) -> None:
        """Agree on the registration's desired state and apply it before the first step. A
        checkpoint requested before this process started is considered served by the checkpoint
        the run restarts from."""
        initial = DesiredState()
        if self._client is not None:
            initial = self._client.wait_registered(self._cfg.request_timeout_s) or initial
        try:
            state = self._broadcast(_encode(initial))
        except Exception as exc:  # noqa: BLE001 - fail open
            self._broken = True
            self._on_error("control_agreement", exc)
            return
        self._checkpoint_seq = state[3]
        self._apply(state, int(self._agent.step))

    # ------------------------------------------------------------------ internals: agreement

    def _leader_state(self) -> list[int]:
        """The state the leader proposes: its client's newest, or what is applied."""
        d = self._client.desired if self._client is not None else None
        if d is not None and d.generation > self._generation:
            return _encode(d)
        steps, rule = self._accumulation_desired
        return [self._generation, int(self._paused), _float_bits(self._lr_scale), self._checkpoint_seq, int(self._stop),
                steps, _LR_RULES.index(rule)]

    def _broadcast(self, leader_state: list[int]) -> list[int]:
        if self.world_size == 1:
            return leader_state
        t = torch.tensor(leader_state if self.leader else [0] * _STATE_LEN, dtype=torch.int64)
        dist.broadcast(t, src=0, group=self._group)  # gloo, CPU tensor: no device sync
        return t.tolist()

    def _agree(self, gather: bool) -> tuple[list[int], list[list[float]], Any]:
        """One collective: the leader's state to everyone and, when ``gather``, every rank's report
        values and the sketch of the sequences it saw since the last report to everyone (the
        leader uses them; ``SKETCH_K`` int64 per rank: no collective of its own)."""
        state = self._leader_state() if self.leader else [0] * _STATE_LEN
        if not gather:
            return self._broadcast(state), [], None
        values = self._local_values()
        if self.world_size == 1:
            return state, [values], None
        width = _STATE_LEN + len(values)
        row = torch.empty(width + SKETCH_K, dtype=torch.int64)
        row[:_STATE_LEN] = torch.tensor(state, dtype=torch.int64)
        row[_STATE_LEN:width] = torch.tensor(values, dtype=torch.float64).view(torch.int64)
        row[width:] = torch.from_numpy(self._local_sketch())
        out = torch.empty(self.world_size * row.numel(), dtype=torch.int64)
        dist.all_gather_single(out, row, group=self._group)  # gloo, CPU: no device sync
        out = out.view(self.world_size, row.numel())
        rows = out[:, _STATE_LEN:width].contiguous().view(torch.float64).tolist()
        return out[0, :_STATE_LEN].tolist(), rows, out[:, width:].numpy()

    def _local_sketch(self) -> Any:
        """This rank's sketch row (all slots empty without a data monitor or on an error)."""
        import numpy as np

        try:
            take = getattr(self._agent, "take_data_sketch", None)
            sketch = take() if take is not None else None
            if sketch is not None and len(sketch) == SKETCH_K:
                return np.asarray(sketch, dtype=np.int64)
        except Exception as exc:  # noqa: BLE001 - this rank's row still enters the gather
            self._on_error("data_sketch", exc)
        return np.full(SKETCH_K, EMPTY, dtype=np.uint64).view(np.int64)

    def _local_values(self) -> list[float]:
        """This rank's report values, from the last report it published (host floats)."""
        s = self._last_summary
        nan = math.nan
        return [
            s.get("trainguard_step", -1.0),
            s.get("trainguard_step_duration_seconds", nan),
            s.get("trainguard_loss", nan),
            s.get("trainguard_grad_norm", nan),
            s.get("trainguard_grad_norm", nan),
            s.get("trainguard_param_norm", nan),
            s.get("trainguard_input_wait_seconds", nan),
        ]

    def _send_report(self, step: int, rows: list[list[float]], sketches: Any = None) -> None:
        assert self._client is not None
        published = int(rows[0][0])
        if published <= self._last_reported_step:
            return  # nothing newer published yet (CUDA: the report copy is still in flight)
        current = self._agent._current_values()  # host values only: no device read
        values = {k: float(v) for k, v in current.items() if k in BY_NAME and not BY_NAME[k].labels}
        # ranks whose last published report is another step than the leader's: NaN
        cols = [[r[i] if int(r[0]) == published else math.nan for r in rows] for i in range(len(_VALUE_FIELDS))]
        report = Report(
            job=self._agent.job,
            step_first=self._last_reported_step + 1,
            step_last=published,
            time=self._wall(),
            values=values,
            ranks=RankValues(
                step_time_s=cols[1], loss=cols[2], grad_norm=cols[3], grad_fingerprint=cols[4], param_fingerprint=cols[5],
                input_wait_s=cols[6], **self._overlap(sketches),
            ),
            applied_generation=self._generation,
        )
        self._last_reported_step = published
        self._client.submit_report(report)

    def _overlap(self, sketches: Any) -> dict[str, list[float]]:
        """``data_overlap``: each rank's largest estimated Jaccard similarity with another rank
        (sketches of the sequences seen since the last report); absent when no rank saw data."""
        if sketches is None:
            return {}
        best, _ = overlaps(sketches, SKETCH_K)
        if all(math.isnan(b) for b in best.tolist()):
            return {}
        return {"data_overlap": best.tolist()}

    # ------------------------------------------------------------------ internals: applying

    def _apply(self, state: list[int], step: int) -> None:
        """Apply the agreed state (encoded) at ``step``; wait here if it pauses the run."""
        if state[0] <= self._generation:
            return  # the usual case: nothing new (a generation is applied once)
        self._set(_decode(state), step)
        if self._paused and not self._stop:
            self._pause(step)

    def _set(self, state: DesiredState, step: int) -> None:
        """Apply a newer ``state``'s values (not the pause wait)."""
        checkpoint = state.checkpoint_seq > self._checkpoint_seq
        stopping = state.stop and not self._stop
        self._generation = state.generation
        self._lr_scale = state.lr_scale
        self._checkpoint_seq = max(self._checkpoint_seq, state.checkpoint_seq)
        self._paused = state.paused
        self._set_accumulation(state.accumulation_steps, state.accumulation_lr_rule)
        if (checkpoint or stopping) and self._on_checkpoint is not None:
            try:
                self._on_checkpoint(step)
            except Exception as exc:  # noqa: BLE001 - the user's callback must not break agreement
                self._on_error("on_checkpoint", exc)
        if stopping:
            self._stop = True
        self.history.append(
            Applied(state.generation, step, state.paused, state.lr_scale, state.checkpoint_seq, state.stop, self._wall(),
                    self._accumulation or 0)
        )
        if self._client is not None:
            self._client.submit_ack(Ack(generation=state.generation, step=step))
        if state.reason and self.leader:
            log.info("trainguard: applied generation %d at step %d: %s", state.generation, step, state.reason)

    def _set_accumulation(self, steps: int, rule: str) -> None:
        """Accumulation steps ``steps`` (0: the run's own) with the LR following by ``rule``; a run
        that did not opt in keeps its own loop and LR."""
        self._accumulation_desired = (steps, rule)
        own = self.own_accumulation
        if own is None:
            return
        self._accumulation = steps or own
        self._batch_lr_factor = batch_lr_factor(self._accumulation, own, rule) if steps else 1.0

    def _pause(self, step: int) -> None:
        """Block until a generation with paused=false (or stop) is applied. No collective is
        outstanding: the leader waits on its client, the others poll the c10d store."""
        episode = self._pause_episodes
        self._pause_episodes += 1
        if self.leader and self._store is not None and episode > 0:
            self._forget_episode(episode - 1)
        log.warning("trainguard: rank %d paused at step %d (generation %d)", self.rank, step, self._generation)
        i = 0
        while self._paused and not self._stop and not self._closed:
            if self.leader:
                new = self._next_leader_state()
                if new is None:
                    continue
                if self.world_size > 1:
                    self._store.set(f"pause/{episode}/{i}", ",".join(map(str, _encode(new))))
            else:
                new = self._next_published_state(episode, i)
                if new is None:
                    return
            i += 1
            self._set(new, step)
        log.warning("trainguard: rank %d resumed at step %d (generation %d)", self.rank, step, self._generation)

    def _next_leader_state(self) -> DesiredState | None:
        """The controller's next generation, or None after a short wait without one."""
        d = self._client.wait_desired(self._generation, timeout=0.25) if self._client is not None else None
        if d is None or d.generation <= self._generation:
            time.sleep(self._pause_poll_s)  # never spin (e.g. the client is closing)
            return None
        return d

    def _next_published_state(self, episode: int, i: int) -> DesiredState | None:
        key = f"pause/{episode}/{i}"
        while not self._closed:
            if self._store.check([key]):
                return _decode([int(x) for x in self._store.get(key).decode().split(",")])
            time.sleep(self._pause_poll_s)
        return None

    def _forget_episode(self, episode: int) -> None:
        """Every rank read all keys of ``episode`` before leaving it, and has passed a
        collective since: the leader may delete them."""
        for i in itertools.count():
            key = f"pause/{episode}/{i}"
            try:
                if not self._store.check([key]):
                    return
                self._store.delete_key(key)
            except Exception:  # noqa: BLE001 - a store without delete_key keeps a few bytes more
                return

    # ------------------------------------------------------------------ skipping non-finite steps

    def _wrap_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        had_own = "step" in vars(optimizer)
        inner = optimizer.step
        plane = self

        @wraps(getattr(inner, "__func__", inner))  # keeps an LR scheduler's '_wrapped_by_lr_sched' mark
        def step(opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            if plane._skip_this_step():
                return None
            return inner(*args, **kwargs)

        # A bound method, as LR schedulers expect (they wrap ``optimizer.step.__func__``).
        optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]
        self._orig_step = (optimizer, had_own, inner)

    def _unwrap_optimizer_step(self) -> None:
        if self._orig_step is None:
            return
        optimizer, had_own, inner = self._orig_step
        self._orig_step = None
        if had_own:
            optimizer.step = inner
        else:
            vars(optimizer).pop("step", None)

    def _skip_this_step(self) -> bool:
        """True (on every rank) if any rank's gradients hold a NaN/Inf."""
        bad = 0
        try:
            norm = self._agent.grad_norm_device
            if norm is None:
                grads = [p.grad for g in self._agent.optimizer.param_groups for p in g["params"] if p.grad is not None]
                norm = (torch.stack([n.to(grads[0].device, torch.float64) for n in torch._foreach_norm(grads)]).sum()
                        if grads else None)
            if norm is not None:
                bad = int(not bool(torch.isfinite(norm)))  # SYNC: one device read per optimizer step
        except Exception as exc:  # noqa: BLE001 - fail open: this rank votes to take the step
            self._on_error("skip_nonfinite", exc)
        if self.world_size > 1:
            # Every rank reaches this all-reduce, whatever happened above on it.
            try:
                flag = torch.tensor([bad], dtype=torch.int64)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)  # gloo, CPU tensor
                bad = int(flag.item())
            except Exception as exc:  # noqa: BLE001 - fail open: take the step
                self._on_error("skip_nonfinite", exc)
                return False
        if bad:
            self._skipped += 1
        return bool(bad)


def _version() -> str:
    from trainer_agent import __version__

    return __version__
