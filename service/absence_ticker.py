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

from trainguard.service import statements as sql
from trainguard.service.config import Settings
from trainguard.service.engine import decide
from trainguard.service.evaluate import evaluate
from trainguard.service.metrics import ControllerMetrics
from trainguard.service.operator_commands import KEYS_KEPT_S
from trainguard.service.outcomes import OutcomeRecorder
from trainguard.service.rules_store import RulesStore
from trainguard.service.runstate import RunState, live
from trainguard.service.store import Store
from trainguard.service.transaction import Transaction

__all__ = ["AbsenceTicker"]

log = logging.getLogger("trainguard.controller")


class AbsenceTicker:
    """Evaluates the absence rules of the runs in ``runs`` (shared with the controller)."""

    def __init__(self, settings: Settings, metrics: ControllerMetrics, clock: Callable[[], float], store: Store,
                 runs: dict[str, RunState], rules: RulesStore, outcomes: OutcomeRecorder) -> None:
        self.settings = settings
        self.metrics = metrics
        self.clock = clock
        self.store = store
        self.runs = runs
        self.rules = rules
        self.outcomes = outcomes
        self._last_prune = 0.0
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
        if now - self._last_prune > 3600:
            self._last_prune = now
            keep = self.settings.report_retention_s
            await self.store.submit(lambda c: sql.prune(c, reports_before=now - keep, keys_before=now - KEYS_KEPT_S))

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
