"""The demo's view of the run through the controller: the audit log followed while the ranks
train (:func:`watch`, which also stands in for the paged human), and the alerts, actions and
incidents collected afterwards (:func:`collect`)."""

from __future__ import annotations

import time
from typing import Any

import httpx

from trainguard.demo.config import DemoConfig, say
from trainguard.demo.processes import Controller

__all__ = ["changes", "watch", "wait_acked", "collect"]


def changes(before: dict[str, Any], after: dict[str, Any]) -> str:
    keys = ("paused", "lr_scale", "checkpoint_seq", "stop", "rollback_seq")

    def fmt(v: Any) -> str:
        return format(v, ".4g") if isinstance(v, float) else str(v)
    out = [f"{k} {fmt(before.get(k))} -> {fmt(after.get(k))}" for k in keys if before.get(k) != after.get(k)]
    if after.get("rollback_seq", 0) != before.get("rollback_seq", 0):
        out.append(f"(roll back to the snapshot of step {after.get('rollback_step')} or older)")
    return ", ".join(out)


def watch(cfg: DemoConfig, ctl: Controller, run: str, procs: list[Any]) -> None:
    """Follow the run's audit log while the ranks train; resume a rule's pause as an operator."""
    last_event = 0
    desired: dict[str, Any] = {"paused": False, "lr_scale": 1.0, "checkpoint_seq": 0, "stop": False, "rollback_seq": 0}
    paused_since: float | None = None
    told_manual = False
    deadline = time.monotonic() + cfg.timeout_s
    with ctl.client() as http:
        while any(p.is_alive() for p in procs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the demo did not finish within {cfg.timeout_s:.0f} s")
            time.sleep(0.2)
            try:
                resp = http.get(f"/v1/runs/{run}/events", params={"after": last_event})
            except httpx.HTTPError:
                continue
            if resp.status_code != 200:
                continue
            for ev in resp.json():
                last_event = max(last_event, ev["id"])
                if ev["kind"] == "alert":
                    d = ev["data"]
                    say(cfg, f"  !! alert {d.get('rule')} ({d.get('severity')}) at step {d.get('step', '?')}: {ev['reason']}")
                elif ev["kind"] == "desired":
                    new = ev["data"]["desired"]
                    say(cfg, f"  >> generation {ev['generation']} by {ev['actor']}: {changes(desired, new)}")
                    desired = new
                    paused_since = time.monotonic() if new["paused"] else None
                elif ev["kind"] == "applied":
                    say(cfg, f"  ok generation {ev['generation']} applied on every rank at step {ev['data'].get('step')}")
                elif ev["kind"] == "incident":
                    inc = ev["data"]["incident"]
                    rungs = " > ".join(r["rung"] for r in inc["rungs"]) or "-"
                    say(cfg, f"  ~~ incident {inc['id']} (onset step {inc['onset_step']}, cause {inc.get('cause', 'unknown')}): "
                              f"{rungs} / {inc['outcome']}")
            if paused_since is not None and time.monotonic() - paused_since >= cfg.resume_after_s:
                if not ctl.operator_token:
                    if not told_manual:
                        say(cfg, f"  the run is paused; resume it with: trainguard resume {run} --url {ctl.url} --token <operator token>")
                        told_manual = True
                    continue
                say(cfg, "  the run is paused and a human was paged; standing in for them, the demo resumes it through the REST API")
                try:
                    http.post(f"/v1/runs/{run}/resume", json={"reason": "demo operator: inspected, resuming"},
                              headers={"Idempotency-Key": f"demo-resume-{desired.get('generation', 0)}"})
                    paused_since = None
                except httpx.HTTPError:
                    pass


def wait_acked(ctl: Controller, run: str, generation: int, timeout: float = 10.0) -> None:
    """Wait (bounded) until the controller recorded the leader's ack of ``generation``: the last
    ack is sent from the leader's client thread at close(), after its rank finished."""
    deadline = time.monotonic() + timeout
    with ctl.client() as http:
        while time.monotonic() < deadline:
            try:
                if http.get(f"/v1/runs/{run}").json().get("applied_generation", 0) >= generation:
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.05)


def collect(ctl: Controller, run: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """Alerts and actions of the run, each with its step, from the controller's audit log, and
    the run's incidents (oldest first)."""
    with ctl.client() as http:
        events = http.get(f"/v1/runs/{run}/events", params={"limit": 5000}).json()
        incidents = list(reversed(http.get(f"/v1/runs/{run}/incidents").json()["incidents"]))
        diagnoses = {a["id"]: a.get("diagnosis") or {}
                     for a in http.get("/v1/alerts", params={"run": run, "limit": 1000}).json()}
    applied: dict[int, int] = {}
    for ev in events:
        if ev["kind"] == "applied":
            applied.setdefault(ev["generation"], ev["data"].get("step"))
    alerts, actions = [], []
    before: dict[str, Any] = {"paused": False, "lr_scale": 1.0, "checkpoint_seq": 0, "stop": False, "rollback_seq": 0}
    for ev in events:
        if ev["kind"] == "alert":
            d = ev["data"]
            alerts.append({"rule": d.get("rule"), "severity": d.get("severity"), "step": d.get("step"),
                           "generation": ev["generation"], "summary": ev["reason"],
                           "diagnosis": diagnoses.get(d.get("alert_id"), {})})
        elif ev["kind"] == "desired":
            new = ev["data"]["desired"]
            gen = ev["generation"]
            # A generation superseded before the ranks applied it is covered by the next ack.
            step = applied.get(gen) or next((s for g, s in sorted(applied.items()) if g >= gen), None)
            actions.append({"generation": gen, "actor": ev["actor"], "change": changes(before, new),
                            "desired": new, "applied_step": step})
            before = new
    return alerts, actions, incidents
