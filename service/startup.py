"""Start-up: the controller's state read back from the database (rules, runs and their windows).

(Formerly ``service/recovery.py``, a name that misled: recovery from incidents is ``service/incidents.py``.)"""

from __future__ import annotations

import json
import math
import sqlite3
from pathlib import Path
from typing import Any, Callable

from trainguard.service import statements as sql
from trainguard.service.config import Settings
from trainguard.service.incidents import RunRecovery
from trainguard.service.rules import RuleSet
from trainguard.service.runstate import RunState
from trainguard.service.store import Store
from trainguard.service.window import VECTORS, RunWindow
from trainguard.protocol.wire import DesiredState

__all__ = ["load_rules_state", "load_run", "stored_desired"]


def load_rules_state(store: Store, settings: Settings, clock: Callable[[], float],
                     validate: Callable[..., RuleSet]) -> tuple[RuleSet, dict[str, Any]] | None:
    """The active rules and their metadata: the ``--rules`` file (recorded as a new version when
    it changed), else the rules last stored with ``PUT /v1/rules``; ``None``: the defaults."""
    rules_row = store.read_now(sql.latest_rules)
    path: Path | None = settings.rules
    if path is not None:
        text = path.read_text(encoding="utf-8")
        rules = validate(text)
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
    data = json.loads(text)
    return DesiredState.model_validate({k: v for k, v in data.items() if k in DesiredState.model_fields})


def load_run(store: Store, settings: Settings, row: sqlite3.Row) -> RunState:
    """A run as stored, with its rule window refilled from its recent reports."""
    s = settings
    desired = stored_desired(row)
    window = RunWindow(capacity=s.window_reports, rank_capacity=s.rank_window_reports,
                       world_size=row["world_size"], created=row["registered_at"])
    st = RunState(
        id=row["id"], run=row["run"], job=row["job"], world_size=row["world_size"], ranks=json.loads(row["ranks"]),
        agent_version=row["agent_version"], config=json.loads(row["config"]), registered_at=row["registered_at"],
        live_since=max(row["registered_at"], row["resumed_at"] or -math.inf), window=window, desired=desired,
        published=desired, published_json=desired.model_dump_json().encode(),
        applied_generation=row["applied_generation"], applied_step=row["applied_step"], applied_at=row["applied_at"],
        finished_at=row["finished_at"], finished_step=row["finished_step"], finish_reason=row["finish_reason"] or "",
        recovery=RunRecovery.for_config(json.loads(row["config"]), ceiling=desired.lr_scale),
    )
    st.recovery.restore_incidents(store.read_now(lambda c: sql.recent_incidents(c, st.id, st.recovery.incidents.maxlen or 100)))
    reports = store.read_now(lambda c: sql.recent_reports(c, st.id, s.window_reports))
    window.count = max((row["last_seq"] or 0) - len(reports), 0)
    rank_from = len(reports) - s.rank_window_reports
    for i, rep in enumerate(reports):
        ranks = sql.decode_ranks(rep, st.world_size, VECTORS) if i >= rank_from else {}
        values = json.loads(rep["vals"])
        if len(window.columns) + len(values) > s.max_series_per_run:
            # A database written before the series limit (or under a higher one): keep the names
            # seen first, so that a restart holds no more than a running controller would.
            room, kept = s.max_series_per_run - len(window.columns), {}
            for k, v in values.items():
                if k in window.columns or room > 0:
                    room -= k not in window.columns
                    kept[k] = v
            values = kept
        window.append_raw(values, ranks, rep["step_last"], rep["received"])
    if reports and reports[-1]["received"] >= row["registered_at"]:  # reported since its registration
        last = reports[-1]
        st.last_report = (last["step_first"], last["step_last"], last["time"], json.loads(last["vals"]), ranks)
    if row["last_report_at"] is not None:
        window.touch(row["last_report_at"])
    return st
