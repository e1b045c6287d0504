"""The report path (``POST /v1/runs/{run}/reports`` and its fast path, :mod:`service.ingress`):
a report checked, evaluated through :func:`service.evaluation_step.evaluate_report`, stored, and
what it caused recorded (:class:`service.outcomes.OutcomeRecorder`)."""

from __future__ import annotations

import json
import sqlite3
import time
from typing import Callable

import numpy as np

from trainguard.service import statements as sql
from trainguard.service.auth import Principal
from trainguard.service.committer import Commit
from trainguard.service.config import Settings
from trainguard.service.errors import Conflict, Invalid, NotFound
from trainguard.service.evaluation_step import evaluate_report
from trainguard.service.metrics import ControllerMetrics
from trainguard.service.outcomes import OutcomeRecorder
from trainguard.service.rules_store import RulesStore
from trainguard.service.run_owners import RunOwners
from trainguard.service.runstate import RunState, resent, went_back
from trainguard.service.transaction import Transaction
from trainguard.service.webhooks import incident_update
from trainguard.service.window import VECTORS, rank_vectors
from trainguard.protocol.wire import Report

__all__ = ["ReportIngest"]


class ReportIngest:
    """Takes the reports of the runs in ``runs`` (shared with the controller)."""

    def __init__(self, settings: Settings, metrics: ControllerMetrics, clock: Callable[[], float],
                 runs: dict[str, RunState], access: RunOwners, rules: RulesStore, commit: Commit,
                 outcomes: OutcomeRecorder) -> None:
        self.settings = settings
        self.metrics = metrics
        self.clock = clock
        self.runs = runs
        self.access = access
        self.rules = rules
        self.commit = commit
        self.outcomes = outcomes

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
        st = self._reporting_run(run, report, principal)
        ranks = self._checked_values(st, report)
        if resent(st.last_report, report.step_first, report.step_last, report.time, report.values, ranks):
            # Sent again (the answer to the first was lost, e.g. the controller it went to died
            # after committing it): stored and evaluated once, answered like the first.
            self.metrics.resent.inc()
            return b'{"desired":' + st.publication.json + b',"alerts":[]}'
        now = self.clock()
        tx = Transaction()
        if went_back(st.last_report, st.window.last_step, report.step_first):
            tx.assign(st, window=st.window.restarted())  # the rules judge the job's new course only
        saved = st.window.save_next(ranks=bool(ranks))
        tx.on_rollback(lambda: st.window.rollback(saved))
        tx.assign(st.applied, reported=report.applied_generation)
        tx.assign(st, last_report=(report.step_first, report.step_last, report.time, report.values, ranks))
        active = self.rules.active
        rules = active.for_job(st.job)
        rec = st.recovery
        rec.set_policy(active.file.recovery)
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
            self.outcomes.count_suppressed(outcome)
            await self.commit(tx, insert, single_statement=True)
        else:
            await self.outcomes.record(st, outcome, now, tx, insert, changes=changes, incidents=incidents)
        self.metrics.reports.inc()
        names = json.dumps([f.finding.rule.name for f in outcome.fired]).encode() if outcome.fired else b"[]"
        return b'{"desired":' + st.publication.json + b',"alerts":' + names + b"}"

    def _reporting_run(self, run: str, report: Report, principal: Principal) -> RunState:
        """The run ``report`` is for: 404 unknown, 403 another agent's, 409 finished or of another job."""
        self.access.check_agent(principal, run)  # (first: another token's run or none answer the same)
        st = self.runs.get(run)
        if st is None:
            self.metrics.rejected.labels("unknown_run").inc()
            raise NotFound(f"run {run!r} is not registered: POST /v1/runs first")
        if st.finish.at is not None:
            self.metrics.rejected.labels("finished").inc()
            raise Conflict(f"run {run!r} finished at step {st.finish.step}; register it again (POST /v1/runs) to report")
        if report.job != st.job:
            self.metrics.rejected.labels("conflict").inc()
            raise Conflict(f"run {run!r} belongs to job {st.job!r}, the report says {report.job!r}")
        return st

    def _checked_values(self, st: RunState, report: Report) -> dict[str, np.ndarray]:
        """The report's per-rank vectors; 422 past the run's series limit, for a vector not of
        the run's world size or a desync layer naming a rank beyond it."""
        run = st.run
        cols, limit = st.window.columns, self.settings.max_series_per_run
        if len(cols) + len(report.values) > limit:  # (cheap test first: the usual report adds no name)
            new = sum(1 for k in report.values if k not in cols)
            if len(cols) + new > limit:
                self.metrics.rejected.labels("series_limit").inc()
                raise Invalid(f"this report would give run {run!r} {len(cols) + new} distinct metric names; the limit is "
                              f"{limit} per run (TRAINGUARD_MAX_SERIES_PER_RUN)")
        for name in VECTORS:  # (before converting: a packed 'fill' costs nothing until then)
            n = len(getattr(report.ranks, name))
            if n and n != st.world_size:
                self.metrics.rejected.labels("invalid").inc()
                raise Invalid(f"ranks.{name} has {n} values; the run's world_size is {st.world_size}")
        for layer in report.desync:
            if layer.ranks and max(layer.ranks) >= st.world_size:
                self.metrics.rejected.labels("invalid").inc()
                raise Invalid(f"desync layer {layer.layer!r} names rank {max(layer.ranks)}; the run's world_size is "
                              f"{st.world_size}")
        return rank_vectors(report.ranks)
