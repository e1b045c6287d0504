"""Webhooks out: payloads, signatures, and the outbox-driven delivery worker.

Alert notifications are written to the ``outbox`` table in the same transaction as the alert, one
row per subscribed webhook, with the rendered body; so are incidents (:func:`render_incident`),
whenever one opens, takes a rung of the escalation ladder or closes. :class:`WebhookDeliverer` sends due rows,
records every attempt in ``deliveries``, and retries with exponential backoff on 5xx, 408, 429,
timeouts and connection errors — never on other 4xx. A row stays ``pending`` until an attempt's
outcome is committed, so a controller killed mid-delivery sends it again after a restart
(at-least-once: receivers dedupe on ``X-Trainguard-Delivery``).

Signature: ``X-Trainguard-Signature: sha256=HEX`` where HEX is HMAC-SHA256 with the webhook's
secret over ``f"{timestamp}.".encode() + body`` and ``timestamp`` is the integer Unix time sent in
``X-Trainguard-Timestamp``. Receivers should reject timestamps far from their clock.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
import urllib.parse
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Literal

import httpx

from trainguard.service import statements as sql
from trainguard.service.metrics import ControllerMetrics
from trainguard.service.store import Store
from trainguard.service.webhook_destinations import Destination, checked_destination

__all__ = ["SEVERITY_RANK", "WebhookFormat", "fingerprint", "render", "sign", "verify", "WebhookDeliverer", "redact_url", "without_password",
           "INCIDENT_SEVERITY", "IncidentUpdate", "incident_update", "incident_wanted", "render_incident"]

log = logging.getLogger("trainguard.webhooks")
SEVERITY_RANK = {"info": 0, "warning": 1, "critical": 2}
WebhookFormat = Literal["alertmanager", "slack"]
_ZERO_TIME = "0001-01-01T00:00:00Z"
_RETRY_4XX = {408, 429}


def fingerprint(run: str, rule: str, starts_at: float) -> str:
    """Stable id of one alert (16 hex digits, like Alertmanager's)."""
    return hashlib.sha256(f"{run}\x00{rule}\x00{starts_at!r}".encode()).hexdigest()[:16]


def rfc3339(t: float | None) -> str:
    if t is None:
        return _ZERO_TIME
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _alertmanager(alert: dict[str, Any], external_url: str) -> dict[str, Any]:
    status = alert["state"]
    diag = alert["diagnosis"]
    labels = {
        "alertname": alert["rule"], "job": alert["job"], "run": alert["run"],
        "severity": alert["severity"], "trainguard_rule": alert["rule"],
    }
    annotations = {
        "summary": alert["summary"],
        "description": diag.get("symptom", ""),
        "likely_causes": "; ".join(diag.get("likely_causes", [])),
        "suggested_actions": "; ".join(diag.get("suggested_actions", [])),
        "values": json.dumps(alert["values"], separators=(",", ":")),
        "actions": ", ".join(a["type"] for a in alert["actions"]),
    }
    base = external_url.rstrip("/")
    am_alert = {
        "status": status, "labels": labels, "annotations": annotations,
        "startsAt": rfc3339(alert["starts_at"]), "endsAt": rfc3339(alert["ends_at"] if status == "resolved" else None),
        "generatorURL": f"{base}/v1/runs/{alert['run']}" if base else "", "fingerprint": alert["fingerprint"],
    }
    group = {"alertname": alert["rule"], "run": alert["run"]}
    return {
        "version": "4", "groupKey": f"{{}}:{{alertname=\"{alert['rule']}\", run=\"{alert['run']}\"}}",
        "truncatedAlerts": 0, "status": status, "receiver": "trainguard",
        "groupLabels": group, "commonLabels": labels, "commonAnnotations": annotations,
        "externalURL": base, "alerts": [am_alert],
    }


def _slack(alert: dict[str, Any]) -> dict[str, Any]:
    diag = alert["diagnosis"]
    icon = {"critical": ":rotating_light:", "warning": ":warning:", "info": ":information_source:"}[alert["severity"]]
    if alert["state"] == "resolved":
        return {"text": f":white_check_mark: RESOLVED [{alert['severity']}] {alert['rule']} on run {alert['run']} (job {alert['job']})"}
    lines = [
        f"{icon} [{alert['severity']}] {alert['rule']} on run {alert['run']} (job {alert['job']})",
        alert["summary"],
        f"Likely causes: {'; '.join(diag.get('likely_causes', []))}",
        f"Suggested: {'; '.join(diag.get('suggested_actions', []))}",
    ]
    if alert["actions"]:
        lines.append("Actions taken: " + ", ".join(a["type"] for a in alert["actions"]))
    return {"text": "\n".join(lines)}


def render(format: str, alert: dict[str, Any], *, external_url: str = "") -> bytes:
    """The body sent to a webhook of ``format`` for ``alert`` (a row of the alerts table)."""
    payload = _alertmanager(alert, external_url) if format == "alertmanager" else _slack(alert)
    # Alert values may hold NaN/Inf: as strings, so that every JSON parser reads the body.
    return json.dumps(_jsonable(payload), separators=(",", ":")).encode()


#: The severity of an incident's message, by its outcome. While it is open the controller is acting
#: on the run by itself (a warning); escalated, the run is paused and waits for a human (critical).
#: A recovered incident is sent like a resolved alert: to the webhooks that got its opening and
#: want resolved messages (``send_resolved``).
INCIDENT_SEVERITY = {"open": "warning", "recovered": "warning", "escalated": "critical"}


@dataclass(frozen=True, slots=True)
class IncidentUpdate:
    """What one transaction changed in an incident."""

    update: str
    """``opened``, ``rung`` (a rung taken while open), ``recovered``, ``escalated`` or ``quarantined``
    (a data incident named its skipped batches' samples: ``service/data_quarantine.py``)."""
    opened: bool
    rungs: tuple[str, ...]
    """The rungs taken in this transaction, in order."""
    closed: str | None
    """The outcome the incident closed with in this transaction, else ``None``."""


def incident_update(before: dict[str, Any] | None, after: dict[str, Any]) -> IncidentUpdate:
    """The change from ``before`` (``None``: the incident is new) to ``after`` (incident dicts)."""
    taken = len(before["rungs"]) if before is not None else 0
    rungs = tuple(r["rung"] for r in after["rungs"][taken:])
    was_open = before is None or before["outcome"] == "open"
    closed = after["outcome"] if after["outcome"] != "open" and was_open else None
    update = closed or ("opened" if before is None else "rung")
    return IncidentUpdate(update, before is None, rungs, closed)


def incident_wanted(hook: dict[str, Any], incident: dict[str, Any]) -> bool:
    """Whether webhook ``hook`` (a row) gets a message about ``incident`` in its present state."""
    if SEVERITY_RANK[INCIDENT_SEVERITY[incident["outcome"]]] < SEVERITY_RANK[hook["min_severity"]]:
        return False
    return incident["outcome"] != "recovered" or bool(hook["send_resolved"])


def _incident_text(incident: dict[str, Any], run: str, job: str) -> tuple[str, list[str]]:
    """A one-line summary of an incident and one line per rung."""
    outcome = {"open": "open", "recovered": "recovered without a human",
               "escalated": "escalated to a human (the run is paused)"}[incident["outcome"]]
    head = (f"incident {incident['id']} on run {run} (job {job}): {outcome}; onset at step {incident['onset_step']} "
            f"({incident['trigger']})")
    if incident["closed_step"] is not None:
        head += f", closed at step {incident['closed_step']}"
    verdict = incident.get("verdict") or {}
    head += f"; cause {incident.get('cause', 'unknown')}: {verdict.get('summary', '')}"
    if verdict.get("hosts"):
        head += " (" + ", ".join(f"rank {r} on {h}" for r, h in zip(verdict.get("ranks", []), verdict["hosts"])) + ")"
    rungs = [f"step {r['step']}: {r['rung']} by {r['actor']}: {r['reason']}" for r in incident["rungs"]]
    return head, rungs


def render_incident(format: str, incident: dict[str, Any], *, run: str, job: str, update: str,
                    external_url: str = "") -> bytes:
    """The body sent to a webhook of ``format`` about ``incident`` (``Incident.as_dict()``).

    ``alertmanager`` format: an Alertmanager (version 4) message with one alert (``alertname``
    ``incident``; labels ``job``, ``run``, ``severity``, ``incident`` (its id); firing while open
    or escalated, resolved once recovered), and beside it ``kind`` (``"incident"``), ``update``
    (what this message reports: ``opened``, ``rung``, ``recovered``, ``escalated``, ``quarantined``:
    a data incident named the samples its skipped batches held), ``run``,
    ``job``, ``incident`` (onset, rungs, outcome, and the ``cause`` with its ``verdict``: as ``GET
    /v1/runs/{run}/incidents`` lists it), ``cause``, ``hosts`` (a hardware fault's suspect hosts, so
    an orchestrator can leave them out of the restart; else empty) and ``link`` (the run's page in
    the console; a path when no external URL is configured). The alert's labels add ``cause``, its
    annotations ``evidence`` (one line per piece of evidence) and ``hosts``.
    ``slack`` format: ``{"text": ...}`` with the summary, each rung and the link."""
    base = external_url.rstrip("/")
    link = f"{base}/ui/runs/{run}"
    head, rungs = _incident_text(incident, run, job)
    if format == "slack":
        icon = {"open": ":hammer_and_wrench:", "recovered": ":white_check_mark:",
                "escalated": ":rotating_light:"}[incident["outcome"]]
        payload: dict[str, Any] = {"text": "\n".join([f"{icon} {head}", *(f"• {r}" for r in rungs), link])}
    else:
        severity = INCIDENT_SEVERITY[incident["outcome"]]
        status = "resolved" if incident["outcome"] == "recovered" else "firing"
        verdict = incident.get("verdict") or {}
        cause = incident.get("cause", "unknown")
        labels = {"alertname": "incident", "job": job, "run": run, "severity": severity, "incident": str(incident["id"]),
                  "cause": cause}
        evidence = [f"{e['points_to']}: {e['signal']}: {e['detail']}" for e in verdict.get("evidence", [])]
        annotations = {"summary": head, "description": "\n".join(rungs), "update": update,
                       "evidence": "\n".join(evidence), "hosts": ",".join(verdict.get("hosts", []))}
        am_alert = {
            "status": status, "labels": labels, "annotations": annotations,
            "startsAt": rfc3339(incident["onset_time"]),
            "endsAt": rfc3339(incident["closed_time"] if status == "resolved" else None),
            "generatorURL": f"{base}/v1/runs/{run}/incidents" if base else "",
            "fingerprint": fingerprint(run, f"incident {incident['id']}", incident["onset_time"]),
        }
        group = {"alertname": "incident", "run": run}
        payload = {
            "version": "4", "groupKey": f"{{}}:{{alertname=\"incident\", run=\"{run}\"}}", "truncatedAlerts": 0,
            "status": status, "receiver": "trainguard", "groupLabels": group, "commonLabels": labels,
            "commonAnnotations": annotations, "externalURL": base, "alerts": [am_alert],
            "kind": "incident", "update": update, "run": run, "job": job, "incident": incident, "link": link,
            "cause": cause, "hosts": list(verdict.get("hosts", [])),
        }
    return json.dumps(_jsonable(payload), separators=(",", ":")).encode()


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


def sign(secret: str, timestamp: int, body: bytes) -> str:
    return "sha256=" + hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()


def verify(secret: str, timestamp: int, body: bytes, signature: str) -> bool:
    """Check a signature in constant time (what a receiver does)."""
    return hmac.compare_digest(sign(secret, timestamp, body), signature)


class WebhookDeliverer:
    """Sends due outbox rows; one instance per controller."""

    def __init__(
        self, store: Store, metrics: ControllerMetrics, *, clock: Callable[[], float], timeout_s: float,
        max_attempts: int, backoff_s: float, backoff_max_s: float, transport: httpx.AsyncBaseTransport | None = None,
        concurrency: int = 8,
    ) -> None:
        self._store = store
        self._metrics = metrics
        self._clock = clock
        self._timeout = timeout_s
        self._max_attempts = max_attempts
        self._backoff = backoff_s
        self._backoff_max = backoff_max_s
        self._transport = transport
        self._wake = asyncio.Event()
        self._sem = asyncio.Semaphore(concurrency)
        # Counted before the controller serves anything: a count taken once the loop runs would
        # also hold rows committed meanwhile, which their wake() counts again.
        self.pending = store.read_now(sql.pending_outbox_count)
        """Rows waiting for delivery (for /metrics): counted again whenever the worker goes idle,
        and kept up to date in memory in between."""

    def wake(self, new_rows: int = 0) -> None:
        self.pending += new_rows
        self._wake.set()

    def _delay(self, attempt: int) -> float:
        return min(self._backoff * 2 ** (attempt - 1), self._backoff_max)

    async def run(self) -> None:
        """Deliver until cancelled."""
        async with httpx.AsyncClient(transport=self._transport, timeout=self._timeout, follow_redirects=False) as client:
            while True:
                # Cleared before the reads, never after them: rows committed while a read runs in
                # its thread call wake() before that read's (older) answer arrives, and a clear()
                # after it would lose that wake and leave the rows waiting up to a minute.
                self._wake.clear()
                now = self._clock()
                due = await self._store.read(lambda c: sql.due_outbox(c, now, 64))
                if due:
                    results = await asyncio.gather(*(self._deliver(client, row) for row in due), return_exceptions=True)
                    errors = [r for r in results if isinstance(r, Exception)]
                    for e in errors:  # one bad row must not end delivery for every webhook
                        log.error("webhook delivery failed unexpectedly", exc_info=e)
                    if errors:
                        await asyncio.sleep(self._backoff)  # such a row stays due: do not spin on it
                    continue
                nxt, count = await self._store.read(_idle)
                if not self._wake.is_set():  # else rows woke it that the count may miss: counted next turn
                    self.pending = count
                wait = 60.0 if nxt is None else min(60.0, max(0.0, nxt - self._clock()))
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=wait)
                except TimeoutError:
                    pass

    async def _deliver(self, client: httpx.AsyncClient, row: dict[str, Any]) -> None:
        async with self._sem:
            attempt = row["attempts"] + 1
            ts = int(self._clock())
            body: bytes = row["body"]
            headers = {
                "Content-Type": "application/json",
                "User-Agent": "trainguard-controller",
                "X-Trainguard-Timestamp": str(ts),
                "X-Trainguard-Signature": sign(row["secret"], ts, body),
                "X-Trainguard-Delivery": str(row["id"]),
            }
            t0 = time.perf_counter()
            # (an injected transport decides itself where a request goes)
            to = await checked_destination(row["url"]) if self._transport is None else Destination(url=row["url"])
            if to.refused is not None:
                status, error = None, f"destination refused (not retried): {to.refused}"
            elif to.unresolved is not None:
                status, error = None, f"ConnectError: {to.unresolved}"
            else:
                status, error = await _post(client, to, body, headers)
            duration = time.perf_counter() - t0
            outcome, error = _outcome(status, error, attempt < self._max_attempts)
            if outcome != "delivered":
                reason = "timeout" if error.startswith("timeout") else ("5xx" if status and status >= 500 else ("4xx" if status else "error"))
                self._metrics.failures.labels(reason).inc()
                # The URL's path and query are secrets for some receivers (a Slack incoming webhook's
                # path is its credential): logs name the webhook by id and host only.
                shown = redact_url(row["url"])
                log.warning("webhook %s (%s) delivery %s attempt %d: %s", row["webhook_id"], shown, row["id"], attempt,
                            error.replace(row["url"], shown).replace(to.url or row["url"], shown))
            self._metrics.deliveries.labels(outcome).inc()
            now = self._clock()
            next_at = now + self._delay(attempt) if outcome == "retry" else None
            await self._store.submit(lambda c: sql.record_delivery(
                c, outbox_id=row["id"], webhook_id=row["webhook_id"], attempt=attempt, now=now, status_code=status,
                error=error, duration_s=duration, outcome=outcome, next_attempt_at=next_at,
            ))
            if outcome != "retry":
                self.pending = max(0, self.pending - 1)


