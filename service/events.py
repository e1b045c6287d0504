"""The audit events published after each commit, fanned out to subscribers (the SSE streams)."""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["EventHub", "QUEUE_SIZE"]

#: Events a subscriber may fall behind by before it is dropped (it reconnects with Last-Event-ID).
QUEUE_SIZE = 1024
Queue = asyncio.Queue[dict[str, Any] | None]


class EventHub:
    """Bounded per-subscriber queues; a subscriber too slow to keep up is dropped, never waited for."""

    def __init__(self) -> None:
        self._subscribers: set[Queue] = set()
        self.closed = False

    def publish(self, events: list[dict[str, Any]]) -> None:
        for ev in events:
            for q in list(self._subscribers):
                try:
                    q.put_nowait(ev)
                except asyncio.QueueFull:  # a consumer too slow: drop it, it reconnects with Last-Event-ID
                    self._subscribers.discard(q)

    def subscribe(self) -> Queue:
        q: Queue = asyncio.Queue(maxsize=QUEUE_SIZE)
        if self.closed:
            q.put_nowait(None)  # subscribed during shutdown: the stream ends at once
            return q
        self._subscribers.add(q)
        return q

    def unsubscribe(self, q: Queue) -> None:
        self._subscribers.discard(q)

    def is_subscribed(self, q: Queue) -> bool:
        return q in self._subscribers

    def close(self) -> None:
        """Tell every subscriber the stream ends (``None``)."""
        self.closed = True
        for q in list(self._subscribers):
            try:
                q.put_nowait(None)
            except asyncio.QueueFull:
                self._subscribers.discard(q)
