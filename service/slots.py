"""Requests held open at once, bounded per holder and in all: the event streams
(``GET /v1/events/stream``) and the desired state's long-polls (``GET /v1/runs/{run}/desired``).

A request past a bound is refused (:class:`~service.errors.TooMany`, answered 429) with a message
naming the bound; a request never ends another one to make room.

The long-polls' bounds (:func:`long_poll_slots`) were measured on real jobs (gloo, 2 and 4 ranks,
``trainer_agent``): only the leader rank polls, one request at a time, whatever the world size, so a
run of 32,768 ranks holds one; a leader killed mid-poll leaves its request waiting until the wait
ends (``longpoll_max_s``) or the run registers again, so a restarted job holds two for a moment.
"""

from __future__ import annotations

from typing import Callable, Hashable

from trainguard.service.errors import TooMany

__all__ = ["Slots", "release_once", "long_poll_slots", "POLLS_PER_RUN", "POLLS_PER_OPERATOR_TOKEN", "CONNECTIONS_KEPT_FREE"]

#: Long-polls of one run with one token: its leader's, and those a restarted leader left waiting.
POLLS_PER_RUN = 8
#: Long-polls of one operator (``read``) token, all runs together (a dashboard or a script).
POLLS_PER_OPERATOR_TOKEN = 16
#: Connections the long-polls leave to reports, registrations and operators (of ``max_connections``).
CONNECTIONS_KEPT_FREE = 256


class Slots:
    """At most ``per_key`` requests of one key (a token, or a token and a run) and ``total`` in
    all; ``held`` names them in the messages (``"event streams"``)."""

    def __init__(self, per_key: int, total: int, held: str, total_setting: str = "") -> None:
        if min(per_key, total) < 1:
            raise ValueError(f"the limits of {held} must be >= 1 (per key {per_key}, in all {total})")
        self.per_key, self.total, self.held, self._total_setting = per_key, total, held, total_setting
        self._by_key: dict[Hashable, int] = {}
        self.taken = 0
        """Slots taken now."""

    def take(self, key: Hashable, *, holder: str = "this token", per_key: int | None = None,
             remedy: str = "close one first") -> Callable[[], None]:
        """A slot for ``key`` (:class:`TooMany` beyond the limits); answers its release (idempotent).
        ``holder`` names ``key`` in the message; ``per_key`` overrides the limit of one key."""
        limit = self.per_key if per_key is None else per_key
        if self._by_key.get(key, 0) >= limit:
            raise TooMany(f"{holder} has {limit} {self.held} open, its limit: {remedy}")
        if self.taken >= self.total:
            raise TooMany(f"the controller serves {self.total} {self.held}{self._total_setting}, its limit: try again later")
        self._by_key[key] = self._by_key.get(key, 0) + 1
        self.taken += 1

        def give_back() -> None:
            self.taken -= 1
            self._by_key[key] -= 1
            if not self._by_key[key]:
                del self._by_key[key]

        return release_once(give_back)


def release_once(give_back: Callable[[], None]) -> Callable[[], None]:
    """``give_back`` as a release that acts once: called again, it gives nothing more back."""
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            give_back()

    return release


def long_poll_slots(max_connections: int) -> Slots:
    """The long-polls' slots of a controller accepting ``max_connections``: every connection but
    :data:`CONNECTIONS_KEPT_FREE` (half of them, when fewer) may wait in a long-poll; of one run
    with one token :data:`POLLS_PER_RUN` (``per_key``), of one operator token
    :data:`POLLS_PER_OPERATOR_TOKEN` (given to :meth:`Slots.take`)."""
    total = max(max_connections - CONNECTIONS_KEPT_FREE, max_connections // 2, 1)
    return Slots(POLLS_PER_RUN, total, "long-polls",
                 f" (TRAINGUARD_MAX_CONNECTIONS={max_connections} less the {max_connections - total} kept for other requests)")
