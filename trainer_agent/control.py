"""The control plane: the agent's actuators, and the agreement of all ranks on the controller's
desired state. This module and the actuators *act* on training; the rest of ``trainer_agent``
only observes.

Built by the agent on every rank when a controller URL is configured or
``AgentConfig.skip_nonfinite`` is set. Every rank must use the same ``controller`` (set or not),
``report_every``, ``sync_every`` and ``skip_nonfinite``: the collectives below are issued by every
rank at the same line of code, at steps chosen from those values and the step number only.

Where it hooks in (``Agent`` calls these; none of them raises into the loop):

=========================  ====================================================================
``__init__``               leader registers the run; all ranks agree on the registration's
                           desired state and apply it before the first step (a restarted run
                           resumes paused / at its lr_scale)
optimizer ``step`` wrapper with ``skip_nonfinite`` (``actuators.NonfiniteSkip``): one device
                           sync and one all-reduce of a flag per optimizer step; a step with
                           non-finite gradients is not taken at all (with a controller only:
                           the data skip, with no read and no collective)
``before_optimizer_step``  group LR := scheduler LR x the actuators' LR factors, then each
                           actuator's pre-hook (gradient clipping, momentum, weight decay)
``after_optimizer_step``   group values restored, so the scheduler keeps its own (post-hook)
``proposal()``            on a report step, the leader's desired state, carried by the report
                           step's one collective (``trainer_agent/ranks.py``)
``on_end_step(step, …)``   on report steps the state agreed in that collective, on the other
                           ``sync_every`` steps a broadcast; the agreed state is applied; a pause
                           blocks here
``on_report(values, …)``   leader: a published report (with every rank's row) goes to the
                           controller; its ``trainguard_loss`` is the mean of the ranks' losses
                           (``ranks.loss`` keeps each rank's)
=========================  ====================================================================

**Agreement.** The leader (global rank 0) holds the newest desired state its client has seen.
On report steps the state travels in the report step's one collective (the
agent's all-gather of the ranks' rows, ``trainer_agent/ranks.py``): no second collective. On the
other ``sync_every`` steps all ranks take part in a broadcast of the same ``STATE_LEN`` int64 on a
side *gloo* process group of CPU tensors (no device sync). The layout is the command registry's
(``trainguard.protocol.commands``: ``generation``, then every command's fields in
``REGISTRY`` order, ``encode_state``): a float as the bits of its float64, a choice as its index,
a text (``reset_optimizer_layers``) as a 63-bit key. All ranks then apply the same state at the
same step — each command's actuator (``trainer_agent/actuators.py``) acts on it — and the leader
acks ``{generation, step}``. A generation is applied once: values are absolute, so re-applying
changes nothing; a sequence command (checkpoint, rollback, diagnostics, optimizer reset) acts once
per newer sequence number.

**Texts.** A text field travels as its key; with several ranks the leader sets the text in the
c10d store under ``text/<key>`` before it proposes the state (and before it publishes a state
during a pause), so every rank finds it there after the collective that carries the key. A rank
that cannot read it counts an agent error (``control_text``) and keeps the fields of that
command as they were, applying the rest; a state no leader can send (``decode_state``'s
``ValueError``) counts ``control_state`` and is not applied.

**Pause.** ``on_end_step`` blocks on every rank with no collective outstanding. The leader waits on
its client for a newer generation and publishes each one it applies under a fresh key of the
c10d store (``pause/<episode>/<i>``); the other ranks poll those keys (``check`` + a short sleep).
Every rank applies the same sequence of states at the same (paused) step and leaves when one has
``paused=false`` or ``stop=true``. No process-group timeout can expire meanwhile.

The pause's wait stays here rather than in its actuator: it is part of the agreement (it reads
the client and the store and applies further states while it waits), not a change to training.

**What each command does** is its actuator's docstring: ``trainer_agent/run_actuators.py`` (pause,
stop, checkpoint, lr_scale, rollback, accumulation — the training loop reads
``agent.accumulation_steps`` and the LR follows by the command's rule —, memory_trace, verify,
data_skip) and ``trainer_agent/optimizer_actuators.py`` (grad_clip, reset_optimizer, momentum,
weight_decay_scale). **Skipping non-finite steps** (``skip_nonfinite=True``):
``trainer_agent/actuators.py``.

**Fingerprints.** Under data parallelism the report's per-rank ``grad_fingerprint`` /
``param_fingerprint`` are element-wise random projections of each rank's gradients and parameters,
``grad_desync`` / ``param_desync`` each rank's largest relative difference from the others per
layer, and ``desync`` names the layers (``trainer_agent/fingerprint.py``). With one rank they are NaN.
"""

