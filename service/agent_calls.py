"""The agent's calls besides registering and reporting: the desired state's long-poll and the
acks of its generations, the pre-flight result, a memory trace's result, and the run's finish."""

from __future__ import annotations

import asyncio
import sqlite3
from typing import Any, Callable

from trainguard.service import statements as sql
from trainguard.service.auth import Principal
from trainguard.service.committer import Commit
from trainguard.service.config import Settings
from trainguard.service.diagnosis import DIAGNOSES
from trainguard.service.errors import Conflict
from trainguard.service.run_owners import RunOwners
from trainguard.service.runstate import Finish, RunState
from trainguard.service.slots import POLLS_PER_OPERATOR_TOKEN, long_poll_slots
from trainguard.service.transaction import Transaction, Written, record_resolved
from trainguard.protocol.wire import Ack, MemoryReport, PreflightResult, RunFinished

__all__ = ["AgentCalls"]


class AgentCalls:
    """The agent's other calls on the runs ``get`` finds (one of them or NotFound)."""

    def __init__(self, settings: Settings, clock: Callable[[], float], get: Callable[[str], RunState],
                 access: RunOwners, commit: Commit) -> None:
        self.settings = settings
        self.clock = clock
        self.get = get
        self.access = access
        self.commit = commit
        self.waiters = 0
        """Long-polls waiting now."""
        #: Set when the server shuts down: long-polls answer at once.
        self.closing = False
        #: The long-polls waiting, bounded per run and token, per operator token and in all.
        self.polls = long_poll_slots(settings.max_connections)

    async def wait_desired(self, run: str, after: int, wait: float, principal: Principal) -> bytes:
        """The run's desired state once its generation exceeds ``after``, or after ``wait`` s
        (capped); a wait takes one of the bounded :attr:`polls` (429 beyond them)."""
        self.access.check_agent(principal, run)  # (first: another token's run or none answer the same)
        st = self.get(run)
        wait = min(max(wait, 0.0), self.settings.longpoll_max_s)
        if st.publication.desired.generation <= after and wait > 0:
            deadline = asyncio.get_running_loop().time() + wait
            release = self._take_poll(principal, run)
            self.waiters += 1
            try:
                while st.publication.desired.generation <= after and not self.closing:
                    remaining = deadline - asyncio.get_running_loop().time()
                    if remaining <= 0:
                        break
                    try:
                        await asyncio.wait_for(st.publication.changed.wait(), remaining)
                    except TimeoutError:
                        break
            finally:
                self.waiters -= 1
                release()
        return st.publication.json

    def _take_poll(self, principal: Principal, run: str) -> Callable[[], None]:
        """A long-poll's slot: an agent's counted per run, an operator's for all its runs."""
        token = principal.token_digest or principal.actor
        if principal.kind == "operator":
            return self.polls.take((token, None), holder="this token", per_key=POLLS_PER_OPERATOR_TOKEN,
                                   remedy="wait for one to answer")
        return self.polls.take((token, run), holder=f"this token's run {run!r}", remedy="wait for one to answer (a run's "
                               "leader holds one; those of a restarted leader end within TRAINGUARD_LONGPOLL_MAX_S)")

    async def ack(self, run: str, ack: Ack, principal: Principal) -> dict[str, Any]:
        self.access.check_agent(principal, run)  # (first: another token's run or none answer the same)
        st = self.get(run)
        if ack.generation > st.publication.desired.generation:
            raise Conflict(f"generation {ack.generation} was never published (newest is {st.publication.desired.generation})")
        now = self.clock()
        if ack.generation <= st.applied.generation and st.applied.step is not None:
            return {"applied_generation": st.applied.generation, "applied_step": st.applied.step, "recorded": False}
        tx = Transaction()
        tx.assign(st.applied, generation=ack.generation, step=ack.step, at=now)
        run_id = st.id

        def op(c: sqlite3.Connection) -> Written:
            sql.update_applied(c, run_id, ack.generation, ack.step, now)
            return Written(events=[sql.insert_event(c, run_id, now=now, kind="applied", actor=principal.actor,
                                                    reason=f"applied at step {ack.step}", generation=ack.generation,
                                                    data={"step": ack.step})])
        await self.commit(tx, op)
        return {"applied_generation": ack.generation, "applied_step": ack.step, "recorded": True}

    async def preflight(self, run: str, result: PreflightResult, principal: Principal) -> dict[str, Any]:
        """Record the run's pre-flight result: shown in its status, and as an event (persisted)."""
        self.access.check_agent(principal, run)  # (first: another token's run or none answer the same)
        st = self.get(run)
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
        await self.commit(tx, op)
        return {"run": run, "counts": counts}

    async def memory_report(self, run: str, report: MemoryReport, principal: Principal) -> dict[str, Any]:
        """Record a memory trace's result: shown in the run's status and on its firing
        ``memory_growth``-diagnosed alerts, and kept as an event (persisted)."""
        self.access.check_agent(principal, run)  # (first: another token's run or none answer the same)
        st = self.get(run)
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
        await self.commit(tx, op, after=after)
        return {"run": run, "owners": len(report.owners)}

    async def finish(self, run: str, fin: RunFinished, principal: Principal) -> dict[str, Any]:
        """The run ended (its agent closed): record it, resolve its absence alerts, and let the
        ticker skip it until it registers again. A repeat answers the first finish unchanged."""
        self.access.check_agent(principal, run)  # (first: another token's run or none answer the same)
        st = self.get(run)
        if st.finish.at is not None:
            return self._finished_answer(st, changed=False)
        now = self.clock()
        tx = Transaction()
        tx.assign(st, finish=Finish(at=now, step=fin.step, reason=fin.reason))
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

        await self.commit(tx, op, after=lambda w: st.forget_alerts(resolve))
        return self._finished_answer(st, changed=True)

    @staticmethod
    def _finished_answer(st: RunState, *, changed: bool) -> dict[str, Any]:
        return {"run": st.run, "status": st.status, "finished_at": st.finish.at, "finished_step": st.finish.step,
                "finish_reason": st.finish.reason, "changed": changed}
