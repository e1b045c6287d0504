"""Commands from operators and Alertmanager: a command of the registry
(``trainguard.protocol.commands``) folded into a run's desired state, written and published, once
per ``Idempotency-Key``; an Alertmanager webhook's acting alerts, each once."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from typing import Any, Callable

from trainguard.service import statements as sql
from trainguard.service.alertmanager import SeenKeys, act
from trainguard.service.committer import Commit
from trainguard.service.config import Settings
from trainguard.service.engine import command_state
from trainguard.service.errors import Conflict, Invalid
from trainguard.service.outcomes import OutcomeRecorder
from trainguard.service.runstate import RunState, live, target_address
from trainguard.service.store import Store
from trainguard.service.transaction import Transaction, Written, record_resolved
from trainguard.protocol.commands import BY_NAME, CommandRefused
from trainguard.protocol.wire import DesiredState

__all__ = ["KEYS_KEPT_S", "OperatorCommands", "applies_when"]

#: Idempotency keys and Alertmanager fingerprints are remembered this long (after their last sight).
KEYS_KEPT_S = 7 * 86400


def applies_when(st: RunState, command: str, on_restart: bool) -> str:
    """When a command to ``st`` applies: ``now``; for a finished run (its ranks are gone),
    ``when_registered_again`` if ``on_restart``, else a Conflict that says so."""
    if st.finish.at is None:
        return "now"
    if on_restart:
        return "when_registered_again"
    when = "" if st.finish.step is None else f" at step {st.finish.step}"
    why = f" ({st.finish.reason})" if st.finish.reason else ""
    raise Conflict(f"run {st.run!r} finished{when}{why}; its ranks are gone, so {command} would apply only when a job "
                   f"registers the name {st.run!r} again, however much later. To have a job restarted under this name "
                   "start with it, send it with on_restart=true (the CLI's --on-restart)")


class OperatorCommands:
    """Carries out commands on the runs in ``runs`` (shared with the controller; ``get``: one of
    them or NotFound)."""

    def __init__(self, settings: Settings, store: Store, clock: Callable[[], float], runs: dict[str, RunState],
                 get: Callable[[str], RunState], commit: Commit, outcomes: OutcomeRecorder) -> None:
        self.settings = settings
        self.store = store
        self.clock = clock
        self.runs = runs
        self.get = get
        self.commit = commit
        self.outcomes = outcomes
        self.seen = SeenKeys()
        """The Alertmanager alerts acted on (fingerprint + startsAt), newest kept in memory."""
        self._idem_locks: dict[tuple[str, str], list[Any]] = {}  # key -> [lock, users]

    async def command(
        self, run: str, command: str, *, params: Any = None, reason: str, actor: str, source: str = "operator",
        idempotency: tuple[str, str, str] | None = None, extra: Callable[[sqlite3.Connection], Any] | None = None,
        on_restart: bool = False,
    ) -> tuple[int, bytes]:
        """Apply a command of the registry (``trainguard.protocol.commands.BY_NAME``) from an
        operator or Alertmanager. ``params``: its body, an instance of the command's ``request``
        (None: the body's defaults; a dict is validated into it; one that does not validate is
        Invalid, 422). A command the run did not opt in to (``requires_config``) or that cannot be
        carried out now (``CommandRefused``: a rollback without a good snapshot) is a Conflict
        (409). ``idempotency`` is (principal, key, request hash): a repeat answers the stored
        response, another body under the key is a Conflict. A command to a finished run is a Conflict
        unless ``on_restart`` (it applies when a job registers the run's name again: the answer's
        ``applies``). Returns (HTTP status, JSON body)."""
        args = (run, command, params, reason, actor, source, on_restart)
        if idempotency is None:
            return await self._command(*args, None, extra)
        principal, key, req_hash = idempotency
        entry = self._idem_locks.setdefault((principal, key), [asyncio.Lock(), 0])
        entry[1] += 1
        try:
            async with entry[0]:
                row = await self.store.read(lambda c: sql.get_idempotent(c, principal, key))
                if row is not None:
                    if row["request_hash"] != req_hash:
                        raise Conflict(f"Idempotency-Key {key!r} was used with another request")
                    return row["status"], bytes(row["body"])
                return await self._command(*args, idempotency, extra)
        finally:
            entry[1] -= 1
            if entry[1] == 0:
                del self._idem_locks[(principal, key)]

    async def _command(self, run: str, command: str, params: Any, reason: str, actor: str, source: str, on_restart: bool,
                       idempotency: tuple[str, str, str] | None,
                       extra: Callable[[sqlite3.Connection], Any] | None) -> tuple[int, bytes]:
        st = self.get(run)
        now, applies = self.clock(), applies_when(st, command, on_restart)
        new = self._new_desired(st, command, params, reason or f"{command} by {actor}")
        before = st.desired
        resolve_absence = st.firing_absence() if command == "stop" else []
        body = json.dumps({"run": run, "command": command, "changed": new is not None,
                           "desired": (new or before).model_dump(), "applies": applies}).encode()
        tx = Transaction()
        operator_scale = source == "operator" and new is not None and new.lr_scale != before.lr_scale
        if new is not None:
            tx.assign(st, desired=new)
        if operator_scale:
            # A person set the scale: recovery's ramp climbs back to it, never above it.
            tx.assign(st.recovery, ceiling=new.lr_scale)
        unpaused = new is not None and live(new) and not live(before)
        if unpaused:
            tx.assign(st, live_since=now)  # the run reports again from now on: absence counts from here
        run_id, external = st.id, self.settings.external_url

        def op(c: sqlite3.Connection) -> Written:
            if extra is not None:
                extra(c)
            out = Written()
            if new is not None:
                sql.update_desired(c, run_id, new)
                out.events.append(sql.insert_event(c, run_id, now=now, kind="desired", actor=actor, reason=new.reason,
                                                   generation=new.generation, data={"desired": new.model_dump(), "command": command}))
            if unpaused:
                sql.update_resumed(c, run_id, now)
            hooks = sql.active_webhooks(c) if resolve_absence else []
            for name in resolve_absence:
                record_resolved(c, run_id, name, now, actor=actor, reason="run stopped", hooks=hooks, external_url=external, out=out)
            if idempotency is not None:
                sql.put_idempotent(c, *idempotency, 200, body, now)
            return out

        def after(_: Written) -> None:
            st.forget_alerts(resolve_absence)
            if operator_scale:
                st.recovery.ramp.reset()
            if new is not None:
                self.outcomes.count_actions(before, new, source)
                st.publish(new)

        await self.commit(tx, op, after=after)
        return 200, body

    @staticmethod
    def _new_desired(st: RunState, command: str, params: Any, reason: str) -> DesiredState | None:
        """``st``'s desired state after ``command`` (None: unchanged). 409 for a command the run did
        not opt in to or that cannot be carried out now, 422 for an unknown one or a bad body."""
        spec = BY_NAME.get(command)
        if spec is not None and spec.requires_config is not None:
            key, why = spec.requires_config
            if not isinstance(st.config.get(key), int):
                raise Conflict(f"run {st.run!r} does not let the controller set its {key.replace('_', ' ')} ({why})")
        try:
            return command_state(st.desired, command, reason, params=params, ctx=st.recovery)
        except CommandRefused as e:
            raise Conflict(str(e)) from None
        except ValueError as e:
            raise Invalid(str(e)) from None

    async def alertmanager(self, payload: dict[str, Any], actor: str) -> list[dict[str, Any]]:
        """Act on the firing alerts of an Alertmanager webhook (version 4) payload, each
        (fingerprint + startsAt) once: see :func:`service.alertmanager.act`."""
        return await act(payload, self.seen, self.command, self.clock, self._targets, refresh=self._seen_again)

    async def _seen_again(self, key: tuple[str, str], now: float) -> None:
        await self.store.submit(lambda c: sql.refresh_alertmanager_seen(c, *key, now), single_statement=True)

    def _targets(self, run: str) -> set[str] | None:
        """The ``host:port`` Prometheus scrapes for each rank of ``run`` (as /v1/sd/targets names them)."""
        st = self.runs.get(run)
        return None if st is None else {target_address(r["host"], r["port"]) for r in st.ranks}
