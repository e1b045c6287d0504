"""The ranks' agreement on the controller's desired state and its application (the mechanism is
``trainer_agent/control/plane.py``'s docstring, **Agreement** and **Texts and pause**): the state the
leader proposes in the report step's collective, the broadcast on the other ``sync_every`` steps,
the registration's state applied before the first step, each newer generation applied at the same
step on every rank, and the pause's wait."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from trainguard.protocol.commands import STATE_INDEX
from trainguard.protocol.wire import Ack, DesiredState
from trainer_agent.control.context import Applied
from trainer_agent.report.exchange import STATE_LEN, encode_state

__all__ = ["StateAgreement"]

#: The agreement logs under the control plane's name (``trainer_agent/control/plane.py``).
log = logging.getLogger("trainer_agent.control.plane")


class StateAgreement:
    """``ControlPlane``'s agreement and application of the desired state, on what the plane holds:
    ``_ctx`` (its ``ControlContext``), ``_channel`` (the ``StateChannel``), ``_applied`` and
    ``history`` (the state applied last, and every generation applied), ``acts`` (the
    ``ActuatorSet``), ``client``, ``rank``, ``leader``, ``controlled``, ``_broken``, ``_closed``,
    ``_pause_episodes``, ``_on_error`` and ``_wall`` (wall-clock time); and its readers of the
    applied state, ``applied_generation``, ``paused`` and ``should_stop``.

    A job that started before its registration succeeded (the controller unreachable at attach)
    judges the first newer state every rank agrees on as the start judges the registration's
    (``_judge_late``)."""

    _unjudged = False
    """The start had no registration: the first newer agreed state is judged as a start's."""

    def proposal(self) -> list[int] | None:
        """The desired state this rank puts in the report step's collective: the leader's newest
        (its client's, or what is applied), None on the other ranks and without a controller.
        The newest one's texts are in the store first (a failure proposes the applied state:
        nothing new this time)."""
        if not self.controlled or not self.leader:
            return None
        client = self.client
        d = client.desired if client is not None else None
        if d is not None and d.generation > self.applied_generation and self._channel.publish_texts(d):
            return encode_state(d)
        return encode_state(self._applied)

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
                state = self._channel.broadcast(self.proposal() if self.leader else [0] * STATE_LEN)
            if self._unjudged and state[0] > self.applied_generation:
                self._judge_late(state)
        except Exception as exc:  # noqa: BLE001 - fail open: the job goes on without control
            self._broken = True
            self._on_error("control_agreement", exc)
            log.error("trainguard: ranks could not agree on the controller's state (%r); control "
                      "is off for the rest of this run, training goes on", exc)
            return
        self._apply(state, step)
        if not self.should_stop:
            self.acts.serve_due(self._applied, step)

    def _start(self) -> None:
        """Agree on the registration's desired state and apply it before the first step, with the
        sequence numbers of the state the run's processes last applied (the registration's
        ``applied``): a checkpoint no process took is due at the first step (``Sequenced``)."""
        registered, before = None, None
        client = self.client
        if client is not None:
            registered = client.wait_registered(self._ctx.config.request_timeout_s)
            before = client.applied_before if registered is not None and registered.generation else None
        initial = registered or DesiredState()
        if self.leader:
            self._channel.publish_texts(initial)  # a failure: the other ranks keep that command's fields
        fields = self.acts.seq_fields
        known = [1, *(getattr(before, f) for f in fields)] if before is not None else [0] * (len(fields) + 1)
        try:
            state = self._channel.broadcast(encode_state(initial) + [int(registered is not None), *known],
                                            STATE_LEN + 1 + len(known))
        except Exception as exc:  # noqa: BLE001 - fail open
            self._broken = True
            self._on_error("control_agreement", exc)
            return
        self._unjudged = not state[STATE_LEN]
        agreed = self._decode(state[:STATE_LEN])
        if agreed is None:
            return
        self.acts.start(agreed, dict(zip(fields, state[STATE_LEN + 2:])) if state[STATE_LEN + 1] else None)
        self._apply_decoded(agreed, self._ctx.step())

    def _judge_late(self, state: list[int]) -> None:
        """The first newer ``state`` (encoded) agreed after a start without a registration: every
        rank judges the requests it holds as a start does (``ActuatorSet.judge``), with the
        sequence numbers of the registration's state and of the state the run's processes last
        applied that the leader's client got at its late registration (one broadcast, once). A
        request newer than the registration's was made for this process and is acted on."""
        self._unjudged = False
        fields = self.acts.seq_fields
        known = [0] * (2 * len(fields) + 1)
        client = self.client
        if client is not None:
            registered, before = client.registration
            requested = [state[STATE_INDEX[f]] for f in fields]
            if registered is not None:
                requested = [min(seq, getattr(registered, f)) for seq, f in zip(requested, fields)]
            known = [int(before is not None), *requested, *(getattr(before, f) if before else 0 for f in fields)]
        known = self._channel.broadcast(known, len(known))
        n = len(fields)
        self.acts.judge(dict(zip(fields, known[1:n + 1])), dict(zip(fields, known[n + 1:])) if known[0] else None)

    def _apply(self, state: list[int], step: int) -> None:
        """Apply the agreed state (encoded) at ``step``; wait here if it pauses the run."""
        if state[0] <= self.applied_generation:
            return  # the usual case: nothing new (a generation is applied once)
        decoded = self._decode(state)
        if decoded is not None:
            self._apply_decoded(decoded, step)

    def _apply_decoded(self, state: DesiredState, step: int) -> None:
        if state.generation <= self.applied_generation:
            return
        self._set(state, step)
        if self.paused and not self.should_stop:
            self._pause(step)

    def _decode(self, state: Sequence[int]) -> DesiredState | None:
        """The agreed state with its texts (:meth:`StateChannel.decode`); None: nothing to apply."""
        return self._channel.decode(state, self._applied)

    def _set(self, state: DesiredState, step: int) -> None:
        """Apply a newer ``state``: each command's actuator acts on it (not the pause wait)."""
        old, self._applied = self._applied, state
        self.acts.apply(state, old, step)
        self.history.append(
            Applied(state.generation, step, state.paused, state.lr_scale, state.checkpoint_seq, state.stop, self._wall(),
                    rollback_seq=state.rollback_seq, restored_step=self.acts.rollback.restored,
                    accumulation_steps=self.acts.accumulation.steps or 0, desired=state)
        )
        client = self.client
        if client is not None:
            client.submit_ack(Ack(generation=state.generation, step=step))
        if state.reason and self.leader:
            log.info("trainguard: applied generation %d at step %d: %s", state.generation, step, state.reason)

    def _pause(self, step: int) -> None:
        """Block until a generation with paused=false (or stop) is applied. No collective is
        outstanding: the leader waits on its client, the others poll the c10d store."""
        episode = self._pause_episodes
        self._pause_episodes += 1
        if self.leader and episode > 0:
            self._channel.forget_episode(episode - 1)
        log.warning("trainguard: rank %d paused at step %d (generation %d)", self.rank, step, self.applied_generation)
        i = 0
        while self.paused and not self.should_stop and not self._closed:
            if self.leader:
                new = self._next_leader_state()
                if new is None or not self._channel.publish_paused(episode, i, new):
                    continue  # none yet; or its texts failed: the client offers it again
            else:
                published = self._channel.next_published(episode, i)
                if published is None:
                    return
                new = self._decode(published) if published[0] > self.applied_generation else None
            i += 1
            if new is not None:
                self._set(new, step)
        # The wait ends on a resume, a stop sent while paused, or the agent closing: say which.
        if self.should_stop:
            log.warning("trainguard: rank %d stopped while paused at step %d (generation %d)", self.rank, step,
                        self.applied_generation)
        elif self._closed:
            log.warning("trainguard: rank %d stopped waiting at step %d: the agent closed while paused", self.rank, step)
        else:
            log.warning("trainguard: rank %d resumed at step %d (generation %d)", self.rank, step, self.applied_generation)

    def _next_leader_state(self) -> DesiredState | None:
        """The controller's next generation, or None after a short wait without one."""
        client = self.client
        d = client.wait_desired(self.applied_generation, timeout=0.25) if client is not None else None
        if d is None or d.generation <= self.applied_generation:
            self._channel.idle()  # never spin (e.g. the client is closing)
            return None
        return d