async def _post(client: httpx.AsyncClient, to: Destination, body: bytes, headers: dict[str, str]) -> tuple[int | None, str | None]:
    """One delivery attempt to the address ``to`` names: (the HTTP status or None, the error or None)."""
    try:
        resp = await client.post(to.url, content=body, headers=headers | to.headers, extensions=to.extensions)
        return resp.status_code, None
    except httpx.TimeoutException as e:
        return None, f"timeout: {type(e).__name__}"
    except httpx.HTTPError as e:
        return None, f"{type(e).__name__}: {e}"
    except httpx.InvalidURL as e:
        # Not an HTTPError: uncaught it would end the delivery task for every webhook.
        # The URL will never work, so it is not retried.
        return None, f"invalid URL (not retried): {e}"


def _outcome(status: int | None, error: str | None, retries_left: bool) -> tuple[str, str | None]:
    """An attempt's outcome (``delivered``, ``retry`` or ``failed``) and its error text: a 2xx
    is delivered; a 4xx other than ``_RETRY_4XX``, an invalid URL and a refused destination
    (:mod:`service.webhook_destinations`) fail at once; anything else is retried while attempts are left."""
    if status is not None and 200 <= status < 300:
        return "delivered", error
    if status is not None and 400 <= status < 500 and status not in _RETRY_4XX:
        return "failed", f"HTTP {status} (not retried)"
    if error is not None and error.startswith(("invalid URL", "destination refused")):
        return "failed", error
    return ("retry" if retries_left else "failed"), error or f"HTTP {status}"


def _idle(conn: Any) -> tuple[float | None, int]:
    """When the next pending row is due, and how many are pending (one read: one snapshot)."""
    return sql.next_outbox_time(conn), sql.pending_outbox_count(conn)


def without_password(url: str) -> str:
    """``url`` with the password of its user info, if any, shown as ``***`` (what a listing shows:
    the URL stays recognisable, the password is never read back)."""
    parts = urllib.parse.urlsplit(url)
    userinfo, at, host = parts.netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{userinfo.split(':', 1)[0]}:***@{host}"))


def redact_url(url: str) -> str:
    """``url`` without what may be a credential: user info, path and query (``https://host/…``)."""
    try:
        u = httpx.URL(url)
        port = f":{u.port}" if u.port else ""
        return f"{u.scheme}://{u.host}{port}/…"
    except Exception:  # noqa: BLE001 - an unparsable URL is shown as nothing at all
        return "<invalid URL>"
