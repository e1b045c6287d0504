"""The absence ticker: every ``settings.tick_s``, the absence rules of every live run evaluated at
the current time (a run that went silent fires them), and old rows pruned once an hour."""

from __future__ import annotations

import asyncio
import logging
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

    async def tick(self) -> None:
        """Evaluate absence rules for every live run at the current time (and prune old rows).
        Paused, stopped and finished runs are expected to be silent and are skipped; silence is
        counted from the later of the last report and the moment the run became live."""
        now = self.clock()
        for st in list(self.runs.values()):
            if st.finish.at is not None or not live(st.desired):
                continue
            absence = self.rules.active.absence_for_job(st.job)
            if not absence:
                continue
            outcome = decide(evaluate(absence, st.window, now, live_since=st.live_since), st.book, st.desired, now, complete=False)
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

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.tick_s)
            try:
                await self.tick()
            except Exception:
                log.exception("absence ticker failed")