from __future__ import annotations

import itertools
import logging
import math
import socket
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from trainguard.protocol.catalog import BY_NAME
from trainguard.protocol.commands import REGISTRY, STATE_FIELDS, state_texts
from trainguard.protocol.wire import (
    MAX_DESYNC_LAYERS, Ack, DesiredState, DesyncLayer, RankEndpoint, RankValues, Report, RunFinished, RunRegistration,
)
from trainer_agent import optimizer_actuators, run_actuators  # noqa: F401 - both register their actuators on import
from trainer_agent.actuators import ACTUATORS, Actuator, ActuatorEnv, LrScale, NonfiniteSkip, check_actuators, malformed
from trainer_agent.client import ControllerClient
from trainer_agent.compat import torch_private
from trainer_agent.config import AgentConfig
from trainer_agent.exporter import sample_key
from trainer_agent.ranks import STATE_LEN, WIRE_VECTORS, decode_state, encode_state
from trainer_agent.schedule import ReportSchedule
from trainer_agent.spike_guard import SpikeGuard

__all__ = ["ControlPlane", "ControlContext", "Applied"]

log = logging.getLogger(__name__)

_instances = itertools.count()  # same sequence on every rank: ControlPlanes are built in lockstep

# Every command the agent acts on has exactly one actuator, and no actuator names an unknown command.
check_actuators()
#: Each desired-state field's index in the encoded state, and the command that owns it.
_FIELD_AT = {f.name: i + 1 for i, f in enumerate(STATE_FIELDS)}
_OWNER = {f.name: c for c in REGISTRY for f in c.fields}


@dataclass(frozen=True, slots=True)
class ControlContext:
    """What the control plane needs from the agent: identity, configuration, the optimizer it acts
    on, and two readers of the step in progress (host int; device scalar, no read)."""

    job: str
    run: str
    rank: int
    world_size: int
    local_rank: int
    config: AgentConfig
    schedule: ReportSchedule
    optimizer: torch.optim.Optimizer
    metrics_url: str | None
    step: Callable[[], int]
    """Optimizer steps completed (``end_step`` calls)."""
    grad_norm: Callable[[], torch.Tensor | None]
    """The pre-clip global gradient norm of the step in progress (0-dim float64 device tensor),
    valid in the optimizer's pre-hook; None before the first backward of the step."""
    accumulation_steps: int | None = None
    """The run's own accumulation steps when it lets the controller change them (else None)."""
    named_parameters: Callable[[], Any] = lambda: ()
    """The model's ``named_parameters`` (the optimizer reset names layers by them)."""


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
    rollback_seq: int = 0
    restored_step: int | None = None
    """The step of the snapshot a rollback of this generation restored (None: no rollback, or
    no snapshot old enough)."""
    accumulation_steps: int = 0
    """Accumulation steps in force from this step (0: the run did not opt in)."""
    desired: DesiredState | None = None
    """The state applied (every command's fields)."""


