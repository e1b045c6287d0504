"""The controller's facade: what the routes, the CLI and the tests call, each responsibility a
service of its own behind it —

- :mod:`service.run_owners`: which agent token may act for which run (``check_agent``);
- :mod:`service.registration`: registering runs;
- :mod:`service.ingest`: reports, evaluated by :mod:`service.evaluation_step` (the step
  ``engine.simulate`` replays too) and recorded by :mod:`service.outcomes`;
- :mod:`service.agent_calls`: the desired state's long-poll, acks, pre-flight, memory trace, finish;
- :mod:`service.operator_commands`: commands and their idempotency, Alertmanager's webhook;
- :mod:`service.token_service`: tokens created at runtime;
- :mod:`service.rules_store`: the active rules, their storage and reload;
- :mod:`service.absence_ticker`: the absence rules over time, pruning;
- :mod:`service.committer`: the transaction path all of them write through.

All state changes happen on the event loop thread, synchronously between awaits, so they are
ordered. Each change is one transaction (:mod:`service.transaction`): the in-memory state changes
first, one store operation writes it with everything it implies, and only after the commit is it
published — to long-polls, to the SSE stream, to the webhook worker; a failed commit takes the
in-memory change back. ``RunState.desired`` is the newest state (possibly still being written);
``RunState.publication`` the newest committed one, which is what agents see.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from typing import Any, Callable

from trainguard.service import deletion_statements as deletion
from trainguard.service import statements as sql
from trainguard.service.absence_ticker import AbsenceTicker
from trainguard.service.agent_calls import AgentCalls
from trainguard.service.alertmanager import SeenKeys
from trainguard.service.auth import Principal, TokenTable
from trainguard.service.committer import Committer
from trainguard.service.config import Settings
from trainguard.service.errors import NotFound
from trainguard.service.events import EventHub
from trainguard.service.data_quarantine import record_quarantine
from trainguard.service.incidents import continue_ids_after
from trainguard.service.ingest import ReportIngest
from trainguard.service.metrics import ControllerMetrics
from trainguard.service.operator_commands import KEYS_KEPT_S, OperatorCommands
from trainguard.service.outcomes import OutcomeRecorder, firing_entry
from trainguard.service.records import Records
from trainguard.service.registration import Registration
from trainguard.service.rules import RuleSet
from trainguard.service.rules_store import RulesStore
from trainguard.service.run_owners import RunOwners
from trainguard.service.run_removal import RunRemoval
from trainguard.service.runstate import RunState
from trainguard.service.startup import load_run
from trainguard.service.store import Store
from trainguard.service.token_service import RuntimeTokens
from trainguard.service.webhooks import SEVERITY_RANK, WebhookDeliverer
from trainguard.protocol.wire import Ack, MemoryReport, PreflightResult, QuarantineReport, Report, RunFinished, RunRegistered, RunRegistration

__all__ = ["Controller"]


class Controller:
    """Everything the routes call. Built by :func:`service.app.create_app`."""

    def __init__(
        self, settings: Settings, store: Store, metrics: ControllerMetrics, *, clock: Callable[[], float] = time.time,
        deliverer: WebhookDeliverer,
    ) -> None:
        self.settings = settings
        self.store = store
        self.metrics = metrics
        self.clock = clock
        self.deliverer = deliverer
        self.runs: dict[str, RunState] = {}
        self.records = Records(store, clock)
        """Alerts, the audit log and webhooks as stored (what the routes read and write)."""
        self.events_hub = EventHub()
        """The audit events published after each commit (the SSE stream subscribes to it)."""
        self._tasks: list[asyncio.Task[Any]] = []
        self.committer = Committer(store, deliverer, self.events_hub)
        commit = self.committer.commit
        self.access = RunOwners(self.runs)
        self.rules_store = RulesStore(settings, store, clock)
        self.outcomes = OutcomeRecorder(settings, metrics, commit)
        self.registration = Registration(settings, metrics, clock, self.runs, self.access, commit)
        self.report_ingest = ReportIngest(settings, metrics, clock, self.runs, self.access, self.rules_store, commit,
                                          self.outcomes)
        self.agent_calls = AgentCalls(settings, clock, self.get, self.access, commit)
        self.commands = OperatorCommands(settings, store, clock, self.runs, self.get, commit, self.outcomes)
        self.token_service = RuntimeTokens(store, clock)
        self.ticker = AbsenceTicker(settings, metrics, clock, store, self.runs, self.rules_store, self.outcomes,
                                    RunRemoval(settings, clock, self.runs, self.access, self.rules_store, commit))
        self.startup: Any = None
        """The app's :class:`~service.startup.StartupLoader` (``ready`` once the runs are read back)."""

    # == the services' state, as the app and the routes read it ====================================
    @property
    def rules(self) -> RuleSet:
        """The active rules (:class:`RulesStore`)."""
        return self.rules_store.active

    @property
    def rules_meta(self) -> dict[str, Any]:
        return self.rules_store.meta

    @property
    def tokens(self) -> TokenTable:
        """The app's token table (tokens created at runtime are added to it)."""
        return self.token_service.tokens

    @tokens.setter
    def tokens(self, table: TokenTable) -> None:
        self.token_service.tokens = table

    @property
    def reserved_runs(self) -> frozenset[str]:
        """Runs that configured ``TOKEN:RUN`` agent tokens own (set by the app from its TokenTable)."""
        return self.access.reserved_runs

    @reserved_runs.setter
    def reserved_runs(self, runs: frozenset[str]) -> None:
        self.access.reserved_runs = runs

    # == start-up and shutdown =========================================================================
    def load_rules(self) -> None:
        """Read the active rules back (before :meth:`load`; an invalid ``--rules`` file fails here)."""
        self.rules_store.load()

    def load(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Read the runs back from the database (after :meth:`load_rules`, before the writer
        thread starts; ``service/startup.py``). ``progress(loaded, total)`` after each run."""
        now = self.clock()
        self.runs.clear()  # (a failed attempt may have read some)
        rows = self.store.read_now(sql.all_runs)
        for i, row in enumerate(rows, 1):
            st = load_run(self.store, self.settings, row)
            self.runs[st.run] = st
            if progress is not None:
                progress(i, len(rows))
        # new incidents are numbered after every incident read back, and every deleted run's
        continue_ids_after(max([i.id for st in self.runs.values() for i in st.recovery.incidents]
                               + [self.store.read_now(deletion.last_deleted_incident)]))
        by_id = {st.id: st for st in self.runs.values()}
        for alert in self.store.read_now(sql.firing_alerts):
            st = self.runs.get(alert["run"])
            if st is not None:
                st.firing[alert["rule"]] = firing_entry(alert, kind=self.rules_store.kind_of(st.job, alert["rule"]))
                st.book.restore(alert["rule"], firing=True, fired_at=[])
        active = self.rules_store.active
        horizon = now - max((r.cap_window_s for rules in (active.base, *active.by_job.values()) for r in rules), default=3600)
        for run_id, rule, at in self.store.read_now(lambda c: sql.recent_fire_times(c, horizon)):
            if run_id in by_id:
                by_id[run_id].book.restore(rule, firing=False, fired_at=[at])
        self.access.load(self.store)
        self.commands.seen = SeenKeys(self.store.read_now(lambda c: sql.alertmanager_seen(c, now - KEYS_KEPT_S)))

    async def start(self) -> None:
        self.store.start()
        self._tasks = [
            asyncio.create_task(self.ticker.run(), name="trainguard-ticker"),
            asyncio.create_task(self.deliverer.run(), name="trainguard-webhooks"),
        ]

    def begin_shutdown(self) -> None:
        """The server is shutting down: answer long-polls now and end the event streams, so that
        no idle request holds the shutdown up."""
        self.agent_calls.closing = True
        self.events_hub.close()
        for st in list(self.runs.values()):
            st.publication.changed.set()

    async def stop(self) -> None:
        self.events_hub.close()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks = []
        self.store.close()

    # == runs =======================================================================================
    def get(self, run: str) -> RunState:
        st = self.runs.get(run)
        if st is None:
            raise NotFound(f"run {run!r} is not registered")
        return st

    async def check_recorded(self, run: str) -> None:
        """404 unless ``run`` is registered or was deleted (a deleted run's audit trail is kept)."""
        if run not in self.runs and not await self.store.read(lambda c: deletion.was_deleted(c, run)):
            raise NotFound(f"run {run!r} is not registered")

    def check_agent(self, principal: Principal, run: str, *, registering: bool = False, job: str | None = None) -> None:
        """403 or 404 unless ``principal`` may act as the agent of ``run``: :meth:`RunOwners.check_agent`."""
        self.access.check_agent(principal, run, registering=registering, job=job)

    async def register(self, reg: RunRegistration, principal: Principal) -> RunRegistered:
        return await self.registration.register(reg, principal)

    async def delete_run(self, run: str, *, actor: str, force: bool, reason: str) -> dict[str, Any]:
        """``DELETE /v1/runs/{run}``: :meth:`RunRemoval.delete` (the ticker's, which removes the runs that ended long ago)."""
        return await self.ticker.removal.delete(run, actor=actor, force=force, reason=reason)

    # == reports ======================================================================================
    async def ingest_json(self, run: str, body: bytes, principal: Principal) -> bytes:
        """The report endpoint's work: :meth:`ReportIngest.ingest_json`."""
        return await self.report_ingest.ingest_json(run, body, principal)

    async def ingest(self, run: str, report: Report, principal: Principal) -> bytes:
        """Persist and evaluate one report: :meth:`ReportIngest.ingest`."""
        return await self.report_ingest.ingest(run, report, principal)

    # == the agent's other calls ==========================================================================
    async def wait_desired(self, run: str, after: int, wait: float, principal: Principal) -> bytes:
        return await self.agent_calls.wait_desired(run, after, wait, principal)

    async def ack(self, run: str, ack: Ack, principal: Principal) -> dict[str, Any]:
        return await self.agent_calls.ack(run, ack, principal)

    async def preflight(self, run: str, result: PreflightResult, principal: Principal) -> dict[str, Any]:
        return await self.agent_calls.preflight(run, result, principal)

    async def memory_report(self, run: str, report: MemoryReport, principal: Principal) -> dict[str, Any]:
        return await self.agent_calls.memory_report(run, report, principal)

    async def finish(self, run: str, fin: RunFinished, principal: Principal) -> dict[str, Any]:
        return await self.agent_calls.finish(run, fin, principal)

    async def quarantine(self, run: str, report: QuarantineReport, principal: Principal) -> dict[str, Any]:
        """The samples a data skip left out, named on the data incident (``service/data_quarantine.py``)."""
        self.check_agent(principal, run)
        return await record_quarantine(self.get(run), report, now=self.clock(), external_url=self.settings.external_url,
                                       commit=self.committer.commit)

    # == operator commands and Alertmanager ===============================================================
    async def command(
        self, run: str, command: str, *, params: Any = None, reason: str, actor: str, source: str = "operator",
        idempotency: tuple[str, str, str] | None = None, extra: Callable[[sqlite3.Connection], Any] | None = None,
        on_restart: bool = False,
    ) -> tuple[int, bytes]:
        """Apply a command of the registry: :meth:`OperatorCommands.command`."""
        return await self.commands.command(run, command, params=params, reason=reason, actor=actor, source=source,
                                           idempotency=idempotency, extra=extra, on_restart=on_restart)

    async def alertmanager(self, payload: dict[str, Any], actor: str) -> list[dict[str, Any]]:
        return await self.commands.alertmanager(payload, actor)

    # == tokens ===================================================================================
    async def create_token(self, *, name: str, scopes: frozenset[str], job_pattern: str | None, ttl_s: float | None,
                           creator: Principal) -> dict[str, Any]:
        return await self.token_service.create(name=name, scopes=scopes, job_pattern=job_pattern, ttl_s=ttl_s,
                                               creator=creator)

    async def revoke_token(self, token_id: int, principal: Principal) -> dict[str, Any]:
        return await self.token_service.revoke(token_id, principal)

    def load_tokens(self) -> None:
        self.token_service.load()

    # == rules ====================================================================================
    def validate_rules(self, text: str, *, stored: bool = False) -> RuleSet:
        return self.rules_store.validate(text, stored=stored)

    async def put_rules(self, text: str, actor: str, *, remove_all: bool = False) -> dict[str, Any]:
        return await self.rules_store.put(text, actor, remove_all=remove_all)

    def reload_rules_file(self) -> bool:
        """Re-read the ``--rules`` file (SIGHUP): :meth:`RulesStore.reload_file`."""
        return self.rules_store.reload_file()

    async def tick(self) -> None:
        """Evaluate the absence rules now: :meth:`AbsenceTicker.tick`."""
        await self.ticker.tick()

    # == reads ===================================================================================
    def metrics_snapshot(self) -> dict[str, Any]:
        runs: dict[str, int] = {s: 0 for s in ("running", "paused", "stopped", "silent", "registered", "finished")}
        firing: dict[str, int] = {s: 0 for s in SEVERITY_RANK}
        open_incidents: list[str] = []
        awaiting_human: list[str] = []
        for st in list(self.runs.values()):
            runs[st.status] += 1
            for a in list(st.firing.values()):
                firing[a["severity"]] = firing.get(a["severity"], 0) + 1
            if st.recovery.open is not None:
                open_incidents.append(st.run)
            if st.awaiting_human():
                awaiting_human.append(st.run)
        return {"runs": runs, "firing": firing, "outbox_pending": self.deliverer.pending, "waiters": self.agent_calls.waiters,
                "commits": self.store.commits, "incidents_open": open_incidents, "awaiting_human": awaiting_human}
