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
                           step's one collective (``trainer_agent/report/exchange.py``)
``on_end_step(step, …)``   on report steps the state agreed in that collective, on the other
                           ``sync_every`` steps a broadcast; the agreed state is applied; a pause
                           blocks here
``on_report(values, …)``   leader: a published report (with every rank's row) goes to the
                           controller; its ``trainguard_loss`` is the mean of the ranks' losses
                           (``ranks.loss`` keeps each rank's)
=========================  ====================================================================

**Agreement.** The leader (global rank 0) holds the newest desired state its client has seen.
On report steps the state travels in the report step's one collective (the
agent's all-gather of the ranks' rows, ``trainer_agent/report/exchange.py``): no second collective. On the
other ``sync_every`` steps all ranks take part in a broadcast of the same ``STATE_LEN`` int64 on a
side *gloo* process group of CPU tensors (no device sync). The layout is the command registry's
(``trainguard.protocol.commands``: ``generation``, then every command's fields in
``REGISTRY`` order, ``encode_state``): a float as the bits of its float64, a choice as its index,
a text (``reset_optimizer_layers``) as a 63-bit key. All ranks then apply the same state at the
same step — each command's actuator (``trainer_agent/control/actuators.py``) acts on it — and the leader
acks ``{generation, step}``. A generation is applied once: values are absolute, so re-applying
changes nothing; a sequence command (checkpoint, rollback, diagnostics, optimizer reset) acts once
per newer sequence number.

**Texts and pause.** A text field travels as its key, set by the leader in the c10d store before
the collective that carries it; during a pause every rank blocks with no collective outstanding:
the leader waits on its client and publishes each state it applies in the store, the others poll
it, and every rank applies the same sequence of states at the same (paused) step and leaves when
one has ``paused=false`` or ``stop=true`` (``trainer_agent/control/channel.py``). A rank that cannot
read a text counts an agent error (``control_text``) and keeps the fields of that command as they
were, applying the rest; a state no leader can send (``decode_state``'s ``ValueError``) counts
``control_state`` and is not applied. No process-group timeout can expire during a pause. The
pause's wait stays here rather than in its actuator: it is part of the agreement, not a change to
training.

The leader's registration and reports are ``trainer_agent/control/run_reporter.py``; every command's
actuator, and the optimizer's hooks over all of them, ``trainer_agent/control/actuator_set.py``.

**What each command does** is its actuator's docstring: ``trainer_agent/control/run_actuators.py`` (pause,
stop, checkpoint, lr_scale, rollback, accumulation — the training loop reads
``agent.accumulation_steps`` and the LR follows by the command's rule —, memory_trace, verify,
data_skip) and ``trainer_agent/control/optimizer_actuators.py`` (grad_clip, reset_optimizer, momentum,
weight_decay_scale). **Skipping non-finite steps** (``skip_nonfinite=True``):
``trainer_agent/control/actuators.py``.
"""

from __future__ import annotations

import itertools
import logging
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from trainguard.protocol.wire import DesiredState, RunFinished
from trainer_agent.control.actuator_set import ActuatorSet
from trainer_agent.control.actuators import Actuator, ActuatorEnv, NonfiniteSkip, malformed
from trainer_agent.control.group_override import LrScale
from trainer_agent.control.agreement import StateAgreement
from trainer_agent.report.client import ControllerClient
from trainer_agent.config import AgentConfig
from trainer_agent.control.channel import StateChannel
from trainer_agent.control.context import Applied, ControlContext
from trainer_agent.report.exporter import sample_key
from trainer_agent.control.run_reporter import RunReporter, rank_endpoints
from trainer_agent.control.spike_guard import SpikeGuard

__all__ = ["ControlPlane", "ControlContext", "Applied"]

log = logging.getLogger(__name__)

_instances = itertools.count()  # same sequence on every rank: ControlPlanes are built in lockstep


class ControlPlane(StateAgreement):
    """Reports to the controller, agrees with the other ranks on its commands, and applies them
    (the agreement and the application: ``trainer_agent/control/agreement.py``).

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
        _check_arguments(on_checkpoint, pause_poll_s)
        cfg = ctx.config
        self._ctx = ctx
        self._on_error = on_error or (lambda kind, exc: log.exception(kind))
        self._clock, self._wall = clock, wall_clock
        self.rank, self.world_size = ctx.rank, ctx.world_size
        self.leader = self.rank == 0
        self.controlled = cfg.controller is not None
        """True with a controller: the report step's collective carries the desired state."""

        # applied state (identical on every rank): the last applied desired state, and each
        # command's actuator (``on_diagnose`` is called with ("memory_trace" or "verify", step))
        self._applied = DesiredState()
        self._pause_episodes = 0
        #: The run's own accumulation steps (None: the run did not opt in to the command).
        self.own_accumulation: int | None = ctx.accumulation_steps
        env = ActuatorEnv(optimizer=ctx.optimizer, leader=self.leader, on_error=self._on_error,
                          named_parameters=ctx.named_parameters, own_accumulation=ctx.accumulation_steps,
                          on_checkpoint=on_checkpoint, on_rollback=on_rollback, on_diagnose=on_diagnose)
        self.acts = ActuatorSet(env, ctx.optimizer, lambda: self._on_error)
        self.history: deque[Applied] = deque(maxlen=4096)
        """The generations applied on this rank, oldest first (bounded)."""
        self._broken = False
        self._closed = False

        self._channel = StateChannel(world_size=self.world_size, leader=self.leader, controlled=self.controlled,
                                     group=group, store=store, prefix=f"trainguard/{ctx.run}/{next(_instances)}/",
                                     pause_poll_s=pause_poll_s, on_error=self._error, closed=lambda: self._closed)
        self._reporter = self._start_reporter(transport, long_poll_s) if self.controlled else None
        self.skip = self._step_skip(cfg, on_data_skip)
        if self.controlled:
            self._start()

    def _error(self, kind: str, exc: BaseException) -> None:
        self._on_error(kind, exc)  # looked up at each call: a test may replace it

    def _start_reporter(self, transport: Any, long_poll_s: float) -> RunReporter | None:
        """The leader's reporter (every rank gathers the /metrics endpoints first); None elsewhere."""
        ctx = self._ctx
        endpoints = rank_endpoints(ctx.metrics_url, ctx.local_rank, self.world_size, self._channel.group)
        if not self.leader:
            return None
        return RunReporter(ctx.config, job=ctx.job, run=ctx.run, world_size=self.world_size, endpoints=endpoints,
                           own_accumulation=self.own_accumulation, transport=transport, long_poll_s=long_poll_s,
                           clock=self._clock, wall_clock=self._wall, on_error=self._on_error, version=_version(),
                           last_step=ctx.step())

    def _step_skip(self, cfg: AgentConfig, on_data_skip: Callable[[], Any] | None) -> NonfiniteSkip | None:
        """The optimizer step's wrapper: with ``skip_nonfinite`` or the spike guard, and with a
        controller for its data skips even when the run skips nothing else (then without any read
        or collective of its own)."""
        if not (cfg.skips_steps or self.controlled):
            return None
        guard = (SpikeGuard(cfg.spike, regime=self._ctx.regime, lr_jumped=self._ctx.lr_jumped)
                 if cfg.spike_guard_on else None)
        return NonfiniteSkip(self._ctx.optimizer, world_size=self.world_size, group=self._channel.group,
                             grad_norm=self._ctx.grad_norm, on_error=self._on_error, guard=guard,
                             data_skip=self.skipping_data, check_gradients=cfg.skips_steps,
                             on_data_skip=on_data_skip)

    # ------------------------------------------------------------------ public surface

    @property
    def actuators(self) -> dict[str, Actuator]:
        """Each command's actuator, by name."""
        return self.acts.by_name

    @property
    def lr(self) -> LrScale:
        """The optimizer's LR override (scheduler LR x the actuators' factors during a step)."""
        return self.acts.lr

    @property
    def should_stop(self) -> bool:
        """True on every rank from the step at which a ``stop`` was applied."""
        return self.acts.stop.stopped

    @property
    def paused(self) -> bool:
        return self.acts.pause.paused

    @property
    def lr_scale(self) -> float:
        return self.acts.lr_level.scale

    @property
    def exit_code(self) -> int:
        """The exit status the controller's stop asked for (``EXIT_HARDWARE_FAULT``: restart without
        the faulty node), 0 without a stop."""
        return self.acts.stop.exit_code if self.should_stop else 0

    @property
    def data_skip_until(self) -> int:
        """The step up to which every rank skips its optimizer steps for their data (0: none)."""
        return self.acts.data_skip.until

    def skipping_data(self) -> bool:
        """Whether the step in progress is covered by the controller's data skip (the same answer
        on every rank: the agreed state and the step count)."""
        return self.acts.data_skip.covers(self._ctx.step() + 1)

    @property
    def applied_generation(self) -> int:
        return self._applied.generation

    @property
    def applied(self) -> DesiredState:
        """The desired state applied last (the same on every rank)."""
        return self._applied

    @property
    def client(self) -> ControllerClient | None:
        """The leader's controller client (None on other ranks and without a controller)."""
        return self._reporter.client if self._reporter is not None else None

    @property
    def accumulation_steps(self) -> int | None:
        """Accumulation steps every rank uses now (None when the run did not opt in)."""
        return self.acts.accumulation.steps

    @property
    def batch_lr_factor(self) -> float:
        """LR multiplier of the accumulation command's rule (1 unless the steps changed)."""
        return self.acts.accumulation.factor

    def values(self) -> dict[str, float]:
        """The control metrics of this rank (host values; safe from the /metrics thread)."""
        out = {"trainguard_applied_generation": float(self.applied_generation), **self.acts.values()}
        if self.skip is not None:
            for reason, n in self.skip.skipped_by_reason.items():
                out[sample_key("trainguard_skipped_steps_total", reason=reason)] = float(n)
            if self.skip.guard is not None:
                out["trainguard_consecutive_skipped_steps"] = float(self.skip.guard.consecutive)
        client = self.client
        if client is not None:
            out["trainguard_agent_controller_up"] = 1.0 if client.up else 0.0
            out["trainguard_agent_reports_dropped_total"] = float(client.counts.reports_dropped)
        return out

    def state_dict(self) -> dict[str, Any]:
        """What a training checkpoint must carry: the applied generation, what each actuator keeps
        (lr_scale and the other levels, the last checkpoint_seq / rollback_seq / reset served, the
        accumulation command), and the skip counters."""
        skip = self.skip
        return {
            "applied_generation": self.applied_generation,
            **self.acts.state_dict(),
            "skipped_steps_total": skip.skipped if skip is not None else 0,
            "skipped_by_reason": dict(skip.skipped_by_reason) if skip is not None else {},
            "spike_guard": skip.guard.state_dict() if skip is not None and skip.guard is not None else None,
        }

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
        newer = generation >= self.applied_generation
        # what is applied now: the checkpoint's levels (when newer) and the sequence numbers served
        kept = self.acts.load_state_dict(state, newer)
        if newer:
            kept["generation"] = generation
        self._applied = self._applied.model_copy(update=kept)
        if self.skip is not None:
            by_reason = state.get("skipped_by_reason") or {"nonfinite": skipped}
            for reason in self.skip.skipped_by_reason:
                self.skip.skipped_by_reason[reason] = int(by_reason.get(reason, 0))
            if self.skip.guard is not None and state.get("spike_guard") is not None:
                self.skip.guard.load_state_dict(state["spike_guard"])
        if self._reporter is not None:
            self._reporter.last_step = self._ctx.step()  # the agent restores its step first

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
        client = self.client
        if client is not None:
            finish = RunFinished(step=max(self._ctx.step(), 0), reason=self._finish_reason())
            ok = client.close(max(deadline - self._clock(), 0.0), finish=finish)
        self._channel.close()
        return ok

    def _finish_reason(self) -> str:
        exc = sys.exc_info()[1]  # set when close() runs in an except/finally block of a failing loop
        if exc is not None:
            return f"error: {type(exc).__name__}"[:200]
        if self.should_stop and self.exit_code:
            return f"stopped (exit status {self.exit_code}: restart without the faulty node)"
        return "stopped" if self.should_stop else "completed"

    # ------------------------------------------------------------------ the agent's calls
    # (``proposal`` and ``on_end_step``: ``StateAgreement``, trainer_agent/control/agreement.py)

    def before_optimizer_step(self) -> None:
        """Optimizer pre-hook: each group's LR becomes scheduler LR x the actuators' LR factors
        (lr_scale x the accumulation rule's) for this step, then the actuators' own pre-hooks."""
        self.acts.before_optimizer_step()

    def after_optimizer_step(self) -> None:
        """Optimizer post-hook: the scheduler's LR objects and the groups' own values restored."""
        self.acts.after_optimizer_step()

    def on_report(self, values: Mapping[str, float], rank_values: Mapping[str, list[float]]) -> None:
        """Leader: send a published report (every rank's row included) to the controller. With
        several ranks this runs on the report pipeline's cross-rank worker, not the training
        thread; ``rank_values`` then carries the report's own ``desync`` findings."""
        if self._reporter is None or self._closed:
            return
        try:
            self._send_report(values, rank_values)
        except Exception as exc:  # noqa: BLE001 - a lost report must not break the loop
            self._on_error("control_report", exc)

    def _send_report(self, values: Mapping[str, float], rank_values: Mapping[str, list[float]]) -> None:
        assert self._reporter is not None
        self._reporter.send(values, rank_values, self.applied_generation)


def _check_arguments(on_checkpoint: Any, pause_poll_s: float) -> None:
    if on_checkpoint is not None and not callable(on_checkpoint):
        raise ValueError("on_checkpoint must be callable as on_checkpoint(step)")
    if not pause_poll_s > 0:
        raise ValueError(f"pause_poll_s must be > 0, got {pause_poll_s}")


def _version() -> str:
    from trainer_agent.version import __version__

    return __version__
