"""The absence ticker: every ``settings.tick_s``, the absence rules of every live run evaluated at
the current time (a run that went silent fires them), and old rows pruned once an hour.

Silence is counted from the moment the ticker started at the earliest: a controller that was down
(killed, restarted, a standby taking over) received nothing meanwhile, and that is not the runs'
silence. A run whose absence alert was firing already stays as it is (it was silent before)."""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Callable

from trainguard.service import deletion_statements as deletion
from trainguard.service.config import Settings
from trainguard.service.engine import decide
from trainguard.service.evaluate import evaluate
from trainguard.service.metrics import ControllerMetrics
from trainguard.service.outcomes import OutcomeRecorder
from trainguard.service.retention import Retention
from trainguard.service.rules_store import RulesStore
from trainguard.service.run_removal import RunRemoval
from trainguard.service.runstate import RunState, live
from trainguard.service.store import Store
from trainguard.service.transaction import Transaction

__all__ = ["AbsenceTicker", "PRUNE_BATCHES", "PRUNE_REPORTS", "EXPIRE_RUNS"]

#: Reports deleted per transaction (15-70 ms of the writer at ~4 KB a report) and transactions per
#: tick when pruning (50,000 reports a second at the default tick, more than the controller takes in).
PRUNE_REPORTS = 1000
PRUNE_BATCHES = 50
#: Runs that ended long ago removed per tick (one transaction each; the rest at the next ticks).
EXPIRE_RUNS = 100

log = logging.getLogger("trainguard.controller")


class AbsenceTicker:
    """Evaluates the absence rules of the runs in ``runs`` (shared with the controller)."""

    def __init__(self, settings: Settings, metrics: ControllerMetrics, clock: Callable[[], float], store: Store,
                 runs: dict[str, RunState], rules: RulesStore, outcomes: OutcomeRecorder, removal: RunRemoval) -> None:
        self.settings = settings
        self.metrics = metrics
        self.clock = clock
        self.store = store
        self.runs = runs
        self.rules = rules
        self.outcomes = outcomes
        self.removal = removal
        self._last_prune = 0.0
        self._expiring = False  # runs that ended long ago are being removed (EXPIRE_RUNS a tick)
        self._prune_before: float | None = None  # the cutoff of a prune not finished yet
        self.retention = Retention(settings, store)
        """What the prune deletes besides reports and runs (``service/retention.py``)."""
        self.watching_since = -math.inf
        """When the ticker started (:meth:`run`): no run is silent for longer than this."""

    async def tick(self) -> None:
        """Evaluate absence rules for every live run at the current time (and prune old rows).
        Paused, stopped and finished runs are expected to be silent and are skipped; silence is
        counted from the later of the last report and the moment the run became live, and from
        the ticker's start at the earliest (:meth:`_silence_from`)."""
        now = self.clock()
        for st in list(self.runs.values()):
            if st.finish.at is not None or not live(st.desired):
                continue
            absence = self.rules.active.absence_for_job(st.job)
            if not absence:
                continue
            outcome = decide(evaluate(absence, st.window, now, live_since=self._silence_from(st)), st.book, st.desired, now,
                             complete=False)
            self.metrics.evaluations.inc(len(absence))
            if outcome.fired or outcome.resolved:
                try:
                    await self.outcomes.record(st, outcome, now, Transaction())
                except Exception:
                    log.exception("could not record absence alerts of run %s", st.run)
            else:
                self.outcomes.count_suppressed(outcome)
        await self._prune(now)

    async def _prune(self, now: float) -> None:
        """Once an hour, delete the reports older than the retention, remove the runs that ended
        longer ago than it (``service/run_removal.py``) and delete what ``service/retention.py``
        keeps no longer, at most :data:`EXPIRE_RUNS` runs and :data:`PRUNE_BATCHES` transactions (of
        :data:`PRUNE_REPORTS` reports, deleted runs' reports included, or of the retention's rows) a
        tick; what is left, at the next ticks. The reports of an hour at 1,500 a
        second, deleted in one transaction on the event loop, held every request for over a minute
        (longer than a liveness probe waits)."""
        if self._prune_before is None and now - self._last_prune > 3600:
            self._last_prune = now
            self._prune_before = now - self.settings.report_retention_s
            self._expiring = True
            self.retention.start(now, active_rules=int(self.rules.meta.get("version") or 0))
        if self._expiring:
            self._expiring = await self.removal.expire(now, self.watching_since, EXPIRE_RUNS) == EXPIRE_RUNS
        batches = PRUNE_BATCHES
        before = self._prune_before
        while before is not None and batches > 0:
            batches -= 1
            if await self.store.submit(lambda c: deletion.prune_reports(c, before, PRUNE_REPORTS)) < PRUNE_REPORTS:
                self._prune_before = before = None
        while self.removal.reports_left and batches > 0:
            batches -= 1
            self.removal.reports_left = await self.store.submit(lambda c: deletion.purge_deleted_reports(c, PRUNE_REPORTS))
        await self.retention.run(batches)

    def _silence_from(self, st: RunState) -> float:
        """The earliest moment ``st``'s silence may count from: when it became live, or when the
        ticker started unless the run's absence alert is firing (then that alert stays)."""
        if any(a["kind"] == "absence" for a in st.firing.values()):
            return st.live_since
        return max(st.live_since, self.watching_since)

    async def run(self) -> None:
        self.watching_since = self.clock()
        while True:
            await asyncio.sleep(self.settings.tick_s)
            try:
                await self.tick()
            except Exception:
                log.exception("absence ticker failed")
