"""Start-up: the controller's state read back from the database (rules, runs and their windows).

The controller listens before its runs are read back (:class:`StartupLoader`,
:class:`LoadingGate`): with many runs the read takes a while, and a connection refused meanwhile
looks like a dead controller. What is read per run is what the rules and the status pages need,
each one range scan of an index: the registration and desired state (one row of ``runs``), the
newest ``window_reports`` reports (the window the rules read: no rule may read more,
``RulesStore.validate``), the newest incidents (``events`` by run and kind) and the firing
alerts. Older reports stay in the database, where nothing at start-up reads them.

(Its old name, ``service/recovery.py``, misled: recovery from incidents is ``service/incidents.py`` and
``service/recovery/``.)"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import math
import sqlite3
import time
from pathlib import Path
from typing import Any, Callable

import pydantic_core

from trainguard.service import statements as sql
from trainguard.service.config import Settings
from trainguard.service.incidents import RunRecovery
from trainguard.service.rules import RuleSet, require_rules
from trainguard.service.runstate import Applied, Finish, Publication, RunState, known_desired, went_back
from trainguard.service.store import Store
from trainguard.service.window import VECTORS, RunWindow
from trainguard.protocol.wire import DesiredState

__all__ = ["LOADING_ROLE", "LoadingGate", "StartupLoader", "load_rules_state", "load_run", "stored_desired"]

log = logging.getLogger("trainguard.startup")


def load_rules_state(store: Store, settings: Settings, clock: Callable[[], float],
                     validate: Callable[..., RuleSet]) -> tuple[RuleSet, dict[str, Any]] | None:
    """The active rules and their metadata: the ``--rules`` file (recorded as a new version when
    it changed), else the rules last stored with ``PUT /v1/rules``; ``None``: the defaults."""
    rules_row = store.read_now(sql.latest_rules)
    path: Path | None = settings.rules
    if path is not None:
        text = path.read_text(encoding="utf-8")
        rules = validate(text)
        require_rules(rules, remove_all=True, source="file")  # an empty file would remove every rule
        if rules_row is None or rules_row["text"] != text or rules_row["source"] != f"file:{path}":
            vid = store.write_now(lambda c: sql.insert_rules_version(c, text, f"file:{path}", "startup", clock()))
        else:
            vid = rules_row["id"]
        return rules, {"version": vid, "source": f"file:{path}", "actor": "startup", "created_at": clock()}
    if rules_row is not None:
        meta = {k: rules_row[k] for k in ("source", "actor", "created_at")} | {"version": rules_row["id"]}
        return validate(rules_row["text"], stored=True), meta
    return None


#: The desired state's columns of schema versions 1-9 (before it was one JSON value), as
#: ``DesiredState`` names them; booleans were stored as integers.
_V9_COLUMNS = ("generation", "paused", "lr_scale", "checkpoint_seq", "stop", "rollback_seq", "rollback_step", "reason",
               "accumulation_steps", "accumulation_lr_rule", "memory_trace_seq", "verify_seq", "data_skip_until",
               "stop_exit_code")


def stored_desired(row: Any) -> DesiredState:
    """A run row's desired state: its ``desired`` JSON (fields a newer registry added take their
    defaults; fields it no longer has are dropped), or, for a row last written before schema
    version 10, its old columns."""
    text = row["desired"]
    if text is None:
        values = {k: row[k] for k in _V9_COLUMNS}
        return DesiredState(**values | {"paused": bool(values["paused"]), "stop": bool(values["stop"])})
    return known_desired(json.loads(text))


def load_run(store: Store, settings: Settings, row: sqlite3.Row) -> RunState:
    """A run as stored, with its rule window refilled from its newest ``window_reports`` reports
    (one range scan of the reports' ``(run_id, seq)`` key) and its newest incidents."""
    s = settings
    desired = stored_desired(row)
    window = RunWindow(capacity=s.window_reports, rank_capacity=s.rank_window_reports,
                       world_size=row["world_size"], created=row["registered_at"])
    st = RunState(
        id=row["id"], run=row["run"], job=row["job"], world_size=row["world_size"], ranks=json.loads(row["ranks"]),
        agent_version=row["agent_version"], config=json.loads(row["config"]), registered_at=row["registered_at"],
        live_since=max(row["registered_at"], row["resumed_at"] or -math.inf), window=window, desired=desired,
        publication=Publication.of(desired),
        applied=Applied(generation=row["applied_generation"], step=row["applied_step"], at=row["applied_at"]),
        finish=Finish(at=row["finished_at"], step=row["finished_step"], reason=row["finish_reason"] or ""),
        recovery=RunRecovery.for_config(json.loads(row["config"]), ceiling=desired.lr_scale),
    )
    st.recovery.restore_incidents(store.read_now(lambda c: sql.recent_incidents(c, st.id, st.recovery.incidents.maxlen or 100)))
    reports = _course(store.read_now(lambda c: sql.recent_reports(c, st.id, s.window_reports)), row["registered_at"])
    # The newest report's seq is the number of reports the run sent (``ReportIngest`` numbers them
    # from 1), however many older ones the database still holds.
    window.count = reports[-1]["seq"] - len(reports) if reports else 0
    st.applied.reported = reports[-1]["applied_generation"] if reports else 0  # what its newest report said applied
    # every report's values in one parse (the stored text is JSON with NaN/Infinity tokens)
    stored = pydantic_core.from_json("[" + ",".join(rep["vals"] for rep in reports) + "]", allow_inf_nan=True)
    names: set[str] = set()
    for i, values in enumerate(stored):
        if len(names) + len(values) > s.max_series_per_run and not names.issuperset(values):
            # A database written before the series limit (or under a higher one): keep the names
            # seen first, so that a restart holds no more than a running controller would.
            room, kept = s.max_series_per_run - len(names), {}
            for k, v in values.items():
                if k in names or room > 0:
                    room -= k not in names
                    kept[k] = v
            stored[i] = values = kept
        names.update(values)
    rank_from = max(len(reports) - s.rank_window_reports, 0)
    # the older reports in one pass; those whose per-rank vectors the window keeps one by one
    window.append_many(stored[:rank_from], [rep["step_last"] for rep in reports[:rank_from]],
                       [rep["received"] for rep in reports[:rank_from]])
    ranks: dict[str, Any] = {}
    for rep, values in zip(reports[rank_from:], stored[rank_from:]):
        ranks = sql.decode_ranks(rep, st.world_size, VECTORS)
        window.append_raw(values, ranks, rep["step_last"], rep["received"])
    if reports and reports[-1]["received"] >= row["registered_at"]:  # reported since its registration
        last = reports[-1]
        st.last_report = (last["step_first"], last["step_last"], last["time"], json.loads(last["vals"]), ranks)
    return st


def _course(reports: list[sqlite3.Row], registered_at: float) -> list[sqlite3.Row]:
    """The reports of the job's present course, as ingesting them left the window: from the
    first report since the run's registration on when that one went back to a step reported
    before (``runstate.went_back``: the window restarted there), else all of them."""
    for i, rep in enumerate(reports):
        if rep["received"] >= registered_at:
            return reports[i:] if i and went_back(None, reports[i - 1]["step_last"], rep["step_first"]) else reports
    return reports


#: The ``X-Trainguard-Role`` of a controller reading its runs back: it holds the database (it is
#: no standby), so an agent waits for it instead of moving on to another controller URL.
LOADING_ROLE = b"loading"
#: Seconds a request answered 503 while loading is told to wait (``Retry-After``).
LOADING_RETRY_AFTER_S = 2
#: Seconds between two attempts at loading after one failed (e.g. the database was away).
_LOAD_RETRY_S = 5.0


class _Stopped(Exception):
    """The app stopped while its runs were being read back."""


class StartupLoader:
    """Reads the runs back (``Controller.load``) and then starts the controller (its writer,
    ticker and webhook worker), in the app's lifespan.

    A database of at most ``wait_runs`` runs is read before the app answers anything (requests
    wait in the listen backlog, a fraction of a second: as any start-up); a larger one in a
    worker thread while the app answers, :class:`LoadingGate` saying how far it got. A failed
    attempt is logged and tried again every few seconds (``/healthz`` then answers 503 with the
    error, so that a supervisor that gives up on it restarts the process)."""

    def __init__(self, controller: Any, *, wait_runs: int, retry_s: float = _LOAD_RETRY_S) -> None:
        self.controller = controller
        self.wait_runs = wait_runs
        self.retry_s = retry_s
        self.ready = False
        self.loaded = 0
        self.total: int | None = None
        self.error: str | None = None
        """Why the last attempt failed (``None`` while none failed)."""
        self.started_at: float | None = None
        self.ready_after_s: float | None = None
        self.freeze_gc = False
        """Once loaded, move everything built so far out of the collector's passes (``gc.freeze``;
        ``trainguard serve`` sets it: its runs and windows live as long as the process)."""
        self._stopping = False
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle (the app's lifespan) ------------------------------------------------------------
    async def start(self) -> None:
        """Load now (small database) or start loading in the background (large one)."""
        self.started_at = time.monotonic()
        total = await asyncio.to_thread(self.controller.store.read_now, sql.count_runs)
        self.total = total
        if total <= self.wait_runs:
            await self._attempt()
            return
        log.warning("reading %d runs back from the database; answering 503 'loading' meanwhile", total)
        self._task = asyncio.create_task(self._load_until_done(), name="trainguard-startup-load")

    async def stop(self) -> None:
        """Stop loading (a read in flight ends after the run it is at)."""
        self._stopping = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # (stopping either way)

    async def _load_until_done(self) -> None:
        while not self._stopping:
            try:
                await self._attempt()
                log.warning("%d runs read back in %.1f s: serving", self.loaded, self.ready_after_s or 0.0)
                return
            except _Stopped:
                return
            except Exception as exc:  # noqa: BLE001 - the reason is shown, and the load tried again
                self.error = f"{type(exc).__name__}: {exc}"
                log.exception("reading the runs back from the database failed; trying again in %.0f s", self.retry_s)
                await asyncio.sleep(self.retry_s)

    async def _attempt(self) -> None:
        self.loaded = 0
        await asyncio.to_thread(self.controller.load, self._progress)
        if self._stopping:
            raise _Stopped()
        if self.freeze_gc:
            gc.collect()
            gc.freeze()
        await self.controller.start()
        self.ready = True
        self.error = None
        self.ready_after_s = time.monotonic() - (self.started_at or time.monotonic())

    def _progress(self, loaded: int, total: int) -> None:
        if self._stopping:
            raise _Stopped()
        self.loaded, self.total = loaded, total

    # -- what the gate answers ---------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """The body of ``/readyz`` while loading: what it does and how far it got."""
        total = "?" if self.total is None else str(self.total)
        text = f"loading: {self.loaded} of {total} runs read back from the database"
        if self.error is not None:
            text += f"; the last attempt failed ({self.error}), trying again"
        return {"status": text, "runs_loaded": self.loaded, "runs_total": self.total}


class LoadingGate:
    """ASGI middleware: every request passes once ``loader`` is ready. Until then ``/readyz``
    answers 503 with the progress, ``/healthz`` 200 (``{"status": "loading"}``: alive; 503 after
    a failed attempt), and each request that needs the runs (the API, the console's data) 503
    with ``Retry-After`` and the header ``X-Trainguard-Role: loading``; pages, assets, the API
    docs and ``/metrics`` pass."""

    _NEEDS_STATE = ("/v1/", "/ui/api/", "/ui/login", "/ui/logout")

    def __init__(self, app: Any, loader: StartupLoader) -> None:
        self.app = app
        self.loader = loader

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        loader = self.loader
        if loader.ready or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if path == "/healthz":
            failed = loader.error is not None
            await _answer(send, 503 if failed else 200, loader.status() if failed else {"status": "loading"})
        elif path == "/readyz":
            await _answer(send, 503, loader.status())
        elif path.startswith(self._NEEDS_STATE):
            status = loader.status()
            await _answer(send, 503, {"detail": f"the controller is starting ({status['status']}): try again shortly",
                                      "runs_loaded": status["runs_loaded"], "runs_total": status["runs_total"]})
        else:
            await self.app(scope, receive, send)


async def _answer(send: Any, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
               (b"x-trainguard-role", LOADING_ROLE)]
    if status == 503:
        headers.append((b"retry-after", str(LOADING_RETRY_AFTER_S).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})
