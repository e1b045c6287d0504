"""What the controller holds in memory per run (:class:`RunState`), and small facts about
desired states."""

from __future__ import annotations

import asyncio
import ipaddress
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trainguard.service.engine import AlertBook
from trainguard.service.incidents import RunRecovery
from trainguard.service.rank_store import ranks_digest
from trainguard.service.window import RunWindow
from trainguard.protocol.commands import action_names  # the actions metric's labels (re-exported)
from trainguard.protocol.wire import DesiredState

__all__ = ["Applied", "Finish", "Publication", "RunState", "desired_state", "known_desired", "live", "action_names", "resent", "target_address", "went_back"]


@dataclass(slots=True, eq=False)
class Publication:
    """The newest committed desired state as the agents see it: the state, its JSON (what a poll
    and a report are answered with) and the event long-polls wait on, set and replaced at each
    publication."""

    desired: DesiredState
    json: bytes
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @classmethod
    def of(cls, desired: DesiredState) -> "Publication":
        return cls(desired, desired.model_dump_json().encode())

    def publish(self, desired: DesiredState) -> None:
        """Show a committed desired state to the agents (long-polls wake up)."""
        if desired.generation >= self.desired.generation:
            self.desired = desired
            self.json = desired.model_dump_json().encode()
            self.changed.set()
            self.changed = asyncio.Event()


@dataclass(slots=True)
class Applied:
    """What the run's agents applied of the desired states: the generation they acknowledged last,
    at which step and when (``POST /v1/runs/{run}/acks``), and the generation their last report
    said they had applied."""

    generation: int = 0
    step: int | None = None
    at: float | None = None
    reported: int = 0


@dataclass(frozen=True, slots=True)
class Finish:
    """The agent's word that the run ended (``POST /v1/runs/{run}/finish``): when (None while it
    has not), at which step and why. A re-registration clears it; a finished run is not expected
    to report."""

    at: float | None = None
    step: int | None = None
    reason: str = ""


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
    publication: Publication
    applied: Applied = field(default_factory=Applied)
    book: AlertBook = field(default_factory=AlertBook)
    firing: dict[str, dict[str, Any]] = field(default_factory=dict)
    last_report: tuple[int, int, float, dict[str, float], dict[str, np.ndarray]] | None = None
    """(step_first, step_last, time, values, per-rank vectors) of the last report stored since the
    run's registration: a report equal in all five is the agent sending it again (its answer was
    lost), stored once (:func:`resent`)."""
    finish: Finish = field(default_factory=Finish)
    #: The run's pre-flight result (``PreflightResult`` as a dict; kept in memory only).
    preflight: dict[str, Any] | None = None
    recovery: RunRecovery = field(default_factory=RunRecovery)
    """Snapshots, incidents and the LR ramp (in memory; see ``service/incidents.py``)."""
    #: The last memory trace's result (``MemoryReport`` as a dict; kept in memory, and as an event).
    memory_report: dict[str, Any] | None = None

    def publish(self, desired: DesiredState) -> None:
        """Show a committed desired state to the agents (long-polls wake up)."""
        self.publication.publish(desired)

    @property
    def status(self) -> str:
        if self.finish.at is not None:
            return "finished"
        if self.desired.stop:
            return "stopped"
        if self.desired.paused:
            return "paused"
        if any(a["kind"] == "absence" for a in self.firing.values()):
            return "silent"
        return "running" if self.window.count else "registered"

    def summary(self) -> dict[str, Any]:
        """The run as ``GET /v1/runs`` lists it."""
        st = self
        return {
            "run": st.run, "job": st.job, "status": st.status, "world_size": st.world_size,
            "registered_at": st.registered_at, "last_report_at": st.window.last_received if st.window.count else None,
            "last_step": st.window.last_step, "reports": st.window.count,
            "desired_generation": st.publication.desired.generation, "applied_generation": st.applied.generation,
            "firing": sorted(st.firing), "finished_at": st.finish.at, "finished_step": st.finish.step,
        }

    def detail(self) -> dict[str, Any]:
        """The run as ``GET /v1/runs/{run}`` shows it."""
        st = self
        last = st.window.latest_values()
        return self.summary() | {
            "ranks": st.ranks, "agent_version": st.agent_version, "config": st.config,
            "desired": st.publication.desired.model_dump(), "applied_step": st.applied.step, "applied_at": st.applied.at,
            "reported_generation": st.applied.reported, "finish_reason": st.finish.reason, "live_since": st.live_since,
            "last_values": last,
            # the noise scale's recommendation next to the batch size in use (None until reported)
            "batch_size": {"current": last.get("trainguard_global_batch_size"),
                           "recommended": last.get("trainguard_recommended_batch_size")},
            "firing_alerts": sorted(st.firing.values(), key=lambda a: a["id"]),
            "preflight": st.preflight,
            "memory_report": st.memory_report,
        }

    def incidents(self) -> dict[str, Any]:
        """The run's incidents, newest first (onset, rungs, outcome), and the snapshots the
        controller holds for it (``GET /v1/runs/{run}/incidents``, the console's run page)."""
        rec = self.recovery
        return {"incidents": [i.as_dict() for i in reversed(rec.incidents)],
                "snapshots": [{"step": s.step, "good": s.good(rec.policy.snapshot_confirm_reports)} for s in rec.snapshots]}

    def awaiting_human(self) -> bool:
        """Whether the run is paused by an escalated incident and waits for a person: its newest
        escalated incident's last rung set the desired state in force, and that state pauses the
        run (an operator's resume, stop or other command since replaces it)."""
        d = self.desired
        if not d.paused or d.stop or self.finish.at is not None:
            return False
        escalated = next((i for i in reversed(self.recovery.incidents) if i.outcome == "escalated"), None)
        return escalated is not None and bool(escalated.rungs) and escalated.rungs[-1]["generation"] == d.generation

    def firing_absence(self) -> list[str]:
        return [name for name, a in self.firing.items() if a["kind"] == "absence"]

    def forget_alerts(self, names: list[str]) -> None:
        """Drop alerts resolved from outside the rules (committed) from the firing set."""
        for name in names:
            self.firing.pop(name, None)
            self.book.resolve(name)


