"""Registering a run (``POST /v1/runs``): checked, bounded per controller and per token, written
once even when two ranks register the same run at the same time."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from typing import Any, Callable

from trainguard.service import deletion_statements as deletion
from trainguard.service import statements as sql
from trainguard.service.auth import Principal
from trainguard.service.committer import Commit
from trainguard.service.config import Settings
from trainguard.service.errors import Conflict, Invalid, TooMany
from trainguard.service.rank_nodes import listed
from trainguard.service.incidents import RunRecovery
from trainguard.service.metrics import ControllerMetrics
from trainguard.service.run_owners import RunOwners
from trainguard.service.runstate import Finish, Publication, RunState, desired_state, target_address, valid_host
from trainguard.service.transaction import Transaction, Written
from trainguard.service.window import RunWindow
from trainguard.protocol.wire import DesiredState, RankEndpoint, RunRegistered, RunRegistration

__all__ = ["Registration", "shared_endpoints"]

log = logging.getLogger("trainguard.controller")

#: Shared endpoints and ranks of each named in a registration's warning (the rest counted).
_SHOWN = 4


def shared_endpoints(ranks: list[RankEndpoint]) -> str:
    """The /metrics endpoints (host:port) that two or more of ``ranks`` registered, as a warning
    ('' when every rank's is its own). Not refused: the run's monitoring and control do not depend
    on them, and a loopback ``metrics_host`` (the agent's default) registers one from every node."""
    by_address: dict[str, list[int]] = {}
    for r in ranks:
        by_address.setdefault(target_address(r.host.lower(), r.port), []).append(r.rank)
    shared = [(address, found) for address, found in by_address.items() if len(found) > 1]
    if not shared:
        return ""
    named = "; ".join(f"{address} by ranks {listed(found, _SHOWN)}" for address, found in shared[:_SHOWN])
    more = f" (and {len(shared) - _SHOWN} more endpoints)" if len(shared) > _SHOWN else ""
    return (f"one /metrics endpoint registered by several ranks: {named}{more}; Prometheus scrapes one process "
            "there, not each rank: give every rank a host other hosts reach (AgentConfig.metrics_host) and a port "
            "of its own")


class Registration:
    """Adds runs to ``runs`` (shared with the controller) and re-registers them."""

    def __init__(self, settings: Settings, metrics: ControllerMetrics, clock: Callable[[], float],
                 runs: dict[str, RunState], access: RunOwners, commit: Commit) -> None:
        self.settings = settings
        self.metrics = metrics
        self.clock = clock
        self.runs = runs
        self.access = access
        self.commit = commit
        self._registering: dict[str, asyncio.Future[None]] = {}

    async def register(self, reg: RunRegistration, principal: Principal) -> RunRegistered:
        self.access.check_agent(principal, reg.run, registering=True, job=reg.job)
        self._check_ranks(reg)
        now = self.clock()
        ranks = [r.model_dump() for r in reg.ranks]
        await self._after_concurrent_registration(reg, principal)
        st = self.runs.get(reg.run)
        digest = principal.token_digest
        if st is None:
            self._check_run_limits(digest)
        if st is not None and st.job != reg.job:
            raise Conflict(f"run {reg.run!r} is registered for job {st.job!r}, not {reg.job!r}")
        tx = Transaction()
        bind, own = self._claim(tx, principal, reg.run)
        fields = dict(world_size=reg.world_size, ranks=ranks, agent_version=reg.agent_version, config=reg.config, now=now)
        data = {"world_size": reg.world_size, "ranks": len(ranks), "agent_version": reg.agent_version}
        first = st is None
        reason = self._event_reason(reg, first)
        if st is not None:
            self._reregister(tx, st, reg, ranks, now)
        generation = 0 if st is None else st.desired.generation

        applied = None if first else max(st.applied.generation, st.applied.reported)

        def op(c: sqlite3.Connection) -> Written:
            run_id = sql.insert_run(c, run=reg.run, job=reg.job, run_id=deletion.next_run_id(c), **fields) if first else st.id
            stored = None
            if not first:
                sql.update_run_registration(c, run_id, **fields)
                stored = sql.published_desired(c, run_id, applied) if applied else {}
            if bind:
                sql.bind_agent(c, digest, reg.run, now)
            if own:
                sql.own_run(c, reg.run, digest, now)
            event = sql.insert_event(c, run_id, now=now, kind="registered", actor=principal.actor,
                                     reason=reason, generation=generation, data=data)
            return Written(events=[event], value=(run_id, stored))

        if not first:
            written = await self.commit(tx, op)
            return RunRegistered(job=st.job, run=st.run, desired=st.publication.desired,
                                 applied=desired_state(written.value[1]))
        done = self._registering[reg.run] = asyncio.get_running_loop().create_future()
        try:
            await self.commit(tx, op, after=lambda w: self._add_run(reg, ranks, w.value[0], now, digest))
        finally:
            del self._registering[reg.run]
            done.set_result(None)
        st = self.runs[reg.run]
        return RunRegistered(job=st.job, run=st.run, desired=st.publication.desired)

    async def _after_concurrent_registration(self, reg: RunRegistration, principal: Principal) -> None:
        """Wait out a concurrent first registration of ``reg.run``; the other registration may
        have claimed the run meanwhile, so access is checked again after it."""
        waited = False
        while (registering := self._registering.get(reg.run)) is not None:
            await asyncio.shield(registering)
            waited = True
        if waited:
            self.access.check_agent(principal, reg.run, registering=True, job=reg.job)

    @staticmethod
    def _event_reason(reg: RunRegistration, first: bool) -> str:
        """The registration event's reason; /metrics endpoints shared by ranks are warned of there
        (``trainguard events``) and in the controller's log."""
        shared = shared_endpoints(reg.ranks)
        if shared:
            log.warning("run %r: %s", reg.run, shared)
        return ("registered" if first else "re-registered") + (f"; {shared}" if shared else "")

    def _claim(self, tx: Transaction, principal: Principal, run: str) -> tuple[bool, bool]:
        """(bind, own): a configured agent token not bound yet is bound to ``run``; a token created
        at runtime owns ``run`` when nobody does (both taken back with ``tx``)."""
        digest = principal.token_digest
        bind = (principal.kind == "agent" and principal.bound_run is None and principal.job_pattern is None
                and digest not in self.access.bindings)
        if bind:
            self.access.bindings[digest] = run
            tx.on_rollback(lambda: self.access.bindings.pop(digest, None))
        own = principal.job_pattern is not None and run not in self.access.owners
        if own:
            self.access.owners[run] = digest
            tx.on_rollback(lambda: self.access.owners.pop(run, None))
        return bind, own

    def _check_ranks(self, reg: RunRegistration) -> None:
        """422 for a rank's bad host or number, or a world larger than the controller's limit."""
        bad_hosts = [r.rank for r in reg.ranks if not valid_host(r.host)]
        if bad_hosts:
            raise Invalid(f"ranks {bad_hosts[:8]}: host must be a host name or an IP address (letters, digits, '-', '_', "
                          f"'.'; IPv6 in brackets or bare), not {next(r.host for r in reg.ranks if not valid_host(r.host))!r}")
        bad = [r.rank for r in reg.ranks if r.rank >= reg.world_size]
        if bad:
            raise Invalid(f"ranks {bad[:8]} are >= world_size {reg.world_size}")
        bad = [r.rank for r in reg.ranks if r.local_rank >= reg.world_size]  # (a node holds no more ranks than the job)
        if bad:
            raise Invalid(f"ranks {bad[:8]}: local_rank must be < world_size {reg.world_size}")
        if reg.world_size > self.settings.max_world_size:
            self.metrics.registrations_rejected.labels("world_size_limit").inc()
            raise Invalid(f"world_size {reg.world_size} exceeds this controller's limit of {self.settings.max_world_size} "
                          "ranks per run (TRAINGUARD_MAX_WORLD_SIZE)")

    @staticmethod
    def _reregister(tx: Transaction, st: RunState, reg: RunRegistration, ranks: list[dict[str, Any]], now: float) -> None:
        """A known run registers again (its job restarted): its ranks, config and liveness anew."""
        old_world = st.world_size
        st.window.resize_world(reg.world_size)
        tx.on_rollback(lambda: st.window.resize_world(old_world))  # (the per-rank history is gone)
        tx.assign(st, world_size=reg.world_size, ranks=ranks, agent_version=reg.agent_version, config=reg.config,
                  registered_at=now, live_since=now,  # a restarted job is live again, finished or not
                  finish=Finish(), last_report=None)
        st.recovery.configure(reg.config)
        saved = st.recovery.save()
        st.recovery.job_restarted()  # a new process: the old one's snapshots are gone
        tx.on_rollback(lambda: st.recovery.restore(saved))

    def _check_run_limits(self, digest: str) -> None:
        """429 when a new run would exceed the controller's or the registering token's limit."""
        if len(self.runs) + len(self._registering) >= self.settings.max_runs:
            self.metrics.registrations_rejected.labels("runs_limit").inc()
            raise TooMany(f"the controller holds {len(self.runs)} runs, its limit (TRAINGUARD_MAX_RUNS)")
        owned = self.access.token_runs.get(digest, ())
        if len(owned) >= self.settings.max_runs_per_token:
            self.metrics.registrations_rejected.labels("token_runs_limit").inc()
            raise TooMany(f"this token registered {len(owned)} runs, its limit (TRAINGUARD_MAX_RUNS_PER_TOKEN)")

    def _add_run(self, reg: RunRegistration, ranks: list[dict[str, Any]], run_id: int, now: float,
                 digest: str = "") -> None:
        self.access.token_runs.setdefault(digest, set()).add(reg.run)
        d = DesiredState()
        self.runs[reg.run] = RunState(
            id=run_id, run=reg.run, job=reg.job, world_size=reg.world_size, ranks=ranks, agent_version=reg.agent_version,
            config=reg.config, registered_at=now, live_since=now,
            window=RunWindow(capacity=self.settings.window_reports, rank_capacity=self.settings.rank_window_reports,
                             world_size=reg.world_size, created=now),
            desired=d, publication=Publication.of(d),
            recovery=RunRecovery.for_config(reg.config),
        )
