"""The controller's core: runs, reports, rules, alerts, desired state, audit log.

All state changes happen on the event loop thread, synchronously between awaits, so they are
ordered; each change becomes one store operation (one transaction with everything it implies) and
is published — to long-polls, to the SSE stream, to the webhook worker — only after its commit.
``RunState.desired`` is the newest state (possibly still being written); ``RunState.published`` the
newest committed one, which is what agents see.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import sqlite3
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from trainguard.service import store as sql
from trainguard.service.auth import Principal
from trainguard.service.config import Settings
from trainguard.service.diagnosis import DIAGNOSES
from trainguard.service.engine import AlertBook, FiredAlert, Outcome, command_state, decide
from trainguard.service.metrics import ControllerMetrics
from trainguard.service.rules import AbsenceRule, RuleSet, RulesError, default_rules_text, evaluate, load_rules
from trainguard.service.store import Store
from trainguard.service.webhooks import SEVERITY_RANK, WebhookDeliverer, fingerprint, render
from trainguard.service.window import VECTORS, RunWindow, rank_vectors
from trainguard.protocol.wire import Ack, DesiredState, Report, RunFinished, RunRegistered, RunRegistration

__all__ = ["Controller", "RunState", "NotFound", "Conflict", "Forbidden", "Invalid", "COMMANDS"]

log = logging.getLogger("trainguard.controller")
COMMANDS = ("pause", "resume", "lr-scale", "checkpoint", "stop")  # also Alertmanager actions; "accumulation" is operator-only
_EVENT_QUEUE = 1024


class NotFound(LookupError):
    """404."""


class Conflict(Exception):
    """409."""


class Forbidden(Exception):
    """403."""


class Invalid(ValueError):
    """422."""


@dataclass(slots=True, eq=False)
class RunState:
    id: int
    run: str
    job: str
    world_size: int
    ranks: list[dict[str, Any]]
    agent_version: str
    config: dict[str, Any]
    registered_at: float
    live_since: float
    """When the run last became live (registered, re-registered, unpaused): absence rules count
    silence from the later of this and the last report."""
    window: RunWindow
    desired: DesiredState
    published: DesiredState
    published_json: bytes
    applied_generation: int = 0
    applied_step: int | None = None
    applied_at: float | None = None
    reported_generation: int = 0
    book: AlertBook = field(default_factory=AlertBook)
    firing: dict[str, dict[str, Any]] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    finished_at: float | None = None
    """Set when the agent said the run ended (``POST /v1/runs/{run}/finish``); cleared by a
    re-registration. A finished run is not expected to report."""
    finished_step: int | None = None
    finish_reason: str = ""

    def publish(self, desired: DesiredState) -> None:
        if desired.generation >= self.published.generation:
            self.published = desired
            self.published_json = desired.model_dump_json().encode()
            self.changed.set()
            self.changed = asyncio.Event()

    @property
    def status(self) -> str:
        if self.finished_at is not None:
            return "finished"
        if self.desired.stop:
            return "stopped"
        if self.desired.paused:
            return "paused"
        if any(a["kind"] == "absence" for a in self.firing.values()):
            return "silent"
        return "running" if self.window.count else "registered"


def _actions(rule: Any) -> list[dict[str, Any]]:
    return [a.model_dump(exclude_none=True) for a in rule.actions]


def _live(d: DesiredState) -> bool:
    """Whether a run in desired state ``d`` is expected to report."""
    return not (d.paused or d.stop)


def _action_names(before: DesiredState, after: DesiredState) -> list[str]:
    out = []
    if after.paused != before.paused:
        out.append("pause" if after.paused else "resume")
    if after.stop != before.stop:
        out.append("stop" if after.stop else "resume")
    if after.lr_scale != before.lr_scale:
        out.append("lr_scale")
    if after.checkpoint_seq != before.checkpoint_seq:
        out.append("checkpoint")
    return out


def _resolve_alerts(c: sqlite3.Connection, run_id: int, rule: str, now: float, *, actor: str, reason: str,
                    hooks: list[dict[str, Any]], external_url: str) -> tuple[list[int], int]:
    """Resolve ``rule``'s firing alerts of a run inside the caller's transaction: a "resolved"
    audit event each, and a resolved message to every webhook that wants one. Returns (event
    ids, outbox rows written)."""
    events, outbox = [], 0
    for alert_id in sql.resolve_alerts(c, run_id, rule, now):
        alert = sql.get_alert(c, alert_id)
        events.append(sql.insert_event(c, run_id, now=now, kind="resolved", actor=actor, reason=reason,
                                       generation=None, data={"alert_id": alert_id, "rule": rule}))
        if alert["notify"]:
            for h in hooks:
                if h["send_resolved"] and SEVERITY_RANK[alert["severity"]] >= SEVERITY_RANK[h["min_severity"]]:
                    sql.insert_outbox(c, webhook_id=h["id"], alert_id=alert_id, body=render(h["format"], alert, external_url=external_url), now=now)
                    outbox += 1
    return events, outbox


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
        self.rules: RuleSet = load_rules(default_rules_text())
        self.rules_meta: dict[str, Any] = {"version": 0, "source": "default", "actor": "", "created_at": None}
        self.waiters = 0
        self._subscribers: set[asyncio.Queue[dict[str, Any] | None]] = set()
        self._am_seen: set[tuple[str, str]] = set()
        self._idem_locks: dict[tuple[str, str], list[Any]] = {}  # key -> [lock, users]
        self._registering: dict[str, asyncio.Future[None]] = {}
        self._tasks: list[asyncio.Task[Any]] = []
        self._last_prune = 0.0

    # == start-up =================================================================================
    def load(self) -> None:
        """Read everything back from the database (before the writer thread starts)."""
        s = self.settings
        rules_row = self.store.read_now(sql.latest_rules)
        if s.rules is not None:
            text = s.rules.read_text(encoding="utf-8")
            self.rules = self.validate_rules(text)
            if rules_row is None or rules_row["text"] != text or rules_row["source"] != f"file:{s.rules}":
                vid = self.store.write_now(lambda c: sql.insert_rules_version(c, text, f"file:{s.rules}", "startup", self.clock()))
            else:
                vid = rules_row["id"]
            self.rules_meta = {"version": vid, "source": f"file:{s.rules}", "actor": "startup", "created_at": self.clock()}
        elif rules_row is not None:
            self.rules = self.validate_rules(rules_row["text"])
            self.rules_meta = {k: rules_row[k] for k in ("source", "actor", "created_at")} | {"version": rules_row["id"]}
        now = self.clock()
        for row in self.store.read_now(sql.all_runs):
            desired = DesiredState(
                generation=row["generation"], paused=bool(row["paused"]), lr_scale=row["lr_scale"],
                checkpoint_seq=row["checkpoint_seq"], stop=bool(row["stop"]), reason=row["reason"],
                accumulation_steps=row["accumulation_steps"], accumulation_lr_rule=row["accumulation_lr_rule"],
            )
            window = RunWindow(capacity=s.window_reports, rank_capacity=s.rank_window_reports,
                               world_size=row["world_size"], created=row["registered_at"])
            st = RunState(
                id=row["id"], run=row["run"], job=row["job"], world_size=row["world_size"], ranks=json.loads(row["ranks"]),
                agent_version=row["agent_version"], config=json.loads(row["config"]), registered_at=row["registered_at"],
                live_since=max(row["registered_at"], row["resumed_at"] or -math.inf), window=window, desired=desired, published=desired, published_json=desired.model_dump_json().encode(),
                applied_generation=row["applied_generation"], applied_step=row["applied_step"], applied_at=row["applied_at"],
                finished_at=row["finished_at"], finished_step=row["finished_step"], finish_reason=row["finish_reason"] or "",
            )
            reports = self.store.read_now(lambda c: sql.recent_reports(c, st.id, s.window_reports))
            first_seq = (row["last_seq"] or 0) - len(reports)
            window.count = max(first_seq, 0)
            rank_from = len(reports) - s.rank_window_reports
            for i, rep in enumerate(reports):
                ranks = sql.decode_ranks(rep, st.world_size, VECTORS) if i >= rank_from else {}
                window.append_raw(json.loads(rep["vals"]), ranks, rep["step_last"], rep["received"])
            if row["last_report_at"] is not None:
                window.touch(row["last_report_at"])
            self.runs[st.run] = st
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
        self._am_seen = set(self.store.read_now(lambda c: sql.alertmanager_seen(c, now - 7 * 86400)))

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

    async def stop(self) -> None:
        for q in list(self._subscribers):
            q.put_nowait(None)
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks = []
        self.store.close()

    # == helpers ====================================================================================
    def get(self, run: str) -> RunState:
        st = self.runs.get(run)
        if st is None:
            raise NotFound(f"run {run!r} is not registered")
        return st

    def check_agent(self, principal: Principal, run: str, *, registering: bool = False) -> None:
        """403 unless ``principal`` may act as the agent of ``run``."""
        if principal.kind != "agent":
            return
        bound = principal.bound_run or self.bindings.get(principal.token_digest)
        if bound is None and not registering:
            raise Forbidden("this agent token is not bound to a run yet: register the run first (POST /v1/runs)")
        if bound is not None and bound != run:
            raise Forbidden(f"this agent token is bound to run {bound!r}, not {run!r}")

    def _publish_events(self, events: list[dict[str, Any]]) -> None:
        for ev in events:
            for q in list(self._subscribers):
                try:
                    q.put_nowait(ev)
                except asyncio.QueueFull:  # a consumer too slow: drop it, it reconnects with Last-Event-ID
                    self._subscribers.discard(q)

    def subscribe(self) -> asyncio.Queue[dict[str, Any] | None]:
        q: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(maxsize=_EVENT_QUEUE)
        self._subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue[dict[str, Any] | None]) -> None:
        self._subscribers.discard(q)

    def is_subscribed(self, q: asyncio.Queue[dict[str, Any] | None]) -> bool:
        return q in self._subscribers

    # == registration =================================================================================
    async def register(self, reg: RunRegistration, principal: Principal) -> RunRegistered:
        self.check_agent(principal, reg.run, registering=True)
        now = self.clock()
        ranks = [r.model_dump() for r in reg.ranks]
        bad = [r.rank for r in reg.ranks if r.rank >= reg.world_size]
        if bad:
            raise Invalid(f"ranks {bad[:8]} are >= world_size {reg.world_size}")
        while (registering := self._registering.get(reg.run)) is not None:
            await asyncio.shield(registering)  # a concurrent first registration of this run
        st = self.runs.get(reg.run)
        bind = principal.kind == "agent" and principal.bound_run is None and principal.token_digest not in self.bindings
        if bind and (reg.run in self.reserved_runs or reg.run in self.bindings.values()):
            # A run belongs to the agent token that registered it (or to its TOKEN:RUN entry).
            raise Forbidden(f"run {reg.run!r} belongs to another agent token; to hand it to this one, "
                            f"configure it as TOKEN:{reg.run} in TRAINGUARD_AGENT_TOKENS")
        if bind:
            self.bindings[principal.token_digest] = reg.run
        fields = dict(world_size=reg.world_size, ranks=ranks, agent_version=reg.agent_version, config=reg.config, now=now)
        data = {"world_size": reg.world_size, "ranks": len(ranks), "agent_version": reg.agent_version}
        if st is None:
            def op(c: sqlite3.Connection) -> tuple[int, int]:
                run_id = sql.insert_run(c, run=reg.run, job=reg.job, **fields)
                if bind:
                    sql.bind_agent(c, principal.token_digest, reg.run, now)
                return run_id, sql.insert_event(c, run_id, now=now, kind="registered", actor=principal.actor, reason="registered", generation=0, data=data)
            done = self._registering[reg.run] = asyncio.get_running_loop().create_future()
            try:
                run_id, event_id = await self.store.submit(op)
            except BaseException:
                if bind:
                    self.bindings.pop(principal.token_digest, None)
                raise
            finally:
                del self._registering[reg.run]
                done.set_result(None)
            d = DesiredState()
            st = RunState(
                id=run_id, run=reg.run, job=reg.job, world_size=reg.world_size, ranks=ranks, agent_version=reg.agent_version,
                config=reg.config, registered_at=now, live_since=now,
                window=RunWindow(capacity=self.settings.window_reports, rank_capacity=self.settings.rank_window_reports,
                                 world_size=reg.world_size, created=now),
                desired=d, published=d, published_json=d.model_dump_json().encode(),
            )
            self.runs[reg.run] = st
        else:
            if st.job != reg.job:
                raise Conflict(f"run {reg.run!r} is registered for job {st.job!r}, not {reg.job!r}")
            st.world_size, st.ranks, st.agent_version, st.config = reg.world_size, ranks, reg.agent_version, reg.config
            st.window.resize_world(reg.world_size)
            st.registered_at = st.live_since = now  # a restarted job is live again, finished or not
            st.finished_at, st.finished_step, st.finish_reason = None, None, ""
            run_id = st.id

            def op(c: sqlite3.Connection) -> tuple[int, int]:
                sql.update_run_registration(c, run_id, **fields)
                if bind:
                    sql.bind_agent(c, principal.token_digest, reg.run, now)
                return run_id, sql.insert_event(c, run_id, now=now, kind="registered", actor=principal.actor, reason="re-registered", generation=st.desired.generation, data=data)
            _, event_id = await self.store.submit(op)
        self._publish_events([{"id": event_id, "run": st.run, "job": st.job, "time": now, "kind": "registered",
                               "actor": principal.actor, "reason": "registered", "generation": st.published.generation, "data": data}])
        return RunRegistered(job=st.job, run=st.run, desired=st.published)

    # == reports ======================================================================================
    async def ingest(self, run: str, report: Report, principal: Principal) -> bytes:
        """Persist and evaluate one report; answers ``ReportAccepted`` as JSON bytes."""
        st = self.runs.get(run)
        if st is None:
            self.metrics.rejected.labels("unknown_run").inc()
            raise NotFound(f"run {run!r} is not registered: POST /v1/runs first")
        self.check_agent(principal, run)
        if report.job != st.job:
            self.metrics.rejected.labels("conflict").inc()
            raise Conflict(f"run {run!r} belongs to job {st.job!r}, the report says {report.job!r}")
        ranks = rank_vectors(report.ranks)
        for name, vec in ranks.items():
            if len(vec) != st.world_size:
                self.metrics.rejected.labels("invalid").inc()
                raise Invalid(f"ranks.{name} has {len(vec)} values; the run's world_size is {st.world_size}")
        now = self.clock()
        st.window.append_raw(report.values, ranks, report.step_last, now)
        st.reported_generation = report.applied_generation
        seq = st.window.count
        rules = self.rules.for_job(st.job)
        outcome = decide(evaluate(rules, st.window, now), st.book, st.desired, now, complete=True)
        self.metrics.evaluations.inc(len(rules))
        run_id = st.id
        if not outcome.fired and not outcome.resolved:
            self._count_suppressed(outcome)
            await self.store.submit(lambda c: sql.insert_report(c, run_id, seq, report, now, ranks, VECTORS), single_statement=True)
        else:
            await self._commit_outcome(st, outcome, now, lambda c: sql.insert_report(c, run_id, seq, report, now, ranks, VECTORS))
        self.metrics.reports.inc()
        names = json.dumps([f.finding.rule.name for f in outcome.fired]).encode() if outcome.fired else b"[]"
        return b'{"desired":' + st.published_json + b',"alerts":' + names + b"}"

    def _count_suppressed(self, outcome: Outcome) -> None:
        """Findings a cooldown or cap held back (they may come with nothing else to commit)."""
        for f, why in outcome.suppressed:
            self.metrics.suppressed.labels(f.rule.name, why).inc()

    async def _commit_outcome(self, st: RunState, outcome: Outcome, now: float, extra: Callable[[sqlite3.Connection], Any] | None = None) -> None:
        """Write the alerts, desired-state changes, events and outbox rows of ``outcome`` in one
        transaction, then publish them."""
        self._count_suppressed(outcome)
        if not outcome.fired and not outcome.resolved:
            if extra is not None:
                await self.store.submit(extra)
            return
        before = st.desired
        st.desired = outcome.desired
        run_id, run, job = st.id, st.run, st.job
        external = self.settings.external_url
        step = st.window.last_step  # the step of the report that fired (absence: the last one seen)

        def op(c: sqlite3.Connection) -> dict[str, Any]:
            if extra is not None:
                extra(c)
            hooks = sql.active_webhooks(c)
            out: dict[str, Any] = {"events": [], "alerts": [], "outbox": 0}
            for fa in outcome.fired:
                rule = fa.finding.rule
                diag = DIAGNOSES[rule.diagnosis].as_dict()
                gen = fa.desired.generation if fa.desired else None
                alert_id = sql.insert_alert(
                    c, run_id, rule=rule.name, severity=rule.severity, summary=fa.finding.summary, values=fa.finding.values,
                    diagnosis=diag, actions=_actions(rule), generation=gen, notify=fa.notify, now=now,
                    fingerprint=fingerprint(run, rule.name, now),
                )
                alert = sql.get_alert(c, alert_id)
                out["alerts"].append(alert | {"kind": rule.kind})
                out["events"].append(sql.insert_event(c, run_id, now=now, kind="alert", actor=f"rule:{rule.name}", reason=fa.finding.summary,
                                                      generation=gen, data={"alert_id": alert_id, "rule": rule.name, "severity": rule.severity, "values": fa.finding.values,
                                                            "step": step}))
                if fa.desired is not None:
                    sql.update_desired(c, run_id, fa.desired)
                    out["events"].append(sql.insert_event(c, run_id, now=now, kind="desired", actor=f"rule:{rule.name}", reason=fa.desired.reason,
                                                          generation=fa.desired.generation, data={"desired": fa.desired.model_dump(), "alert_id": alert_id}))
                if fa.notify:
                    for h in hooks:
                        if SEVERITY_RANK[rule.severity] >= SEVERITY_RANK[h["min_severity"]]:
                            sql.insert_outbox(c, webhook_id=h["id"], alert_id=alert_id, body=render(h["format"], alert, external_url=external), now=now)
                            out["outbox"] += 1
            for name in outcome.resolved:
                events, outbox = _resolve_alerts(c, run_id, name, now, actor=f"rule:{name}", reason="condition cleared",
                                                 hooks=hooks, external_url=external)
                out["events"] += events
                out["outbox"] += outbox
            out["events"] = sql.get_events(c, out["events"])
            return out

        try:
            result = await self.store.submit(op)
        except BaseException:
            if st.desired is outcome.desired:
                st.desired = before
            raise
        for alert in result["alerts"]:
            st.firing[alert["rule"]] = self._firing_entry(alert, kind=alert["kind"])
            self.metrics.alerts.labels(alert["rule"], alert["severity"]).inc()
        for name in outcome.resolved:
            st.firing.pop(name, None)
        prev = before
        for fa in outcome.fired:
            if fa.desired is not None:
                for action in _action_names(prev, fa.desired):
                    self.metrics.actions.labels(action, "rule").inc()
                prev = fa.desired
        st.publish(outcome.desired)
        self._publish_events(result["events"])
        if result["outbox"]:
            self.deliverer.wake(result["outbox"])

    # == desired state ==================================================================================
    async def wait_desired(self, run: str, after: int, wait: float, principal: Principal) -> bytes:
        st = self.get(run)
        self.check_agent(principal, run)
        wait = min(max(wait, 0.0), self.settings.longpoll_max_s)
        if st.published.generation <= after and wait > 0:
            deadline = asyncio.get_running_loop().time() + wait
            self.waiters += 1
            try:
                while st.published.generation <= after:
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
        st.applied_generation, st.applied_step, st.applied_at = ack.generation, ack.step, now
        run_id = st.id

        def op(c: sqlite3.Connection) -> int:
            sql.update_applied(c, run_id, ack.generation, ack.step, now)
            return sql.insert_event(c, run_id, now=now, kind="applied", actor=principal.actor, reason=f"applied at step {ack.step}",
                                    generation=ack.generation, data={"step": ack.step})
        event_id = await self.store.submit(op)
        self._publish_events([{"id": event_id, "run": st.run, "job": st.job, "time": now, "kind": "applied", "actor": principal.actor,
                               "reason": f"applied at step {ack.step}", "generation": ack.generation, "data": {"step": ack.step}}])
        return {"applied_generation": ack.generation, "applied_step": ack.step, "recorded": True}

    # == lifecycle ===================================================================================
    async def finish(self, run: str, fin: RunFinished, principal: Principal) -> dict[str, Any]:
        """The run ended (its agent closed): record it, resolve its absence alerts, and let the
        ticker skip it until it registers again. A repeat answers the first finish unchanged."""
        st = self.get(run)
        self.check_agent(principal, run)
        if st.finished_at is not None:
            return self._finished_answer(st, changed=False)
        now = self.clock()
        st.finished_at, st.finished_step, st.finish_reason = now, fin.step, fin.reason
        resolve = self._firing_absence(st)
        run_id, external = st.id, self.settings.external_url
        data = {"step": fin.step, "reason": fin.reason}

        def op(c: sqlite3.Connection) -> tuple[list[dict[str, Any]], int]:
            sql.update_finished(c, run_id, now=now, step=fin.step, reason=fin.reason)
            ids = [sql.insert_event(c, run_id, now=now, kind="finished", actor=principal.actor, reason=f"finished at step {fin.step}: {fin.reason}",
                                    generation=None, data=data)]
            hooks = sql.active_webhooks(c) if resolve else []
            outbox = 0
            for name in resolve:
                events, n = _resolve_alerts(c, run_id, name, now, actor=principal.actor, reason="run finished", hooks=hooks, external_url=external)
                ids += events
                outbox += n
            return sql.get_events(c, ids), outbox

        try:
            events, outbox = await self.store.submit(op)
        except BaseException:
            if st.finished_at == now:
                st.finished_at, st.finished_step, st.finish_reason = None, None, ""
            raise
        self._forget_alerts(st, resolve)
        if outbox:
            self.deliverer.wake(outbox)
        self._publish_events(events)
        return self._finished_answer(st, changed=True)

    @staticmethod
    def _finished_answer(st: RunState, *, changed: bool) -> dict[str, Any]:
        return {"run": st.run, "status": st.status, "finished_at": st.finished_at, "finished_step": st.finished_step,
                "finish_reason": st.finish_reason, "changed": changed}

    @staticmethod
    def _firing_absence(st: RunState) -> list[str]:
        return [name for name, a in st.firing.items() if a["kind"] == "absence"]

    @staticmethod
    def _forget_alerts(st: RunState, names: list[str]) -> None:
        """Drop alerts resolved from outside the rules (committed) from the run's firing set."""
        for name in names:
            st.firing.pop(name, None)
            st.book.resolve(name)

    # == operator commands ===============================================================================
    async def command(
        self, run: str, command: str, *, reason: str, actor: str, source: str = "operator", scale: float | None = None,
        idempotency: tuple[str, str, str] | None = None, extra: Callable[[sqlite3.Connection], Any] | None = None,
        accumulation: tuple[int, str] | None = None,
    ) -> tuple[int, bytes]:
        """Apply an operator (or Alertmanager) command. ``idempotency`` is (principal, key,
        request hash): a repeat answers the stored response, another body under the key is a
        Conflict. ``accumulation``: (steps, LR rule) of the ``accumulation`` command, refused
        (Conflict) for a run whose agent did not opt in. Returns (HTTP status, JSON body)."""
        if idempotency is None:
            return await self._command(run, command, reason, actor, source, scale, None, extra, accumulation)
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
                return await self._command(run, command, reason, actor, source, scale, idempotency, extra, accumulation)
        finally:
            entry[1] -= 1
            if entry[1] == 0:
                del self._idem_locks[(principal, key)]

    async def _command(self, run: str, command: str, reason: str, actor: str, source: str, scale: float | None,
                       idempotency: tuple[str, str, str] | None, extra: Callable[[sqlite3.Connection], Any] | None,
                       accumulation: tuple[int, str] | None = None) -> tuple[int, bytes]:
        st = self.get(run)
        now = self.clock()
        if command == "accumulation" and not isinstance(st.config.get("accumulation_steps"), int):
            raise Conflict(f"run {run!r} does not let the controller set its accumulation steps "
                           "(attach the agent with accumulation_steps=N to opt in)")
        try:
            new = command_state(st.desired, command, reason or f"{command} by {actor}", scale, accumulation)
        except ValueError as e:
            raise Invalid(str(e)) from None
        before, live_since = st.desired, st.live_since
        resolve_absence = self._firing_absence(st) if command == "stop" else []
        unpaused = new is not None and _live(new) and not _live(before)
        result_state = new or st.desired
        body = json.dumps({"run": run, "command": command, "changed": new is not None,
                           "desired": result_state.model_dump()}).encode()
        if new is not None:
            st.desired = new
        if unpaused:
            st.live_since = now  # the run reports again from now on: absence counts from here
        run_id = st.id
        external = self.settings.external_url

        def op(c: sqlite3.Connection) -> tuple[list[dict[str, Any]], int]:
            if extra is not None:
                extra(c)
            ids, outbox = [], 0
            if new is not None:
                sql.update_desired(c, run_id, new)
                ids.append(sql.insert_event(c, run_id, now=now, kind="desired", actor=actor, reason=new.reason, generation=new.generation,
                                            data={"desired": new.model_dump(), "command": command}))
            if unpaused:
                sql.update_resumed(c, run_id, now)
            if resolve_absence:
                hooks = sql.active_webhooks(c)
                for name in resolve_absence:
                    events, n = _resolve_alerts(c, run_id, name, now, actor=actor, reason="run stopped", hooks=hooks, external_url=external)
                    ids += events
                    outbox += n
            if idempotency is not None:
                sql.put_idempotent(c, idempotency[0], idempotency[1], idempotency[2], 200, body, now)
            return sql.get_events(c, ids), outbox

        try:
            events, outbox = await self.store.submit(op)
        except BaseException:
            if new is not None and st.desired is new:
                st.desired = before
                st.live_since = live_since
            raise
        self._forget_alerts(st, resolve_absence)
        if outbox:
            self.deliverer.wake(outbox)
        if new is not None:
            for action in _action_names(before, new):
                self.metrics.actions.labels(action, source).inc()
            st.publish(new)
        self._publish_events(events)
        return 200, body

    # == Alertmanager in ================================================================================
    async def alertmanager(self, payload: dict[str, Any], actor: str) -> list[dict[str, Any]]:
        """Act on the firing alerts of an Alertmanager webhook (version 4) payload that carry a
        ``trainguard_action`` label and a run label (``run`` or ``trainguard_run``). Each alert
        (fingerprint + startsAt) acts once."""
        results = []
        for alert in payload.get("alerts", []):
            labels = alert.get("labels") or {}
            fp = str(alert.get("fingerprint") or hashlib.sha256(json.dumps(labels, sort_keys=True).encode()).hexdigest()[:16])
            starts = str(alert.get("startsAt", ""))
            action = labels.get("trainguard_action")
            run = labels.get("trainguard_run") or labels.get("run")
            res: dict[str, Any] = {"fingerprint": fp, "startsAt": starts, "run": run, "action": action}
            if alert.get("status") != "firing" or not action:
                results.append(res | {"outcome": "ignored", "detail": "not firing or no trainguard_action label"})
                continue
            command = action.replace("_", "-")
            if command not in COMMANDS or not run:
                results.append(res | {"outcome": "error", "detail": f"unknown action {action!r} or no run label"})
                continue
            if (fp, starts) in self._am_seen:
                results.append(res | {"outcome": "duplicate"})
                continue
            scale = None
            if command == "lr-scale":
                try:
                    if "trainguard_lr_scale" in labels:
                        scale = float(labels["trainguard_lr_scale"])
                    elif run in self.runs:
                        scale = self.runs[run].desired.lr_scale * float(labels.get("trainguard_lr_factor", "0.5"))
                except ValueError:
                    results.append(res | {"outcome": "error", "detail": "trainguard_lr_scale / trainguard_lr_factor is not a number"})
                    continue
            ann = alert.get("annotations") or {}
            reason = f"alertmanager {labels.get('alertname', '?')}: {ann.get('summary') or ann.get('description') or action}"
            self._am_seen.add((fp, starts))
            now = self.clock()
            try:
                status, body = await self.command(
                    run, command, reason=reason[:2000], actor=f"alertmanager:{labels.get('alertname', '?')}", source="alertmanager",
                    scale=scale, extra=lambda c, fp=fp, starts=starts: sql.mark_alertmanager_seen(c, fp, starts, now),
                )
            except (NotFound, Invalid) as e:
                self._am_seen.discard((fp, starts))
                results.append(res | {"outcome": "error", "detail": str(e)})
                continue
            except BaseException:
                self._am_seen.discard((fp, starts))
                raise
            results.append(res | {"outcome": "applied", "result": json.loads(body)})
        return results

    # == rules ====================================================================================
    def validate_rules(self, text: str) -> RuleSet:
        return load_rules(text, max_reports=self.settings.window_reports, max_rank_reports=self.settings.rank_window_reports)

    async def put_rules(self, text: str, actor: str) -> dict[str, Any]:
        rules = self.validate_rules(text)  # RulesError -> 422 with the reasons; old rules stay
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
            if st.finished_at is not None or not _live(st.desired):
                continue
            absence = tuple(r for r in self.rules.for_job(st.job) if isinstance(r, AbsenceRule))
            if not absence:
                continue
            outcome = decide(evaluate(absence, st.window, now, live_since=st.live_since), st.book, st.desired, now, complete=False)
            self.metrics.evaluations.inc(len(absence))
            if outcome.fired or outcome.resolved:
                try:
                    await self._commit_outcome(st, outcome, now)
                except Exception:
                    log.exception("could not record absence alerts of run %s", st.run)
        if now - self._last_prune > 3600:
            self._last_prune = now
            keep = self.settings.report_retention_s
            await self.store.submit(lambda c: sql.prune(c, reports_before=now - keep, keys_before=now - 7 * 86400))

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(self.settings.tick_s)
            try:
                await self.tick()
            except Exception:
                log.exception("absence ticker failed")

    # == reads ===================================================================================
    def run_summary(self, st: RunState) -> dict[str, Any]:
        return {
            "run": st.run, "job": st.job, "status": st.status, "world_size": st.world_size,
            "registered_at": st.registered_at, "last_report_at": st.window.last_received if st.window.count else None,
            "last_step": st.window.last_step, "reports": st.window.count,
            "desired_generation": st.published.generation, "applied_generation": st.applied_generation,
            "firing": sorted(st.firing), "finished_at": st.finished_at, "finished_step": st.finished_step,
        }

    def run_detail(self, st: RunState) -> dict[str, Any]:
        last = st.window.latest_values()
        return self.run_summary(st) | {
            "ranks": st.ranks, "agent_version": st.agent_version, "config": st.config,
            "desired": st.published.model_dump(), "applied_step": st.applied_step, "applied_at": st.applied_at,
            "reported_generation": st.reported_generation, "finish_reason": st.finish_reason, "live_since": st.live_since,
            "last_values": last,
            # the noise scale's recommendation next to the batch size in use (None until reported)
            "batch_size": {"current": last.get("trainguard_global_batch_size"),
                           "recommended": last.get("trainguard_recommended_batch_size")},
            "firing_alerts": sorted(st.firing.values(), key=lambda a: a["id"]),
        }

    def metrics_snapshot(self) -> dict[str, Any]:
        runs: dict[str, int] = {s: 0 for s in ("running", "paused", "stopped", "silent", "registered", "finished")}
        firing: dict[str, int] = {s: 0 for s in SEVERITY_RANK}
        for st in list(self.runs.values()):
            runs[st.status] += 1
            for a in list(st.firing.values()):
                firing[a["severity"]] = firing.get(a["severity"], 0) + 1
        return {"runs": runs, "firing": firing, "outbox_pending": self.deliverer.pending, "waiters": self.waiters,
                "commits": self.store.commits}


def nan_safe(value: Any) -> Any:
    """Replace NaN/±Inf floats by the wire's strings (for JSON answers built from stored values)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: nan_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [nan_safe(v) for v in value]
    return value