def resent(last: tuple[int, int, float, dict[str, float], dict[str, np.ndarray]] | None, step_first: int,
           step_last: int, time: float, values: dict[str, float], ranks: dict[str, np.ndarray]) -> bool:
    """Whether a report is ``last`` sent again: the same step range, send time, values and
    per-rank vectors (NaN equal to NaN). An agent sends one report per step range; the values
    and vectors are compared only when the rest matches."""
    if last is None or last[:3] != (step_first, step_last, time) or len(last[3]) != len(values):
        return False
    prev, prev_ranks = last[3], last[4]
    if not all(k in prev and (prev[k] == v or (prev[k] != prev[k] and v != v)) for k, v in values.items()):
        return False
    if prev_ranks.keys() != ranks.keys():
        return False
    digest = getattr(prev_ranks, "digest", b"")  # vectors read back from storage: compared by their digest
    if digest:
        return digest == ranks_digest(ranks)
    return all(np.array_equal(prev_ranks[k], v, equal_nan=True) for k, v in ranks.items())


def went_back(last: tuple[Any, ...] | None, last_step: int | None, step_first: int) -> bool:
    """Whether a report is the first since the run (re-)registered (``last``, the last report
    since then, is None) and of a step it reported before (``last_step``, the window's newest):
    its restarted job resumed from an earlier checkpoint."""
    return last is None and last_step is not None and step_first <= last_step


def known_desired(data: dict[str, Any]) -> DesiredState:
    """A desired state stored as a JSON object: fields a newer registry added take their defaults,
    fields it no longer has are dropped (``ValueError`` for one that no longer validates)."""
    return DesiredState.model_validate({k: v for k, v in data.items() if k in DesiredState.model_fields})


def desired_state(data: dict[str, Any] | None) -> DesiredState | None:
    """:func:`known_desired`, or None for None or one that no longer validates."""
    if data is None:
        return None
    try:
        return known_desired(data)
    except ValueError:
        return None


def live(d: DesiredState) -> bool:
    """Whether a run in desired state ``d`` is expected to report."""
    return not (d.paused or d.stop)


_HOST_NAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,62})(?:\.[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,62}))*\.?")


def valid_host(host: str) -> bool:
    """Whether ``host`` is a host name (dot-separated labels of letters, digits, ``-`` and ``_``;
    at most 253 characters) or an IP address (IPv6 bare or in brackets): what may become a
    Prometheus target. Anything with ``/``, ``?``, ``#``, ``@``, spaces or control characters is not."""
    if not host or len(host) > 253:
        return False
    if _HOST_NAME.fullmatch(host):
        return True
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ipaddress.ip_address(bare)
    except ValueError:
        return False
    return ":" in bare or bare == host


def target_address(host: str, port: int) -> str:
    """``host:port`` of a rank's /metrics as service discovery gives it to Prometheus (IPv6 in brackets)."""
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"{host}:{port}"
