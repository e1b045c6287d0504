"""Alertmanager in: what an alert of a webhook (version 4) payload asks the controller to do.

An alert acts when it is firing and carries a ``trainguard_action`` label naming a command
(:data:`~trainguard.protocol.wire.COMMANDS`, or a diagnosis the agent runs: ``memory_trace``,
``verify``) and a run label (``trainguard_run`` or ``run``).
``lr_scale`` takes ``trainguard_lr_scale`` (an absolute multiplier) or ``trainguard_lr_factor``
(times the run's current multiplier, 0.5 when absent). The controller carries the command out
through the same action code as its own rules, so a factor is clamped to
[``LR_SCALE_MIN``, ``LR_SCALE_MAX``] exactly as a rule's is.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from trainguard.service import statements as sql
from trainguard.service.errors import Invalid, NotFound
from trainguard.protocol.wire import COMMANDS, DIAGNOSTIC_COMMANDS

__all__ = ["AlertCommand", "parse_alert", "act", "DEFAULT_LR_FACTOR", "SeenKeys", "SEEN_KEPT"]

DEFAULT_LR_FACTOR = 0.5
#: Alerts (fingerprint, startsAt) acted on that are remembered in memory; older ones are still
#: found in the database (the table the same transaction writes), so a repeat never acts twice.
SEEN_KEPT = 10_000


class SeenKeys:
    """The newest ``capacity`` (fingerprint, startsAt) pairs acted on: a bounded cache in front
    of the ``alertmanager_seen`` table, which is the truth."""

    def __init__(self, keys: list[tuple[str, str]] = (), capacity: int = SEEN_KEPT) -> None:  # type: ignore[assignment]
        self.capacity = capacity
        self._keys: OrderedDict[tuple[str, str], None] = OrderedDict()
        for key in keys:
            self.add(key)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key: tuple[str, str]) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def discard(self, key: tuple[str, str]) -> None:
        self._keys.pop(key, None)


class _AlreadyActed(Exception):
    """The database already holds the alert (the memory cache had let it go): nothing changes."""


def _mark_seen(c: Any, key: tuple[str, str], now: float) -> None:
    if not sql.mark_alertmanager_seen(c, *key, now):
        raise _AlreadyActed()


@dataclass(frozen=True, slots=True)
class AlertCommand:
    """One alert's command."""

    run: str
    command: str
    scale: float | None
    factor: float | None
    reason: str
    actor: str


#: The ``trainguard_action`` values an alert may carry to the controller.
ACTIONS: tuple[str, ...] = (*COMMANDS, *DIAGNOSTIC_COMMANDS)


def parse_alert(alert: dict[str, Any]) -> tuple[dict[str, Any], AlertCommand | None]:
    """The result entry of ``alert`` (fingerprint, startsAt, run, action; with an ``outcome`` when
    the alert does not act) and its command (``None`` when it does not act)."""
    labels = alert.get("labels") or {}
    fp = str(alert.get("fingerprint") or hashlib.sha256(json.dumps(labels, sort_keys=True).encode()).hexdigest()[:16])
    action = labels.get("trainguard_action")
    run = labels.get("trainguard_run") or labels.get("run")
    res: dict[str, Any] = {"fingerprint": fp, "startsAt": str(alert.get("startsAt", "")), "run": run, "action": action}
    if alert.get("status") != "firing" or not action:
        return res | {"outcome": "ignored", "detail": "not firing or no trainguard_action label"}, None
    if action not in ACTIONS or not run:
        return res | {"outcome": "error", "detail": f"unknown action {action!r} (actions are {', '.join(ACTIONS)}) or no run label"}, None
    scale = factor = None
    if action == "lr_scale":
        try:
            if "trainguard_lr_scale" in labels:
                scale = float(labels["trainguard_lr_scale"])
            else:
                factor = float(labels.get("trainguard_lr_factor", DEFAULT_LR_FACTOR))
        except ValueError:
            return res | {"outcome": "error", "detail": "trainguard_lr_scale / trainguard_lr_factor is not a number"}, None
    name = labels.get("alertname", "?")
    ann = alert.get("annotations") or {}
    reason = f"alertmanager {name}: {ann.get('summary') or ann.get('description') or action}"
    return res, AlertCommand(run=run, command=action, scale=scale, factor=factor, reason=reason[:2000], actor=f"alertmanager:{name}")


async def act(payload: dict[str, Any], seen: SeenKeys, command: Callable[..., Awaitable[tuple[int, bytes]]],
              clock: Callable[[], float], targets: Callable[[str], set[str] | None] = lambda run: None) -> list[dict[str, Any]]:
    """Carry out each acting alert of ``payload`` with ``command`` (``Controller.command``) once:
    ``seen`` holds the (fingerprint, startsAt) pairs already acted on, and the same transaction
    that changes the run records the pair. An alert with an ``instance`` label acts only when
    ``targets(run)`` (the run's registered ``host:port`` targets, ``None``: unknown run) holds it.
    Returns one result per alert."""
    results = []
    for alert in payload.get("alerts", []):
        res, cmd = parse_alert(alert)
        if cmd is None:
            results.append(res)
            continue
        instance = (alert.get("labels") or {}).get("instance")
        known = targets(cmd.run)
        if instance is not None and known is not None and instance not in known:
            # An alert about one target acts on that target's own run only (its run label comes
            # from discovery; this guards configurations that let a target set it).
            results.append(res | {"outcome": "error", "detail": f"instance {instance!r} is not a target of run {cmd.run!r}"})
            continue
        key = (res["fingerprint"], res["startsAt"])
        if key in seen:
            results.append(res | {"outcome": "duplicate"})
            continue
        seen.add(key)
        now = clock()
        try:
            _, body = await command(
                cmd.run, cmd.command, reason=cmd.reason, actor=cmd.actor, source="alertmanager", scale=cmd.scale,
                factor=cmd.factor, extra=lambda c, key=key: _mark_seen(c, key, now),
            )
        except _AlreadyActed:
            results.append(res | {"outcome": "duplicate"})
            continue
        except (NotFound, Invalid) as e:
            seen.discard(key)
            results.append(res | {"outcome": "error", "detail": str(e)})
            continue
        except BaseException:
            seen.discard(key)
            raise
        results.append(res | {"outcome": "applied", "result": json.loads(body)})
    return results
