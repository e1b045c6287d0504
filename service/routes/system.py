"""Health, the controller's own metrics, Prometheus service discovery, Alertmanager's webhook."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from trainguard.service.runstate import target_address, valid_host
from trainguard.service.deps import CommandDep, ControllerDep, ReadDep
from trainguard.service.schemas import AlertmanagerPayload

__all__ = ["router"]

router = APIRouter(tags=["system"])


#: Longest a readiness probe waits for its test write.
READY_WRITE_S = 1.0


@router.get("/readyz", summary="Readiness: 200 while a write commits (503 while writes fail or wait for a lock, or "
            "the disk is nearly full)",
            description="Commits an empty transaction and answers 200 when it commits within a second; 503 with the "
            "reason otherwise. After a write failed for want of room (a full disk), it writes and deletes a row of "
            "256 KiB instead, and answers 503 until that commits. A SQLite database's file system with less room "
            "than TRAINGUARD_MIN_FREE_BYTES answers 503 before any write fails (read with statvfs, writing "
            "nothing). /healthz is liveness only (the process and its database writer run).")
async def readyz(ctl: ControllerDep) -> Response:
    if not ctl.store.alive:
        return _status(503, "database writer stopped")
    short = await _short_of_room(ctl)
    if short is not None:
        return _status(503, short)
    probe = ctl.store.probe()
    probe.add_done_callback(lambda f: f.cancelled() or f.exception())  # an outcome after the answer is not an error
    try:
        await asyncio.wait_for(asyncio.shield(probe), READY_WRITE_S)
    except TimeoutError:
        return _status(503, "database writes are waiting for a lock held by another connection")
    except Exception as e:  # noqa: BLE001 - the reason is the answer
        return _status(503, f"database writes fail: {e}")
    return _status(200, "ok")


async def _short_of_room(ctl: ControllerDep) -> str | None:
    """Why the database's file system has too little room (less than
    ``TRAINGUARD_MIN_FREE_BYTES``), or ``None``: a nearly full disk turns readiness off before a
    write fails, without writing (an idle controller writes nothing that would find out)."""
    bound = ctl.settings.min_free_bytes
    if bound == 0:
        return None
    try:
        free = await asyncio.wait_for(asyncio.to_thread(ctl.store.free_bytes), READY_WRITE_S)
    except TimeoutError:
        return "the database's file system did not tell its free space within a second"
    except OSError as e:
        return f"the database's file system's free space cannot be read: {e}"
    if free is None or free >= bound:
        return None
    return (f"the database's file system has {free / 2**20:.1f} MiB free, less than TRAINGUARD_MIN_FREE_BYTES "
            f"({bound / 2**20:.1f} MiB): writes may fail at any moment; make room or give the database more")


def _status(code: int, status: str) -> Response:
    return Response(json.dumps({"status": status}).encode(), status_code=code, media_type="application/json")


@router.get("/healthz", summary="Liveness: 200 while the database writer runs (writes may still fail: see /readyz)")
async def healthz(ctl: ControllerDep) -> Response:
    ok = ctl.store.alive
    body = b'{"status":"ok"}' if ok else b'{"status":"database writer stopped"}'
    return Response(body, status_code=200 if ok else 503, media_type="application/json")


@router.get("/metrics", summary="The controller's Prometheus metrics")
async def metrics(ctl: ControllerDep) -> Response:
    return Response(generate_latest(ctl.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/sd/targets", summary="Prometheus http_sd targets: the /metrics of every rank of every live (not stopped, not finished) run",
            description="Each host:port once per run: one that several ranks registered is labelled with the lowest of them.")
async def sd_targets(ctl: ControllerDep, _: ReadDep) -> list[dict[str, Any]]:
    out = []
    for st in ctl.runs.values():
        if st.desired.stop or st.finish.at is not None:
            continue  # its ranks are gone: scraping them would only raise "target down" alerts
        listed: set[str] = set()
        for r in sorted(st.ranks, key=lambda r: r["rank"]):
            if not valid_host(r["host"]):
                continue  # stored before registration checked hosts: never handed to Prometheus
            address = target_address(r["host"], r["port"])
            if address.lower() in listed:
                continue  # one process there: listed once, as the lowest rank that registered it
            listed.add(address.lower())
            out.append({"targets": [address], "labels": {"job": st.job, "run": st.run, "rank": str(r["rank"])}})
    return out


@router.post("/v1/alertmanager", summary="Alertmanager webhook (v4): alerts with trainguard_action and run labels act", tags=["alertmanager"])
async def alertmanager(payload: AlertmanagerPayload, ctl: ControllerDep, principal: CommandDep) -> dict[str, Any]:
    return {"results": await ctl.alertmanager(payload.model_dump(), principal.actor)}
