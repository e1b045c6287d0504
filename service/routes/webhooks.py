"""Webhook subscriptions and their delivery records."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import APIRouter, Path, Query, Response

from trainguard.service.deps import ControllerDep, WebhooksDep
from trainguard.service.schemas import Webhook, WebhookCreate, WebhookCreated
from trainguard.service.webhooks import without_password
from trainguard.protocol.wire import MAX_INT

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["webhooks"])
WebhookId = Annotated[int, Path(ge=1, le=MAX_INT)]


def _out(row: dict) -> dict:
    """A stored webhook as listed: its URL's password shown as ``***``, its secret not at all."""
    return ({k: row[k] for k in ("id", "format", "min_severity", "created_at")}
            | {"url": without_password(row["url"]), "send_resolved": bool(row["send_resolved"])})


@router.post("/webhooks", status_code=201, response_model=WebhookCreated, summary="Subscribe a URL to alert notifications")
async def create(body: WebhookCreate, ctl: ControllerDep, _: WebhooksDep) -> WebhookCreated:
    secret = body.secret or secrets.token_urlsafe(32)
    wid, now = await ctl.records.add_webhook(url=body.url, format=body.format, secret=secret, min_severity=body.min_severity,
                                     send_resolved=body.send_resolved)
    return WebhookCreated(id=wid, url=body.url, format=body.format, min_severity=body.min_severity,
                          send_resolved=body.send_resolved, created_at=now, secret=secret)


@router.get("/webhooks", response_model=list[Webhook], summary="Webhooks (secrets and URL passwords are not shown)")
async def list_webhooks(ctl: ControllerDep, _: WebhooksDep) -> list[dict]:
    return [_out(r) for r in await ctl.records.webhooks()]


@router.delete("/webhooks/{webhook_id}", status_code=204, summary="Delete a webhook (pending messages are cancelled)")
async def delete(webhook_id: WebhookId, ctl: ControllerDep, _: WebhooksDep) -> Response:
    await ctl.records.delete_webhook(webhook_id)
    return Response(status_code=204)


@router.get("/webhooks/{webhook_id}/deliveries", summary="Delivery attempts, newest first")
async def deliveries(webhook_id: WebhookId, ctl: ControllerDep, _: WebhooksDep, limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> list[dict]:
    return await ctl.records.deliveries(webhook_id, limit)
