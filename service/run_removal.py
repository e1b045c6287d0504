"""Removing runs: an operator's ``DELETE /v1/runs/{run}``, and the runs that ended long ago, which
the hourly prune removes (:meth:`RunRemoval.expire`).

A removed run leaves the controller's memory and its limits (``TRAINGUARD_MAX_RUNS``, the
per-token limit); its row moves to ``deleted_runs`` and its reports are deleted in batches by the
prune (``service/deletion_statements.py``); its firing alerts resolve (resolved webhooks
included); its audit events, a ``deleted`` event among them, and its alerts are kept, so the audit
trail of a deleted run stays readable (``GET /v1/runs/{run}/events``). Its name may be registered
again, as a new run.

Which runs the prune removes: a finished run whose finish is older than the report retention
(``TRAINGUARD_REPORT_RETENTION_S``, 7 days), and a run that is neither finished nor paused whose
last report — or the moment it became live, or the controller's start, whichever is latest — is
older than that. A paused run is never removed by the prune: its processes may be waiting for a
person's resume (the operator deletes it)."""

from __future__ import annotations

import logging
import math
import sqlite3
from typing import Any, Callable

from trainguard.service import deletion_statements as deletion
from trainguard.service import statements as sql
from trainguard.service.committer import Commit
from trainguard.service.config import Settings
from trainguard.service.errors import Conflict, NotFound
from trainguard.service.rules_store import RulesStore
from trainguard.service.run_owners import RunOwners
from trainguard.service.runstate import RunState
from trainguard.service.transaction import Transaction, Written, record_resolved

__all__ = ["RunRemoval", "DEFAULT_SILENCE_S"]

log = logging.getLogger("trainguard.controller")

#: The silence after which a run of a job without absence rules is no longer live (the absence rule's default).
DEFAULT_SILENCE_S = 300.0


class RunRemoval:
    """Removes runs from ``runs`` (shared with the controller) and from the database."""

    def __init__(self, settings: Settings, clock: Callable[[], float], runs: dict[str, RunState], access: RunOwners,
                 rules: RulesStore, commit: Commit) -> None:
        self.settings = settings
        self.clock = clock
        self.runs = runs
        self.access = access
        self.rules = rules
        self.commit = commit
        self.reports_left = True
        """Whether a removed run's reports may be left to delete (the prune deletes them in batches;
        at start-up, a removal before a restart may have left some)."""

    def silence_limit(self, job: str) -> float:
        """How long a run of ``job`` may be silent and still live: its longest absence rule's, else
        :data:`DEFAULT_SILENCE_S`."""
        return max((r.seconds for r in self.rules.active.absence_for_job(job)), default=DEFAULT_SILENCE_S)

    def why_live(self, st: RunState, now: float) -> str:
        """Why ``st`` is live ('' when it is not): not finished nor stopped, and paused (its
        processes may wait for a resume) or reporting within its job's silence limit."""
        if st.finish.at is not None or st.desired.stop:
            return ""
        if st.desired.paused:
            return "it is paused, and its processes may be waiting for a resume"
        last = max(st.live_since, st.window.last_received if st.window.count else -math.inf)
        limit = self.silence_limit(st.job)
        if now - last <= limit:
            return (f"its last report or registration was {max(now - last, 0.0):.0f} s ago, within its job's silence "
                    f"limit of {limit:.0f} s")
        return ""

    async def delete(self, run: str, *, actor: str, force: bool, reason: str) -> dict[str, Any]:
        """``DELETE /v1/runs/{run}``: 404 for an unknown run, 409 for a live one unless ``force``."""
        st = self.runs.get(run)
        if st is None:
            raise NotFound(f"run {run!r} is not registered")
        now = self.clock()
        live = self.why_live(st, now)
        if live and not force:
            raise Conflict(f"run {run!r} is live: {live}; stop it first, or delete it anyway with force=true "
                           "(an agent still running registers it again, as a new run)")
        status = st.status
        await self.remove(st, now=now, actor=actor, reason=reason or "deleted by an operator",
                          data={"status": status, "forced": bool(live)})
        return {"run": run, "job": st.job, "status": status, "deleted": True}

    def expired(self, now: float, watching_since: float) -> list[RunState]:
        """The runs the prune removes at ``now`` (module docstring); silence of a run not finished
        counts from ``watching_since`` (the ticker's start) at the earliest."""
        retention = self.settings.report_retention_s
        out = []
        for st in list(self.runs.values()):
            if st.finish.at is not None:
                if now - st.finish.at > retention:
                    out.append(st)
            elif not st.desired.paused:
                last = max(st.live_since, watching_since, st.window.last_received if st.window.count else -math.inf)
                if now - last > retention:
                    out.append(st)
        return out

    async def expire(self, now: float, watching_since: float, limit: int) -> int:
        """Remove up to ``limit`` of the runs :meth:`expired` names; the number removed."""
        removed = 0
        for st in self.expired(now, watching_since)[:limit]:
            if self.runs.get(st.run) is not st:
                continue
            reason = (f"finished {(now - st.finish.at) / 86400:.1f} days ago" if st.finish.at is not None
                      else "silent for longer than the report retention")
            try:
                await self.remove(st, now=now, actor="controller", reason=f"{reason} (TRAINGUARD_REPORT_RETENTION_S)",
                                  data={"status": st.status, "forced": False})
            except Exception:
                log.exception("could not remove run %s", st.run)
                continue
            removed += 1
        return removed

    async def remove(self, st: RunState, *, now: float, actor: str, reason: str, data: dict[str, Any]) -> None:
        """Take ``st`` out of memory and the database in one transaction (put back if it fails)."""
        tx = Transaction()
        self._forget(tx, st)
        run_id, firing = st.id, list(st.firing)
        last_incident = max((i.id for i in st.recovery.incidents), default=0)
        external = self.settings.external_url

        def op(c: sqlite3.Connection) -> Written:
            out = Written()
            hooks = sql.active_webhooks(c) if firing else []
            for name in firing:
                record_resolved(c, run_id, name, now, actor=actor, reason="run deleted", hooks=hooks,
                                external_url=external, out=out)
            out.events.append(sql.insert_event(c, run_id, now=now, kind="deleted", actor=actor, reason=reason,
                                               generation=st.desired.generation, data=data))
            deletion.delete_run(c, run_id, now=now, last_incident=last_incident)
            return out

        await self.commit(tx, op)
        self.reports_left = True  # (a long-poll of the run answers at its end as before; the next one is 404)
        log.info("run %s deleted by %s: %s", st.run, actor, reason)

    def _forget(self, tx: Transaction, st: RunState) -> None:
        """``st`` out of the runs, its owner and its token's count (each put back with ``tx``)."""
        run = st.run
        del self.runs[run]
        owner = self.access.owners.pop(run, None)
        counted = [d for d, runs in self.access.token_runs.items() if run in runs and d != self._bound_digest(run)]
        for digest in counted:
            self.access.token_runs[digest].discard(run)

        def undo() -> None:
            if run in self.runs:  # registered again meanwhile: the new run keeps the name
                return
            self.runs[run] = st
            if owner is not None:
                self.access.owners[run] = owner
            for digest in counted:
                self.access.token_runs.setdefault(digest, set()).add(run)
        tx.on_rollback(undo)

    def _bound_digest(self, run: str) -> str | None:
        """The configured agent token bound to ``run`` (it stays bound: ``agent_bindings`` is kept)."""
        return next((d for d, r in self.access.bindings.items() if r == run), None)