class ControlPlane:
    """Reports to the controller, agrees with the other ranks on its commands, and applies them.

    ``ctx`` says who this rank is and what to act on. The keyword arguments after it inject what
    talks to the world; their defaults are the real thing: a new gloo group, the default c10d
    store, an HTTP transport.
    """

    def __init__(
        self,
        ctx: ControlContext,
        *,
        on_checkpoint: Callable[[int], Any] | None = None,
        on_rollback: Callable[[int], int | None] | None = None,
        on_diagnose: Callable[[str, int], Any] | None = None,
        on_data_skip: Callable[[], Any] | None = None,
        group: Any = None,
        store: Any = None,
        transport: Any = None,
        long_poll_s: float = 10.0,
        pause_poll_s: float = 0.01,
        on_error: Callable[[str, BaseException], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if on_checkpoint is not None and not callable(on_checkpoint):
            raise ValueError("on_checkpoint must be callable as on_checkpoint(step)")
        if not pause_poll_s > 0:
            raise ValueError(f"pause_poll_s must be > 0, got {pause_poll_s}")
        cfg = ctx.config
        self._ctx = ctx
        self._cfg = cfg
        self._on_error = on_error or (lambda kind, exc: log.exception(kind))
        self._clock, self._wall = clock, wall_clock
        self._pause_poll_s = pause_poll_s
        self.rank, self.world_size = ctx.rank, ctx.world_size
        self.leader = self.rank == 0
        self.controlled = cfg.controller is not None
        """True with a controller: the report step's collective carries the desired state."""
        self._instance = next(_instances)

        # applied state (identical on every rank): the last applied desired state, and each
        # command's actuator (``on_diagnose`` is called with ("memory_trace" or "verify", step))
        self._applied = DesiredState()
        self._proposed_texts: dict[int, str] = {}  # the leader's texts of its newest proposal
        self._pause_episodes = 0
        #: The run's own accumulation steps (None: the run did not opt in to the command).
        self.own_accumulation: int | None = ctx.accumulation_steps
        env = ActuatorEnv(optimizer=ctx.optimizer, leader=self.leader, on_error=self._on_error,
                          named_parameters=ctx.named_parameters, own_accumulation=ctx.accumulation_steps,
                          on_checkpoint=on_checkpoint, on_rollback=on_rollback, on_diagnose=on_diagnose)
        self.actuators: dict[str, Actuator] = {c.name: ACTUATORS[c.name](env) for c in REGISTRY if c.agent}
        """Each command's actuator, by name."""
        self._order = sorted(self.actuators.values(), key=lambda a: a.phase)  # stable: registry order in a phase
        self._pre = [a for a in self._order if type(a).before_step is not Actuator.before_step]
        self._post = [a for a in self._order if type(a).after_step is not Actuator.after_step]
        self._lr_factors = [a for a in self._order if type(a).lr_factor is not Actuator.lr_factor]
        self._pause_act = self._act("pause", run_actuators.Pause)
        self._stop_act = self._act("stop", run_actuators.Stop)
        self._accumulation = self._act("accumulation", run_actuators.Accumulation)
        self._data_skip = self._act("data_skip", run_actuators.DataSkip)
        self._lr_level = self._act("lr_scale", run_actuators.LrScaleLevel)
        self.history: deque[Applied] = deque(maxlen=4096)
        """The generations applied on this rank, oldest first (bounded)."""

        self._last_reported_step = ctx.step()
        self._broken = False
        self._closed = False

        self._setup_group(group, store)
        self._client: ControllerClient | None = None
        endpoints = self._endpoints() if self.controlled else []
        if self.controlled and self.leader:
            self._client = self._start_client(endpoints, transport, long_poll_s)

        self.lr = LrScale(ctx.optimizer)
        self.skip: NonfiniteSkip | None = None
        if cfg.skips_steps or self.controlled:
            # With a controller the step is wrapped for its data skips even when the run skips
            # nothing else (then without any read or collective of its own).
            guard = SpikeGuard(cfg.spike) if cfg.spike_guard_on else None
            self.skip = NonfiniteSkip(ctx.optimizer, world_size=self.world_size, group=self._group,
                                      grad_norm=ctx.grad_norm, on_error=self._on_error, guard=guard,
                                      data_skip=self.skipping_data, check_gradients=cfg.skips_steps,
                                      on_data_skip=on_data_skip)
        if self.controlled:
            self._start()

    def _act(self, name: str, kind: type) -> Any:
        act = self.actuators[name]
        assert isinstance(act, kind), (name, act)
        return act

    # ------------------------------------------------------------------ public surface

    @property
    def should_stop(self) -> bool:
        """True on every rank from the step at which a ``stop`` was applied."""
        return self._stop

    @property
    def _stop(self) -> bool:
        return self._stop_act.stopped

    @property
    def paused(self) -> bool:
        return self._pause_act.paused

    @property
    def _paused(self) -> bool:
        return self._pause_act.paused

    @property
    def lr_scale(self) -> float:
        return self._lr_level.scale

    @property
    def exit_code(self) -> int:
        """The exit status the controller's stop asked for (``EXIT_HARDWARE_FAULT``: restart without
        the faulty node), 0 without a stop."""
        return self._stop_act.exit_code if self._stop else 0

    @property
    def data_skip_until(self) -> int:
        """The step up to which every rank skips its optimizer steps for their data (0: none)."""
        return self._data_skip.until

    def skipping_data(self) -> bool:
        """Whether the step in progress is covered by the controller's data skip (the same answer
        on every rank: the agreed state and the step count)."""
        return self._data_skip.covers(self._ctx.step() + 1)

    @property
    def applied_generation(self) -> int:
        return self._generation

    @property
    def _generation(self) -> int:
        return self._applied.generation

    @property
    def applied(self) -> DesiredState:
        """The desired state applied last (the same on every rank)."""
        return self._applied

    @property
    def client(self) -> ControllerClient | None:
        """The leader's controller client (None on other ranks and without a controller)."""
        return self._client

    @property
    def accumulation_steps(self) -> int | None:
        """Accumulation steps every rank uses now (None when the run did not opt in)."""
        return self._accumulation.steps

    @property
    def batch_lr_factor(self) -> float:
        """LR multiplier of the accumulation command's rule (1 unless the steps changed)."""
        return self._accumulation.factor

    def values(self) -> dict[str, float]:
        """The control metrics of this rank (host values; safe from the /metrics thread)."""
        out = {"trainguard_applied_generation": float(self._generation)}
        for act in self._order:
            out.update(act.values())
        if self.skip is not None:
            for reason, n in self.skip.skipped_by_reason.items():
                out[sample_key("trainguard_skipped_steps_total", reason=reason)] = float(n)
            if self.skip.guard is not None:
                out["trainguard_consecutive_skipped_steps"] = float(self.skip.guard.consecutive)
        if self._client is not None:
            out["trainguard_agent_controller_up"] = 1.0 if self._client.up else 0.0
            out["trainguard_agent_reports_dropped_total"] = float(self._client.counts.reports_dropped)
        return out

    def state_dict(self) -> dict[str, Any]:
        """What a training checkpoint must carry: the applied generation, what each actuator keeps
        (lr_scale and the other levels, the last checkpoint_seq / rollback_seq / reset served, the
        accumulation command), and the skip counters."""
        out: dict[str, Any] = {"applied_generation": self._generation}
        for act in self._order:
            out.update(act.state_dict())
        out.update({
            "skipped_steps_total": self.skip.skipped if self.skip is not None else 0,
            "skipped_by_reason": dict(self.skip.skipped_by_reason) if self.skip is not None else {},
            "spike_guard": self.skip.guard.state_dict() if self.skip is not None and self.skip.guard is not None else None,
        })
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s values. A state the controller already superseded (the
        registration of the restarted run brought a newer generation) keeps the newer levels
        (lr_scale, ...) and generation; the sequence numbers served are the larger of the two.
        ``ValueError`` for a malformed dict (nothing is changed then)."""
        try:
            generation = int(state["applied_generation"])
            skipped = int(state["skipped_steps_total"])
        except (KeyError, TypeError, ValueError) as exc:
            raise malformed(repr(exc)) from None
        if generation < 0 or skipped < 0:
            raise malformed(repr(dict(state)))
        newer = generation >= self._generation
        for act in self._order:  # all or nothing: each actuator's part is read by a fresh one first
            type(act)(act.env).load_state_dict(state, newer)
        for act in self._order:
            act.load_state_dict(state, newer)
        # what is applied now: the checkpoint's levels (when newer) and the sequence numbers served
        kept = {k: v for act in self._order for k, v in act.state_dict().items() if k in DesiredState.model_fields}
        steps, rule = self._accumulation.desired
        kept.update(accumulation_steps=steps, accumulation_lr_rule=rule)
        if newer:
            kept["generation"] = generation
        self._applied = self._applied.model_copy(update=kept)
        if self.skip is not None:
            by_reason = state.get("skipped_by_reason") or {"nonfinite": skipped}
            for reason in self.skip.skipped_by_reason:
                self.skip.skipped_by_reason[reason] = int(by_reason.get(reason, 0))
            if self.skip.guard is not None and state.get("spike_guard") is not None:
                self.skip.guard.load_state_dict(state["spike_guard"])
        self._last_reported_step = self._ctx.step()  # the agent restores its step first

    def close(self, timeout: float = 5.0) -> bool:
        """Unwrap the optimizer, flush and stop the client within ``timeout`` seconds, and
        release the side process group. True if everything finished in time.

        The leader's client also tells the controller the run finished (``POST
        /v1/runs/{run}/finish`` with the step and why: ``completed``, ``stopped`` when a stop was
        applied, ``error: <type>`` when called while an exception propagates), so the run is not
        reported silent; best effort, within the same deadline."""
        deadline = self._clock() + max(timeout, 0.0)
        self._closed = True
        if self.skip is not None:
            self.skip.unwrap()
        ok = True
        if self._client is not None:
            finish = RunFinished(step=max(self._ctx.step(), 0), reason=self._finish_reason())
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
        if self._stop and self.exit_code:
            return f"stopped (exit status {self.exit_code}: restart without the faulty node)"
        return "stopped" if self._stop else "completed"

    # ------------------------------------------------------------------ the agent's calls

    def before_optimizer_step(self) -> None:
        """Optimizer pre-hook: each group's LR becomes scheduler LR x the actuators' LR factors
        (lr_scale x the accumulation rule's) for this step, then the actuators' own pre-hooks."""
        factor = 1.0
        for act in self._lr_factors:
            factor *= act.lr_factor()
        self.lr.before_step(factor)
        for act in self._pre:
            try:
                act.before_step()
            except Exception as exc:  # noqa: BLE001 - one actuator failing must not keep the others
                self._on_error(f"actuator_{act.command}", exc)

    def after_optimizer_step(self) -> None:
        """Optimizer post-hook: the scheduler's LR objects and the groups' own values restored."""
        self.lr.after_step()
        for act in self._post:
            try:
                act.after_step()
            except Exception as exc:  # noqa: BLE001 - one actuator failing must not keep the others
                self._on_error(f"actuator_{act.command}", exc)

    def proposal(self) -> list[int] | None:
        """The desired state this rank puts in the report step's collective: the leader's newest
        (its client's, or what is applied), None on the other ranks and without a controller.
        The newest one's texts are in the store first (a failure proposes the applied state:
        nothing new this time)."""
        if not self.controlled or not self.leader:
            return None
        d = self._client.desired if self._client is not None else None
        if d is not None and d.generation > self._generation and self._publish_texts(d):
            return encode_state(d)
        return self._applied_encoded()

    def _applied_encoded(self) -> list[int]:
        return encode_state(self._applied)

    def _publish_texts(self, d: DesiredState) -> bool:
        """Leader: ``d``'s texts where every rank finds them (``text/<key>`` in the store; one rank:
        kept here). False when the store failed."""
        texts = state_texts(d)
        self._proposed_texts = texts
        if self.world_size == 1 or not texts:
            return True
        try:
            for key, text in texts.items():
                self._store.set(f"text/{key}", text)
        except Exception as exc:  # noqa: BLE001 - propose nothing new; retried at the next agreement
            self._on_error("control_text", exc)
            return False
        return True

    def on_end_step(self, step: int, agreed: list[int] | None = None) -> None:
        """Agree (all ranks) and apply; blocks only while paused. On report steps ``agreed`` is
        the state the report step's collective carried (None if it failed on this rank)."""
        if not self.controlled or self._broken or self._closed:
            return
        schedule = self._ctx.schedule
        if not schedule.agrees(step):
            return
        try:
            if schedule.is_report(step):
                if agreed is None:
                    raise RuntimeError("the report step's collective carried no desired state")
                state = agreed
            else:
                state = self._broadcast(self.proposal() if self.leader else [0] * STATE_LEN)
        except Exception as exc:  # noqa: BLE001 - fail open: the job goes on without control
            self._broken = True
            self._on_error("control_agreement", exc)
            log.error("trainguard: ranks could not agree on the controller's state (%r); control "
                      "is off for the rest of this run, training goes on", exc)
            return
        self._apply(state, step)

    def on_report(self, values: Mapping[str, float], rank_values: Mapping[str, list[float]]) -> None:
        """Leader: send a published report (every rank's row included) to the controller. With
        several ranks this runs on the report pipeline's cross-rank worker, not the training
        thread; ``rank_values`` then carries the report's own ``desync`` findings."""
        if self._client is None or self._closed:
            return
        try:
            self._send_report(values, rank_values)
        except Exception as exc:  # noqa: BLE001 - a lost report must not break the loop
            self._on_error("control_report", exc)

    def _send_report(self, values: Mapping[str, float], rank_values: Mapping[str, list[float]]) -> None:
        assert self._client is not None
        published = int(values["trainguard_step"])
        if published <= self._last_reported_step:
            return  # already sent (or a report from before a restore)
        nan = [math.nan] * self.world_size
        job_values = {k: float(v) for k, v in values.items() if k in BY_NAME and not BY_NAME[k].labels}
        losses = rank_values.get("loss")
        if self.world_size > 1 and losses is not None and len(losses) == self.world_size:
            # The job's loss is the mean of the ranks' (what the frameworks log under data
            # parallelism), not the leader's own; a rank's NaN or Inf stays in it. Per rank: ``ranks.loss``.
            job_values["trainguard_loss"] = sum(losses) / len(losses)
        report = Report(
            job=self._ctx.job,
            step_first=self._last_reported_step + 1,
            step_last=published,
            time=self._wall(),
            values=job_values,
            ranks=RankValues(**{wire: list(rank_values.get(field, nan)) for wire, field in WIRE_VECTORS.items()}),
            applied_generation=self._generation,
            desync=[DesyncLayer(kind=d.kind, layer=d.layer[:512], rel_diff=d.rel_diff, ranks=list(d.ranks[:64]))
                    for d in getattr(rank_values, "desync", ())[:MAX_DESYNC_LAYERS]],
        )
        self._last_reported_step = published
        self._client.submit_report(report)

    # ------------------------------------------------------------------ internals: start

    def _setup_group(self, group: Any, store: Any) -> None:
        """The side gloo group (broadcasts, the skip flag) and the store (pause), unless injected."""
        self._group, self._store, self._own_group = group, store, False
        if self.world_size > 1 and self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=torch_private.default_group_timeout())
            self._own_group = True
        if self.world_size > 1 and self._store is None and self.controlled:
            base = dist.group.WORLD.get_group_store()  # the store init_process_group made
            self._store = dist.PrefixStore(f"trainguard/{self._ctx.run}/{self._instance}/", base)

    def _start_client(self, endpoints: list[RankEndpoint], transport: Any, long_poll_s: float) -> ControllerClient:
        cfg, ctx = self._cfg, self._ctx
        registration = RunRegistration(
            job=ctx.job,
            run=ctx.run,
            world_size=self.world_size,
            ranks=endpoints,
            agent_version=_version(),
            config={"report_every": cfg.report_every, "sync_every": cfg.sync_every,
                    "skip_nonfinite": cfg.skip_nonfinite, "skip_spikes": cfg.spike_guard_on,
                    "snapshot_every": cfg.snapshot_every, "snapshot_keep": cfg.snapshot_keep,
                    **({"accumulation_steps": self.own_accumulation} if self.own_accumulation is not None else {})},
        )
        client = ControllerClient(
            cfg.controller,
            registration=registration,
            token=cfg.token,
            request_timeout_s=cfg.request_timeout_s,
            long_poll_s=long_poll_s,
            max_buffered_reports=cfg.max_buffered_reports,
            transport=transport,
            clock=self._clock,
            on_error=self._on_error,
        )
        client.start()
        return client

    def _endpoints(self) -> list[RankEndpoint]:
        """Every rank's /metrics endpoint, gathered on the side group (once, at start)."""
        mine: tuple[str, int, int] | None = None
        url = self._ctx.metrics_url
        if url:
            parsed = urlparse(url)
            host = parsed.hostname or "127.0.0.1"
            if host in ("0.0.0.0", "::"):
                host = socket.getfqdn()
            mine = (host, int(parsed.port or 0), self._ctx.local_rank)
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
        if self.leader:
            self._publish_texts(initial)  # a failure: the other ranks keep that command's fields
        try:
            state = self._broadcast(encode_state(initial))
        except Exception as exc:  # noqa: BLE001 - fail open
            self._broken = True
            self._on_error("control_agreement", exc)
            return
        agreed = self._decode(state)
        if agreed is None:
            return
        # Sequence requests made before this process started were meant for the process that
        # ran then (a checkpoint: served by the one the run restarts from).
        for act in self._order:
            act.start(agreed)
        self._apply_decoded(agreed, self._ctx.step())

    def _broadcast(self, leader_state: list[int] | None) -> list[int]:
        if self.world_size == 1:
            assert leader_state is not None
            return leader_state
        t = torch.tensor(leader_state if self.leader else [0] * STATE_LEN, dtype=torch.int64)
        dist.broadcast(t, src=0, group=self._group)  # gloo, CPU tensor: no device sync
        return t.tolist()

    # ------------------------------------------------------------------ internals: applying

    def _apply(self, state: list[int], step: int) -> None:
        """Apply the agreed state (encoded) at ``step``; wait here if it pauses the run."""
        if state[0] <= self._generation:
            return  # the usual case: nothing new (a generation is applied once)
        decoded = self._decode(state)
        if decoded is not None:
            self._apply_decoded(decoded, step)

    def _apply_decoded(self, state: DesiredState, step: int) -> None:
        if state.generation <= self._generation:
            return
        self._set(state, step)
        if self._paused and not self._stop:
            self._pause(step)

    def _decode(self, state: Sequence[int]) -> DesiredState | None:
        """The agreed state, its texts read from the store where this rank lacks them; None (an
        agent error, nothing applied) for a state no leader can have sent. A text that cannot be
        read leaves its command's fields as applied (an agent error; the rest applies)."""
        texts = {**state_texts(self._applied), **self._proposed_texts}
        values = list(state)
        for f in STATE_FIELDS:
            at = _FIELD_AT[f.name]
            if f.kind != "text" or len(values) != STATE_LEN or values[at] == 0 or values[at] in texts:
                continue
            try:
                texts[values[at]] = self._fetch_text(values[at])
            except Exception as exc:  # noqa: BLE001 - keep this command as it was; never hang here
                self._on_error("control_text", exc)
                for kept in _OWNER[f.name].fields:
                    values[_FIELD_AT[kept.name]] = kept.encode(getattr(self._applied, kept.name))
                texts.update(state_texts(self._applied))
        try:
            return decode_state(values, texts)
        except ValueError as exc:
            self._on_error("control_state", exc)
            return None

    def _fetch_text(self, key: int) -> str:
        """A text the leader set before the collective that carried its key (so it is there now:
        never a blocking wait)."""
        name = f"text/{key}"
        if self._store is None or not self._store.check([name]):
            raise LookupError(f"the text of key {key} is not in the store")
        return self._store.get(name).decode()

    def _set(self, state: DesiredState, step: int) -> None:
        """Apply a newer ``state``: each command's actuator acts on it (not the pause wait)."""
        old, self._applied = self._applied, state
        for act in self._order:
            try:
                act.apply(state, old, step)
            except Exception as exc:  # noqa: BLE001 - one command failing must not keep the others
                self._on_error(f"actuator_{act.command}", exc)
        restored = self._act("rollback", run_actuators.Rollback).restored
        self.history.append(
            Applied(state.generation, step, state.paused, state.lr_scale, state.checkpoint_seq, state.stop, self._wall(),
                    rollback_seq=state.rollback_seq, restored_step=restored,
                    accumulation_steps=self._accumulation.steps or 0, desired=state)
        )
        if self._client is not None:
            self._client.submit_ack(Ack(generation=state.generation, step=step))
        if state.reason and self.leader:
            log.info("trainguard: applied generation %d at step %d: %s", state.generation, step, state.reason)

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
                    if not self._publish_texts(new):
                        time.sleep(self._pause_poll_s)
                        continue  # the client offers it again; published once its texts are
                    self._store.set(f"pause/{episode}/{i}", ",".join(map(str, encode_state(new))))
            else:
                published = self._next_published_state(episode, i)
                if published is None:
                    return
                new = self._decode(published) if published[0] > self._generation else None
            i += 1
            if new is not None:
                self._set(new, step)
        # The wait ends on a resume, a stop sent while paused, or the agent closing: say which.
        if self._stop:
            log.warning("trainguard: rank %d stopped while paused at step %d (generation %d)", self.rank, step, self._generation)
        elif self._closed:
            log.warning("trainguard: rank %d stopped waiting at step %d: the agent closed while paused", self.rank, step)
        else:
            log.warning("trainguard: rank %d resumed at step %d (generation %d)", self.rank, step, self._generation)

    def _next_leader_state(self) -> DesiredState | None:
        """The controller's next generation, or None after a short wait without one."""
        d = self._client.wait_desired(self._generation, timeout=0.25) if self._client is not None else None
        if d is None or d.generation <= self._generation:
            time.sleep(self._pause_poll_s)  # never spin (e.g. the client is closing)
            return None
        return d

    def _next_published_state(self, episode: int, i: int) -> list[int] | None:
        """The ``i``-th state the leader published in this pause (encoded); None once closed."""
        key = f"pause/{episode}/{i}"
        while not self._closed:
            if self._store.check([key]):
                return [int(x) for x in self._store.get(key).decode().split(",")]
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

def _version() -> str:
    from trainer_agent import __version__

    return __version__
