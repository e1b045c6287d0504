"""Alertmanager in: what an alert of a webhook (version 4) payload asks the controller to do.

An alert acts when it is firing and carries a ``trainguard_action`` label naming a command of
the registry that Alertmanager may give (:data:`ACTIONS`: ``CommandSpec.alertmanager``) and a run
label (``trainguard_run`` or ``run``). The command's body comes from the labels: a label
``trainguard_<field>`` for each field of its request (``trainguard_max_norm`` of ``grad_clip``,
``trainguard_layers`` of ``reset_optimizer`` as comma-separated prefixes, ``trainguard_factor`` of
``momentum``); a label that does not validate makes the alert's outcome ``error`` with the reason.
``lr_scale`` keeps its own spellings: ``trainguard_lr_scale`` (an absolute multiplier) or
``trainguard_lr_factor`` (times the run's current multiplier, 0.5 when absent). The controller
carries the command out through the same fold as its own rules, so a factor is clamped to
[``LR_SCALE_MIN``, ``LR_SCALE_MAX``] exactly as a rule's is.
"""

from __future__ import annotations

import hashlib
import json
import logging
import typing
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from trainguard.service import statements as sql
from trainguard.service.engine import command_params
from trainguard.service.errors import Conflict, Invalid, NotFound
from trainguard.protocol.commands import BY_NAME, REGISTRY, CommandSpec

__all__ = ["AlertCommand", "parse_alert", "act", "DEFAULT_LR_FACTOR", "SeenKeys", "SEEN_KEPT"]

DEFAULT_LR_FACTOR = 0.5
log = logging.getLogger("trainguard.controller")
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


async def _seen_again(refresh: Callable[[tuple[str, str], float], Awaitable[None]] | None, key: tuple[str, str],
                      now: float) -> None:
    """Record a repeat's sight (a failure is logged: the repeat was not acted on either way)."""
    if refresh is None:
        return
    try:
        await refresh(key, now)
    except Exception as e:  # noqa: BLE001 - the answer stays "duplicate"
        log.warning("could not record the repeat of Alertmanager alert %s: %s", key[0], e)


@dataclass(frozen=True, slots=True)
class AlertCommand:
    """One alert's command."""

    run: str
    command: str
    params: Any
    """The command's body (an instance of its ``request``)."""
    reason: str
    actor: str


#: The ``trainguard_action`` values an alert may carry to the controller.
ACTIONS: tuple[str, ...] = tuple(c.name for c in REGISTRY if c.alertmanager)
#: Label spellings kept from before the registry: (command, field) -> label.
_LABELS = {("lr_scale", "scale"): "trainguard_lr_scale", ("lr_scale", "factor"): "trainguard_lr_factor"}
#: Body values an alert without the label gets: (command, field) -> value (given when no field
#: of the body is labelled).
_DEFAULTS = {("lr_scale", "factor"): DEFAULT_LR_FACTOR}


def _label_value(annotation: Any, text: str) -> Any:
    """A label's text as the value of a body field of ``annotation``: comma-separated items for
    a list, the text itself for a text or a choice, else the JSON number or boolean it spells
    (left as text when it spells none, so that validation names it)."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (list, tuple):
        return [item.strip() for item in text.split(",") if item.strip()]
    if annotation is str or typing.get_origin(annotation) is typing.Literal or (str in args):
        return text
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, (int, float, bool)) else text


def _params(spec: CommandSpec, labels: dict[str, Any]) -> Any:
    """The command's body from the alert's labels; ``ValueError`` naming the labels when it does
    not validate."""
    body: dict[str, Any] = {}
    named = []
    for name, field in spec.request.model_fields.items():
        if name == "reason":
            continue
        label = _LABELS.get((spec.name, name), f"trainguard_{name}")
        named.append(label)
        if label in labels:
            body[name] = _label_value(field.annotation, str(labels[label]))
    if not body:
        body = {name: v for (cmd, name), v in _DEFAULTS.items() if cmd == spec.name}
    try:
        return command_params(spec, body)
    except ValueError as e:
        problems = str(e).removeprefix(f"{spec.name}: ")
        raise ValueError(f"{spec.name} from the labels {', '.join(named)}: {problems}") from None


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
    try:
        params = _params(BY_NAME[action], labels)
    except ValueError as e:
        return res | {"outcome": "error", "detail": str(e)}, None
    name = labels.get("alertname", "?")
    ann = alert.get("annotations") or {}
    reason = f"alertmanager {name}: {ann.get('summary') or ann.get('description') or action}"
    return res, AlertCommand(run=run, command=action, params=params, reason=reason[:2000], actor=f"alertmanager:{name}")


async def act(payload: dict[str, Any], seen: SeenKeys, command: Callable[..., Awaitable[tuple[int, bytes]]],
              clock: Callable[[], float], targets: Callable[[str], set[str] | None] = lambda run: None,
              refresh: Callable[[tuple[str, str], float], Awaitable[None]] | None = None) -> list[dict[str, Any]]:
    """Carry out each acting alert of ``payload`` with ``command`` (``Controller.command``) once:
    ``seen`` holds the (fingerprint, startsAt) pairs already acted on, and the same transaction
    that changes the run records the pair. A repeat (Alertmanager sends a firing alert again every
    ``repeat_interval``, for as long as it fires) is a duplicate, and ``refresh(key, now)`` records
    its sight, from which the pair's retention counts. An alert with an ``instance`` label acts only
    when ``targets(run)`` (the run's registered ``host:port`` targets, ``None``: unknown run) holds
    it. Returns one result per alert."""
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
            await _seen_again(refresh, key, clock())
            continue
        seen.add(key)
        now = clock()
        try:
            _, body = await command(
                cmd.run, cmd.command, params=cmd.params, reason=cmd.reason, actor=cmd.actor, source="alertmanager",
                extra=lambda c, key=key: _mark_seen(c, key, now),
            )
        except _AlreadyActed:
            results.append(res | {"outcome": "duplicate"})
            await _seen_again(refresh, key, now)
            continue
        except (NotFound, Invalid, Conflict) as e:  # (Conflict: e.g. a rollback without a good snapshot)
            seen.discard(key)
            results.append(res | {"outcome": "error", "detail": str(e)})
            continue
        except BaseException:
            seen.discard(key)
            raise
        results.append(res | {"outcome": "applied", "result": json.loads(body)})
    return results
