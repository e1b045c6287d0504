"""The controller's core: runs, reports, rules, alerts, desired state, audit log.

All state changes happen on the event loop thread, synchronously between awaits, so they are
ordered. Each change is one transaction (:mod:`service.transaction`): the in-memory state changes
first, one store operation writes it with everything it implies, and only after the commit is it
published — to long-polls, to the SSE stream, to the webhook worker; a failed commit takes the
in-memory change back. ``RunState.desired`` is the newest state (possibly still being written);
``RunState.published`` the newest committed one, which is what agents see.
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import logging
import secrets
import sqlite3
import time
from typing import Any, Callable

from trainguard.service import statements as sql
from trainguard.service.alertmanager import SeenKeys, act
from trainguard.service.auth import Principal, TokenTable, may_grant, may_revoke, token_hash
from trainguard.service.config import Settings
from trainguard.service.diagnosis import DIAGNOSES
from trainguard.service.engine import Outcome, command_state, decide
from trainguard.service.errors import Conflict, Forbidden, Invalid, NotFound, TooMany
from trainguard.service.events import EventHub
from trainguard.service.metrics import ControllerMetrics
from trainguard.service.records import Records
from trainguard.service.startup import load_rules_state, load_run
from trainguard.service.evaluate import evaluate
from trainguard.service.evaluation_step import evaluate_report
from trainguard.service.incidents import RecoveryChange, RunRecovery, continue_ids_after
from trainguard.service.rules import RuleSet, RulesError, default_rules_text, load_rules, require_rules
from trainguard.service.runstate import RunState, action_names, live, resent, target_address, valid_host
from trainguard.service.store import Store
from trainguard.service.transaction import Transaction, Written, record_fired, record_incident, record_resolved
from trainguard.service.webhooks import SEVERITY_RANK, IncidentUpdate, WebhookDeliverer, incident_update
from trainguard.service.window import VECTORS, RunWindow, rank_vectors
from trainguard.protocol.commands import BY_NAME, CommandRefused
from trainguard.protocol.wire import Ack, DesiredState, MemoryReport, PreflightResult, Report, RunFinished, RunRegistered, RunRegistration

__all__ = ["Controller"]

log = logging.getLogger("trainguard.controller")
#: Idempotency keys and Alertmanager fingerprints are remembered this long.
_KEYS_KEPT_S = 7 * 86400
Op = Callable[[sqlite3.Connection], "Written | None"]


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
        self.bindings: dict[str, str] = {}
        #: Runs that configured ``TOKEN:RUN`` agent tokens own (set by the app from its TokenTable).
        self.reserved_runs: frozenset[str] = frozenset()
        #: The app's token table (tokens created at runtime are added to it).
        self.tokens = TokenTable((), ())
        self.rules: RuleSet = load_rules(default_rules_text())
        self.rules_meta: dict[str, Any] = {"version": 0, "source": "default", "actor": "", "created_at": None}
        self.waiters = 0
        #: Set by :meth:`begin_shutdown`: long-polls answer at once.
        self.closing = False
        self.records = Records(store, clock)
        """Alerts, the audit log and webhooks as stored (what the routes read and write)."""
        self.events_hub = EventHub()
        """The audit events published after each commit (the SSE stream subscribes to it)."""
        self._am_seen = SeenKeys()
        self._idem_locks: dict[tuple[str, str], list[Any]] = {}  # key -> [lock, users]
        self._registering: dict[str, asyncio.Future[None]] = {}
        #: Runs registered by each agent token (by digest): bounded by ``settings.max_runs_per_token``.
        self.token_runs: dict[str, set[str]] = {}
        #: Owner (token digest) of each run registered with a token created at runtime.
        self.owners: dict[str, str] = {}
        self._tasks: list[asyncio.Task[Any]] = []
        self._last_prune = 0.0

    # == start-up =================================================================================
    def load(self) -> None:
        """Read everything back from the database (before the writer thread starts)."""
        loaded = load_rules_state(self.store, self.settings, self.clock, self.validate_rules)
        if loaded is not None:
            self.rules, self.rules_meta = loaded
        now = self.clock()
        for row in self.store.read_now(sql.all_runs):
            st = load_run(self.store, self.settings, row)
            self.runs[st.run] = st
        continue_ids_after(max((i.id for st in self.runs.values() for i in st.recovery.incidents), default=0))
        by_id = {st.id: st for st in self.runs.values()}
        for alert in self.store.read_now(sql.firing_alerts):
            st = self.runs.get(alert["run"])
            if st is not None:
                st.firing[alert["rule"]] = self._firing_entry(alert, kind=self._rule_kind(st.job, alert["rule"]))
                st.book.restore(alert["rule"], firing=True, fired_at=[])
        horizon = now - max((r.cap_window_s for rules in (self.rules.base, *self.rules.by_job.values()) for r in rules), default=3600)
        for run_id, rule, at in self.store.read_now(lambda c: sql.recent_fire_times(c, horizon)):
            if run_id in by_id:
                by_id[run_id].book.restore(rule, firing=False, fired_at=[at])
        self.bindings = self.store.read_now(sql.agent_bindings)
        self.owners = self.store.read_now(sql.run_owners)
        for digest, run in [*self.bindings.items(), *((d, r) for r, d in self.owners.items())]:
            self.token_runs.setdefault(digest, set()).add(run)
        self._am_seen = SeenKeys(self.store.read_now(lambda c: sql.alertmanager_seen(c, now - _KEYS_KEPT_S)))

    def _rule_kind(self, job: str, name: str) -> str:
        for r in self.rules.for_job(job):
            if r.name == name:
                return r.kind
        return "unknown"

    @staticmethod
    def _firing_entry(alert: dict[str, Any], *, kind: str) -> dict[str, Any]:
        return {
            "id": alert["id"], "rule": alert["rule"], "kind": kind, "severity": alert["severity"],
            "summary": alert["summary"], "starts_at": alert["starts_at"], "values": alert["values"],
            "diagnosis": alert["diagnosis"], "fingerprint": alert["fingerprint"],
        }

    async def start(self) -> None:
        self.store.start()
        self._tasks = [
            asyncio.create_task(self._ticker(), name="trainguard-ticker"),
            asyncio.create_task(self.deliverer.run(), name="trainguard-webhooks"),
        ]

    def begin_shutdown(self) -> None:
        """The server is shutting down: answer long-polls now and end the event streams, so that
        no idle request holds the shutdown up."""
        self.closing = True
        self.events_hub.close()
        for st in list(self.runs.values()):
            st.changed.set()

    def reload_rules_file(self) -> bool:
        """Re-read the ``--rules`` file (SIGHUP). An unreadable or invalid file is logged and the
        active rules stay. Returns whether new rules apply."""
        path = self.settings.rules
        if path is None:
            log.warning("SIGHUP: no rules file was given (--rules); nothing to reload")
            return False
        try:
            text = path.read_text(encoding="utf-8")
            rules = self.validate_rules(text)
        except (OSError, UnicodeDecodeError) as e:
            log.error("SIGHUP: cannot read %s, the active rules stay: %s", path, e)
            return False
        except RulesError as e:
            log.error("SIGHUP: %s is invalid, the active rules stay: %s", path, "; ".join(e.reasons))
            return False
        now = self.clock()
        source = f"file:{path}"

        def stored(fut: asyncio.Future[int]) -> None:
            if fut.cancelled() or fut.exception() is not None:
                log.error("SIGHUP: the new rules apply but could not be recorded: %r", None if fut.cancelled() else fut.exception())
                return
            self.rules_meta = {"version": fut.result(), "source": source, "actor": "sighup", "created_at": now}

        self.rules = rules
        self.rules_meta = {"version": self.rules_meta.get("version", 0), "source": source, "actor": "sighup", "created_at": now}
        self.store.submit(lambda c: sql.insert_rules_version(c, text, source, "sighup", now)).add_done_callback(stored)
        log.warning("SIGHUP: rules reloaded from %s (%d rules)", path, len(rules.base))
        return True

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

    # == the transaction path ========================================================================
    async def _commit(self, tx: Transaction, op: Op, *, after: Callable[[Written], None] | None = None,
                      single_statement: bool = False) -> Written:
        """Write ``op`` in the next group commit. After the commit: wake the webhook worker for
        the outbox rows it wrote, publish its events, then ``after`` (the caller's own
        publishing). If the commit fails: ``tx.rollback()`` and raise. A caller cancelled while
        waiting (its client went away) does not change the outcome: the operation still commits
        or fails, and is published or taken back then."""
        def run(c: sqlite3.Connection) -> Written:
            w = op(c) or Written()
            if w.events:
                w.published = sql.get_events(c, w.events)
            return w

        def published(w: Written) -> Written:
            if w.outbox:
                self.deliverer.wake(w.outbox)
            self.events_hub.publish(w.published)
            if after is not None:
                after(w)
            return w

        def orphaned(ok: bool, value: Any) -> None:
            published(value) if ok else tx.rollback()

        fut = self.store.submit(run, single_statement=single_statement, orphaned=orphaned)
        try:
            w = await fut
        except asyncio.CancelledError:
            if not fut.cancelled():  # the outcome arrived just before the cancellation
                orphaned(fut.exception() is None, fut.exception() or fut.result())
            raise  # else the store hands the outcome to orphaned() after the commit
        except BaseException:
            tx.rollback()
            raise
        return published(w)

    # == helpers ====================================================================================
    def get(self, run: str) -> RunState:
        st = self.runs.get(run)
        if st is None:
            raise NotFound(f"run {run!r} is not registered")
        return st

    def check_agent(self, principal: Principal, run: str, *, registering: bool = False, job: str | None = None) -> None:
        """403 unless ``principal`` may act as the agent of ``run`` (of ``job``, when registering).

        A run has at most one owner, whatever kind of agent token claims it: the ``TOKEN:RUN``
        entries naming it, else the token that registered it first (a configured token bound to
        it, or a token created at runtime). Registration refuses a run another token owns
        (:meth:`_claimed_by_other`), so on every later route the token's own claim suffices."""
        if principal.kind != "agent":
            return
        if run in self.reserved_runs and principal.bound_run != run:
            raise Forbidden(f"run {run!r} belongs to the agent token configured for it (TOKEN:{run} in TRAINGUARD_AGENT_TOKENS)")
        if principal.job_pattern is not None:  # a token created at runtime, for the runs of some jobs
            owner = self.owners.get(run)
            if owner == principal.token_digest:
                return
            if owner is not None:
                raise Forbidden(f"run {run!r} belongs to the token that registered it")
            if not registering:
                raise Forbidden(f"this token did not register run {run!r}: register it first (POST /v1/runs)")
            if job is not None and not fnmatch.fnmatchcase(job, principal.job_pattern):
                raise Forbidden(f"this token may register runs of jobs matching {principal.job_pattern!r}, not {job!r}")
            if run in self.runs or self._claimed_by_other(run, principal.token_digest):
                raise Forbidden(f"run {run!r} belongs to another agent token")
            return
        bound = principal.bound_run or self.bindings.get(principal.token_digest)
        if bound is None and not registering:
            raise Forbidden("this agent token is not bound to a run yet: register the run first (POST /v1/runs)")
        if bound is not None and bound != run:
            raise Forbidden(f"this agent token is bound to run {bound!r}, not {run!r}")
        if bound is None and self._claimed_by_other(run, principal.token_digest):
            raise Forbidden(f"run {run!r} belongs to another agent token; to hand it to this one, "
                            f"configure it as TOKEN:{run} in TRAINGUARD_AGENT_TOKENS")

    def _claimed_by_other(self, run: str, digest: str) -> bool:
        """Whether an agent token other than ``digest`` owns ``run`` (or is registering it)."""
        if run in self.reserved_runs:
            return True
        owner = self.owners.get(run)
        if owner is not None and owner != digest:
            return True
        return any(r == run and d != digest for d, r in self.bindings.items())

    # == registration =================================================================================
    async def register(self, reg: RunRegistration, principal: Principal) -> RunRegistered:
        self.check_agent(principal, reg.run, registering=True, job=reg.job)
        bad_hosts = [r.rank for r in reg.ranks if not valid_host(r.host)]
        if bad_hosts:
            raise Invalid(f"ranks {bad_hosts[:8]}: host must be a host name or an IP address (letters, digits, '-', '_', "
                          f"'.'; IPv6 in brackets or bare), not {next(r.host for r in reg.ranks if not valid_host(r.host))!r}")
        now = self.clock()
        ranks = [r.model_dump() for r in reg.ranks]
        bad = [r.rank for r in reg.ranks if r.rank >= reg.world_size]
        if bad:
            raise Invalid(f"ranks {bad[:8]} are >= world_size {reg.world_size}")
        if reg.world_size > self.settings.max_world_size:
            self.metrics.registrations_rejected.labels("world_size_limit").inc()
            raise Invalid(f"world_size {reg.world_size} exceeds this controller's limit of {self.settings.max_world_size} "
                          "ranks per run (TRAINGUARD_MAX_WORLD_SIZE)")
        waited = False
        while (registering := self._registering.get(reg.run)) is not None:
            await asyncio.shield(registering)  # a concurrent first registration of this run
            waited = True
        if waited:  # the other registration may have claimed the run meanwhile
            self.check_agent(principal, reg.run, registering=True, job=reg.job)
        st = self.runs.get(reg.run)
        digest = principal.token_digest
        if st is None:
            self._check_run_limits(digest)
        bind = (principal.kind == "agent" and principal.bound_run is None and principal.job_pattern is None
                and digest not in self.bindings)
        if st is not None and st.job != reg.job:
            raise Conflict(f"run {reg.run!r} is registered for job {st.job!r}, not {reg.job!r}")
        tx = Transaction()
        if bind:
            self.bindings[digest] = reg.run
            tx.on_rollback(lambda: self.bindings.pop(digest, None))
        own = principal.job_pattern is not None and reg.run not in self.owners
        if own:
            self.owners[reg.run] = digest
            tx.on_rollback(lambda: self.owners.pop(reg.run, None))
        fields = dict(world_size=reg.world_size, ranks=ranks, agent_version=reg.agent_version, config=reg.config, now=now)
        data = {"world_size": reg.world_size, "ranks": len(ranks), "agent_version": reg.agent_version}
        first = st is None
        if st is not None:
            old_world = st.world_size
            st.window.resize_world(reg.world_size)
            tx.on_rollback(lambda: st.window.resize_world(old_world))  # (the per-rank history is gone)
            tx.assign(st, world_size=reg.world_size, ranks=ranks, agent_version=reg.agent_version, config=reg.config,
                      registered_at=now, live_since=now,  # a restarted job is live again, finished or not
                      finished_at=None, finished_step=None, finish_reason="", last_report=None)
            st.recovery.configure(reg.config)
        generation = 0 if st is None else st.desired.generation

        def op(c: sqlite3.Connection) -> Written:
            run_id = sql.insert_run(c, run=reg.run, job=reg.job, **fields) if first else st.id
            if not first:
                sql.update_run_registration(c, run_id, **fields)
            if bind:
                sql.bind_agent(c, digest, reg.run, now)
            if own:
                sql.own_run(c, reg.run, digest, now)
            event = sql.insert_event(c, run_id, now=now, kind="registered", actor=principal.actor,
                                     reason="registered" if first else "re-registered", generation=generation, data=data)
            return Written(events=[event], value=run_id)

        if not first:
            await self._commit(tx, op)
            return RunRegistered(job=st.job, run=st.run, desired=st.published)
        done = self._registering[reg.run] = asyncio.get_running_loop().create_future()
        try:
            await self._commit(tx, op, after=lambda w: self._add_run(reg, ranks, w.value, now, digest))
        finally:
            del self._registering[reg.run]
            done.set_result(None)
        st = self.runs[reg.run]
        return RunRegistered(job=st.job, run=st.run, desired=st.published)

    def _check_run_limits(self, digest: str) -> None:
        """429 when a new run would exceed the controller's or the registering token's limit."""
        if len(self.runs) + len(self._registering) >= self.settings.max_runs:
            self.metrics.registrations_rejected.labels("runs_limit").inc()
            raise TooMany(f"the controller holds {len(self.runs)} runs, its limit (TRAINGUARD_MAX_RUNS)")
        owned = self.token_runs.get(digest, ())
        if len(owned) >= self.settings.max_runs_per_token:
            self.metrics.registrations_rejected.labels("token_runs_limit").inc()
            raise TooMany(f"this token registered {len(owned)} runs, its limit (TRAINGUARD_MAX_RUNS_PER_TOKEN)")

    def _add_run(self, reg: RunRegistration, ranks: list[dict[str, Any]], run_id: int, now: float,
                 digest: str = "") -> None:
        self.token_runs.setdefault(digest, set()).add(reg.run)
        d = DesiredState()
        self.runs[reg.run] = RunState(
            id=run_id, run=reg.run, job=reg.job, world_size=reg.world_size, ranks=ranks, agent_version=reg.agent_version,
            config=reg.config, registered_at=now, live_since=now,
            window=RunWindow(capacity=self.settings.window_reports, rank_capacity=self.settings.rank_window_reports,
                             world_size=reg.world_size, created=now),
            desired=d, published=d, published_json=d.model_dump_json().encode(),
            recovery=RunRecovery.for_config(reg.config),
        )

    # == reports ======================================================================================
    async def ingest_json(self, run: str, body: bytes, principal: Principal) -> bytes:
        """The report endpoint's work, shared by its fast path (:mod:`service.ingress`) and its
        route: parse ``body`` (pydantic's ``ValidationError`` propagates), ingest, and record the
        latency. Answers ``ReportAccepted`` as JSON bytes."""
        t0 = time.perf_counter()
        report = Report.model_validate_json(body)
        answer = await self.ingest(run, report, principal)
        self.metrics.ingest_latency.observe(time.perf_counter() - t0)
        return answer

    async def ingest(self, run: str, report: Report, principal: Principal) -> bytes:
        """Persist and evaluate one report; answers ``ReportAccepted`` as JSON bytes."""
        st = self.runs.get(run)
        if st is None:
            self.metrics.rejected.labels("unknown_run").inc()
            raise NotFound(f"run {run!r} is not registered: POST /v1/runs first")
        self.check_agent(principal, run)
        if st.finished_at is not None:
            self.metrics.rejected.labels("finished").inc()
            raise Conflict(f"run {run!r} finished at step {st.finished_step}; register it again (POST /v1/runs) to report")
        if report.job != st.job:
            self.metrics.rejected.labels("conflict").inc()
            raise Conflict(f"run {run!r} belongs to job {st.job!r}, the report says {report.job!r}")
        if resent(st.last_report, report.step_first, report.step_last, report.time, report.values):
            # Sent again (the answer to the first was lost, e.g. the controller it went to died
            # after committing it): stored and evaluated once, answered like the first.
            self.metrics.resent.inc()
            return b'{"desired":' + st.published_json + b',"alerts":[]}'
        cols, limit = st.window.columns, self.settings.max_series_per_run
        if len(cols) + len(report.values) > limit:  # (cheap test first: the usual report adds no name)
            new = sum(1 for k in report.values if k not in cols)
            if len(cols) + new > limit:
                self.metrics.rejected.labels("series_limit").inc()
                raise Invalid(f"this report would give run {run!r} {len(cols) + new} distinct metric names; the limit is "
                              f"{limit} per run (TRAINGUARD_MAX_SERIES_PER_RUN)")
        ranks = rank_vectors(report.ranks)
        for name, vec in ranks.items():
            if len(vec) != st.world_size:
                self.metrics.rejected.labels("invalid").inc()
                raise Invalid(f"ranks.{name} has {len(vec)} values; the run's world_size is {st.world_size}")
        now = self.clock()
        tx = Transaction()
        saved = st.window.save_next(ranks=bool(ranks))
        tx.on_rollback(lambda: st.window.rollback(saved))
        tx.assign(st, reported_generation=report.applied_generation,
                  last_report=(report.step_first, report.step_last, report.time, report.values))
        rules = self.rules.for_job(st.job)
        rec = st.recovery
        rec.set_policy(self.rules.file.recovery)
        step = evaluate_report(report, ranks, now, rules=rules, window=st.window, book=st.book, recovery=rec,
                               desired=st.desired, rank_hosts=st.ranks)
        tx.on_rollback(lambda: rec.restore(step.recovery_saved))
        run_id, seq = st.id, st.window.count
        outcome, changes = step.outcome, step.changes
        self.metrics.evaluations.inc(len(rules))
        # each incident this report opened or changed, with what it changed in it
        incidents = [(d, incident_update(before, d)) for before, d in step.incidents]

        def insert(c: sqlite3.Connection) -> None:
            sql.insert_report(c, run_id, seq, report, now, ranks, VECTORS)

        if not outcome.fired and not outcome.resolved and not changes and not incidents:
            self._count_suppressed(outcome)
            await self._commit(tx, insert, single_statement=True)
        else:
            await self._commit_outcome(st, outcome, now, tx, insert, changes=changes, incidents=incidents)
        self.metrics.reports.inc()
        names = json.dumps([f.finding.rule.name for f in outcome.fired]).encode() if outcome.fired else b"[]"
        return b'{"desired":' + st.published_json + b',"alerts":' + names + b"}"

    def _count_suppressed(self, outcome: Outcome) -> None:
        """Findings a cooldown or cap held back (they may come with nothing else to commit)."""
        for f, why in outcome.suppressed:
            self.metrics.suppressed.labels(f.rule.name, why).inc()

    async def _commit_outcome(self, st: RunState, outcome: Outcome, now: float, tx: Transaction,
                              extra: Callable[[sqlite3.Connection], Any] | None = None, *,
                              changes: list[RecoveryChange] | None = None,
                              incidents: list[tuple[dict[str, Any], IncidentUpdate]] | None = None) -> None:
        """Write the alerts, desired-state changes, events and outbox rows of ``outcome`` (which
        has fired or resolved something), and the recovery's own ``changes`` (escalation rungs,
        LR ramp) and ``incidents`` that changed (each with its change: an event and the webhooks'
        messages), in one transaction with ``extra``, then publish them."""
        self._count_suppressed(outcome)
        tx.on_rollback(lambda: st.book.undo(outcome.book_prior))
        before = st.desired
        changes, incidents = changes or [], incidents or []
        final = changes[-1].desired if changes else outcome.desired
        tx.assign(st, desired=final)
        run_id, run, job, external = st.id, st.run, st.job, self.settings.external_url
        step = st.window.last_step  # the step of the report that fired (absence: the last one seen)

        def op(c: sqlite3.Connection) -> Written:
            if extra is not None:
                extra(c)
            hooks = sql.active_webhooks(c)
            out = Written(value=[])
            for fa in outcome.fired:
                alert = record_fired(c, run_id, run, fa, now, step=step, hooks=hooks, external_url=external, out=out)
                out.value.append(alert | {"kind": fa.finding.rule.kind})
            for name in outcome.resolved:
                record_resolved(c, run_id, name, now, actor=f"rule:{name}", reason="condition cleared",
                                hooks=hooks, external_url=external, out=out)
            for ch in changes:
                sql.update_desired(c, run_id, ch.desired)
                out.events.append(sql.insert_event(c, run_id, now=now, kind="desired", actor=ch.actor,
                                                   reason=ch.desired.reason, generation=ch.desired.generation,
                                                   data={"desired": ch.desired.model_dump()}))
            for inc, change in incidents:
                record_incident(c, run_id, run, job, inc, change, now, hooks=hooks, external_url=external, out=out)
            return out

        def after(w: Written) -> None:
            for alert in w.value:
                st.firing[alert["rule"]] = self._firing_entry(alert, kind=alert["kind"])
                self.metrics.alerts.labels(alert["rule"], alert["severity"]).inc()
            for name in outcome.resolved:
                st.firing.pop(name, None)
            prev = before
            for fa in outcome.fired:
                if fa.desired is not None:
                    self._count_actions(prev, fa.desired, "rule")
                    prev = fa.desired
            for ch in changes:
                self._count_actions(prev, ch.desired, "recovery")
                prev = ch.desired
            for _, change in incidents:
                self.metrics.count_incident(change)
            st.publish(final)

        await self._commit(tx, op, after=after)

    def _count_actions(self, before: DesiredState, after: DesiredState, source: str) -> None:
        for action in action_names(before, after):
            self.metrics.actions.labels(action, source).inc()

    # == desired state ==================================================================================
    async def wait_desired(self, run: str, after: int, wait: float, principal: Principal) -> bytes:
        st = self.get(run)
        self.check_agent(principal, run)
        wait = min(max(wait, 0.0), self.settings.longpoll_max_s)
        if st.published.generation <= after and wait > 0:
            deadline = asyncio.get_running_loop().time() + wait
            self.waiters += 1
            try:
                while st.published.generation <= after and not self.closing:
                    remaining = deadline - asyncio.get_running_loop().time()
                    if remaining <= 0:
                        break
                    try:
                        await asyncio.wait_for(st.changed.wait(), remaining)
                    except TimeoutError:
                        break
            finally:
                self.waiters -= 1
        return st.published_json

    async def ack(self, run: str, ack: Ack, principal: Principal) -> dict[str, Any]:
        st = self.get(run)
        self.check_agent(principal, run)
        if ack.generation > st.published.generation:
            raise Conflict(f"generation {ack.generation} was never published (newest is {st.published.generation})")
        now = self.clock()
        if ack.generation <= st.applied_generation and st.applied_step is not None:
            return {"applied_generation": st.applied_generation, "applied_step": st.applied_step, "recorded": False}
        tx = Transaction()
        tx.assign(st, applied_generation=ack.generation, applied_step=ack.step, applied_at=now)
        run_id = st.id

        def op(c: sqlite3.Connection) -> Written:
            sql.update_applied(c, run_id, ack.generation, ack.step, now)
            return Written(events=[sql.insert_event(c, run_id, now=now, kind="applied", actor=principal.actor,
                                                    reason=f"applied at step {ack.step}", generation=ack.generation,
                                                    data={"step": ack.step})])
        await self._commit(tx, op)
        return {"applied_generation": ack.generation, "applied_step": ack.step, "recorded": True}

    # == lifecycle ===================================================================================
    async def preflight(self, run: str, result: PreflightResult, principal: Principal) -> dict[str, Any]:
        """Record the run's pre-flight result: shown in its status, and as an event (persisted)."""
        st = self.get(run)
        self.check_agent(principal, run)
        now = self.clock()
        counts = {s: sum(c.status == s for c in result.checks) for s in ("pass", "warn", "fail", "skip")}
        data = result.model_dump() | {"received": now, "counts": counts}
        run_id = st.id
        failed = [c.name for c in result.checks if c.status == "fail"]

        def op(c: sqlite3.Connection) -> Written:
            reason = f"pre-flight: {counts['fail']} failed, {counts['warn']} warned" + (f" ({', '.join(failed[:8])})" if failed else "")
            return Written(events=[sql.insert_event(c, run_id, now=now, kind="preflight", actor=principal.actor,
                                                    reason=reason, generation=None, data=data)])

        tx = Transaction()
        tx.assign(st, preflight=data)
        await self._commit(tx, op)
        return {"run": run, "counts": counts}

    async def memory_report(self, run: str, report: MemoryReport, principal: Principal) -> dict[str, Any]:
        """Record a memory trace's result: shown in the run's status and on its firing
        ``memory_growth``-diagnosed alerts, and kept as an event (persisted)."""
        st = self.get(run)
        self.check_agent(principal, run)
        now = self.clock()
        data = report.model_dump() | {"received": now}
        run_id = st.id
        top = "; ".join(f"{o.owner}: {o.bytes_per_step / 2**20:.2f} MiB/step" for o in report.owners[:4]) or "nothing retained"

        def op(c: sqlite3.Connection) -> Written:
            return Written(events=[sql.insert_event(c, run_id, now=now, kind="memory_report", actor=principal.actor,
                                                    reason=f"memory trace of {report.steps} step(s) at step {report.step}: {top}",
                                                    generation=None, data=data)])

        def after(_: Written) -> None:
            for alert in st.firing.values():
                if alert["rule"] == "memory_growth" or alert["diagnosis"].get("symptom") == DIAGNOSES["memory_growth"].symptom:
                    alert["memory_report"] = data

        tx = Transaction()
        tx.assign(st, memory_report=data)
        await self._commit(tx, op, after=after)
        return {"run": run, "owners": len(report.owners)}

    async def finish(self, run: str, fin: RunFinished, principal: Principal) -> dict[str, Any]:
        """The run ended (its agent closed): record it, resolve its absence alerts, and let the
        ticker skip it until it registers again. A repeat answers the first finish unchanged."""
        st = self.get(run)
        self.check_agent(principal, run)
        if st.finished_at is not None:
            return self._finished_answer(st, changed=False)
        now = self.clock()
        tx = Transaction()
        tx.assign(st, finished_at=now, finished_step=fin.step, finish_reason=fin.reason)
        resolve = st.firing_absence()
        run_id, external = st.id, self.settings.external_url
        data = {"step": fin.step, "reason": fin.reason}

        def op(c: sqlite3.Connection) -> Written:
            sql.update_finished(c, run_id, now=now, step=fin.step, reason=fin.reason)
            out = Written(events=[sql.insert_event(c, run_id, now=now, kind="finished", actor=principal.actor,
                                                   reason=f"finished at step {fin.step}: {fin.reason}", generation=None, data=data)])
            hooks = sql.active_webhooks(c) if resolve else []
            for name in resolve:
                record_resolved(c, run_id, name, now, actor=principal.actor, reason="run finished", hooks=hooks,
                                external_url=external, out=out)
            return out

        await self._commit(tx, op, after=lambda w: st.forget_alerts(resolve))
        return self._finished_answer(st, changed=True)

    @staticmethod
    def _finished_answer(st: RunState, *, changed: bool) -> dict[str, Any]:
        return {"run": st.run, "status": st.status, "finished_at": st.finished_at, "finished_step": st.finished_step,
                "finish_reason": st.finish_reason, "changed": changed}

    # == operator commands ===============================================================================
    async def command(
        self, run: str, command: str, *, params: Any = None, reason: str, actor: str, source: str = "operator",
        idempotency: tuple[str, str, str] | None = None, extra: Callable[[sqlite3.Connection], Any] | None = None,
    ) -> tuple[int, bytes]:
        """Apply a command of the registry (``trainguard.protocol.commands.BY_NAME``) from an
        operator or Alertmanager. ``params``: its body, an instance of the command's ``request``
        (None: the body's defaults; a dict is validated into it; one that does not validate is
        Invalid, 422). A command the run did not opt in to (``requires_config``) or that cannot be
        carried out now (``CommandRefused``: a rollback without a good snapshot) is a Conflict
        (409). ``idempotency`` is (principal, key, request hash): a repeat answers the stored
        response, another body under the key is a Conflict. Returns (HTTP status, JSON body)."""
        args = (run, command, params, reason, actor, source)
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

    async def _command(self, run: str, command: str, params: Any, reason: str, actor: str, source: str,
                       idempotency: tuple[str, str, str] | None,
                       extra: Callable[[sqlite3.Connection], Any] | None) -> tuple[int, bytes]:
        st = self.get(run)
        now = self.clock()
        spec = BY_NAME.get(command)
        if spec is not None and spec.requires_config is not None:
            key, why = spec.requires_config
            if not isinstance(st.config.get(key), int):
                raise Conflict(f"run {run!r} does not let the controller set its {key.replace('_', ' ')} ({why})")
        try:
            new = command_state(st.desired, command, reason or f"{command} by {actor}", params=params, ctx=st.recovery)
        except CommandRefused as e:
            raise Conflict(str(e)) from None
        except ValueError as e:
            raise Invalid(str(e)) from None
        before = st.desired
        resolve_absence = st.firing_absence() if command == "stop" else []
        body = json.dumps({"run": run, "command": command, "changed": new is not None,
                           "desired": (new or before).model_dump()}).encode()
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
                self._count_actions(before, new, source)
                st.publish(new)

        await self._commit(tx, op, after=after)
        return 200, body

    # == Alertmanager in ================================================================================
    async def alertmanager(self, payload: dict[str, Any], actor: str) -> list[dict[str, Any]]:
        """Act on the firing alerts of an Alertmanager webhook (version 4) payload, each
        (fingerprint + startsAt) once: see :func:`service.alertmanager.act`."""
        return await act(payload, self._am_seen, self.command, self.clock, self._targets)

    def _targets(self, run: str) -> set[str] | None:
        """The ``host:port`` Prometheus scrapes for each rank of ``run`` (as /v1/sd/targets names them)."""
        st = self.runs.get(run)
        return None if st is None else {target_address(r["host"], r["port"]) for r in st.ranks}

    # == tokens ===================================================================================
    async def create_token(self, *, name: str, scopes: frozenset[str], job_pattern: str | None, ttl_s: float | None,
                           creator: Principal) -> dict[str, Any]:
        """A new token (shown once in the answer), stored as its SHA-256 digest and admitted at once;
        403 when it would grant more than ``creator`` holds (:func:`service.auth.may_grant`)."""
        now = self.clock()
        expires = None if ttl_s is None else now + ttl_s
        refused = may_grant(creator, scopes, expires)
        if refused is not None:
            raise Forbidden(refused)
        token = "tg_" + secrets.token_urlsafe(32)
        digest = token_hash(token)
        actor = creator.actor
        tid = await self.store.submit(lambda c: sql.insert_token(
            c, token_hash=digest, name=name, scopes=sorted(scopes), job_pattern=job_pattern, creator=actor, now=now,
            expires_at=expires))
        self.tokens.add_stored(digest, scopes, job_pattern=job_pattern, expires_at=expires)
        log.warning("token %d (%r, scopes %s, jobs %r) created by %s", tid, name, "+".join(sorted(scopes)), job_pattern, actor)
        return {"id": tid, "token": token, "name": name, "scopes": sorted(scopes), "job_pattern": job_pattern,
                "creator": actor, "created_at": now, "expires_at": expires}

    async def revoke_token(self, token_id: int, principal: Principal) -> dict[str, Any]:
        """Revoke a live token: 404 when there is none, 403 unless ``principal`` may
        (:func:`service.auth.may_revoke`). It stops authenticating at once, and the console
        sessions signed in with it end on their next request."""
        now = self.clock()
        actor = principal.actor

        def op(c: sqlite3.Connection) -> tuple[str | None, str | None]:
            creator = sql.live_token_creator(c, token_id)
            if creator is None:
                return None, None
            refused = may_revoke(principal, creator)
            return (None, refused) if refused is not None else (sql.revoke_token(c, token_id, actor=actor, now=now), None)

        digest, refused = await self.store.submit(op)
        if refused is not None:
            raise Forbidden(refused)
        if digest is None:
            raise NotFound(f"no live token with id {token_id}")
        self.tokens.remove_stored(digest)
        log.warning("token %d revoked by %s", token_id, actor)
        return {"id": token_id, "revoked_at": now, "revoked_by": actor}

    def load_tokens(self) -> None:
        """Admit the stored live tokens (at start-up)."""
        for row in self.store.read_now(lambda c: sql.active_tokens(c, self.clock())):
            self.tokens.add_stored(row["token_hash"], frozenset(row["scopes"]), job_pattern=row["job_pattern"],
                                   expires_at=row["expires_at"])

    # == rules ====================================================================================
    def validate_rules(self, text: str, *, stored: bool = False) -> RuleSet:
        """Rules that come in (``PUT /v1/rules``, the ``--rules`` file, a simulation's) must read
        only what reports carry (``service/rule_names.py``). ``stored``: rules accepted before that
        check load as they are, each such name logged."""
        limits = dict(max_reports=self.settings.window_reports, max_rank_reports=self.settings.rank_window_reports)
        try:
            return load_rules(text, **limits, check_names=True)
        except RulesError as e:
            if not stored:
                raise
            rules = load_rules(text, **limits)  # RulesError: invalid anyway
            log.warning("the stored rules read names no report carries, so these rules never fire: %s", "; ".join(e.reasons))
            return rules

    async def put_rules(self, text: str, actor: str, *, remove_all: bool = False) -> dict[str, Any]:
        """Replace the rules. Parsing and validation run in a worker thread (a large file takes a
        while and reports keep flowing meanwhile); a file without rules is refused unless it says
        ``rules: []`` and ``remove_all`` confirms it (:func:`service.rules.require_rules`)."""
        rules = await asyncio.to_thread(self.validate_rules, text)  # RulesError -> 422 with the reasons; old rules stay
        require_rules(rules, remove_all=remove_all)
        now = self.clock()
        vid = await self.store.submit(lambda c: sql.insert_rules_version(c, text, "api", actor, now))
        self.rules = rules
        self.rules_meta = {"version": vid, "source": "api", "actor": actor, "created_at": now}
        return self.rules_meta

    # == absence ticker ============================================================================
    async def tick(self) -> None:
        """Evaluate absence rules for every live run at the current time (and prune old rows).
        Paused, stopped and finished runs are expected to be silent and are skipped; silence is
        counted from the later of the last report and the moment the run became live."""
        now = self.clock()
        for st in list(self.runs.values()):
            if st.finished_at is not None or not live(st.desired):
                continue
            absence = self.rules.absence_for_job(st.job)
            if not absence:
                continue
            outcome = decide(evaluate(absence, st.window, now, live_since=st.live_since), st.book, st.desired, now, complete=False)
            self.metrics.evaluations.inc(len(absence))
            if outcome.fired or outcome.resolved:
                try:
                    await self._commit_outcome(st, outcome, now, Transaction())
                except Exception:
                    log.exception("could not record absence alerts of run %s", st.run)
            else:
                self._count_suppressed(outcome)
        if now - self._last_prune > 3600:
            self._last_prune = now
            keep = self.settings.report_retention_s
            await self.store.submit(lambda c: sql.prune(c, reports_before=now - keep, keys_before=now - _KEYS_KEPT_S))

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(self.settings.tick_s)
            try:
                await self.tick()
            except Exception:
                log.exception("absence ticker failed")

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
        return {"runs": runs, "firing": firing, "outbox_pending": self.deliverer.pending, "waiters": self.waiters,
                "commits": self.store.commits, "incidents_open": open_incidents, "awaiting_human": awaiting_human}
