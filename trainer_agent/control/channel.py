"""How the ranks' control planes (``trainer_agent/control/plane.py``) reach each other outside the report
step's collective: a side *gloo* process group of CPU tensors (the broadcast of the desired state
on ``sync_every`` steps, the skip flag) and the c10d store (the texts of a state, the states a
leader applies during a pause).

**Texts.** A text field of the desired state travels as its key; with several ranks the leader
sets the text under ``text/<key>`` before it proposes the state, so every rank finds it there after
the collective that carries the key (never a blocking wait).

**Pause.** The leader publishes each state it applies during a pause under a fresh key
(``pause/<episode>/<i>``); the other ranks poll those keys (``check`` + a short sleep); once every
rank has left an episode and passed a collective since, the leader deletes its keys.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from trainguard.protocol.commands import REGISTRY, STATE_FIELDS, STATE_INDEX, STATE_LEN, decode_state, encode_state, state_texts
from trainguard.protocol.wire import DesiredState
from trainer_agent.compat import torch_private

__all__ = ["StateChannel"]

log = logging.getLogger(__name__)

#: The command that owns each desired-state field.
_OWNER = {f.name: c for c in REGISTRY for f in c.fields}


class StateChannel:
    """The side group and the store of one control plane. ``group`` and ``store`` may be injected
    (tests); by default a new gloo group and a prefix of the default group's store (``prefix``).
    ``closed()`` ends a wait on the store."""

    def __init__(self, *, world_size: int, leader: bool, controlled: bool, group: Any, store: Any, prefix: str,
                 pause_poll_s: float, on_error: Callable[[str, BaseException], None],
                 closed: Callable[[], bool]) -> None:
        self.world_size, self.leader = world_size, leader
        self.group, self.store, self._own_group = group, store, False
        if world_size > 1 and self.group is None:
            self.group = dist.new_group(backend="gloo", timeout=torch_private.default_group_timeout())
            self._own_group = True
        if world_size > 1 and self.store is None and controlled:
            base = dist.group.WORLD.get_group_store()  # the store init_process_group made
            self.store = dist.PrefixStore(prefix, base)
        self.proposed_texts: dict[int, str] = {}
        """The leader's texts of its newest proposal."""
        self._pause_poll_s = pause_poll_s
        self._on_error = on_error
        self._closed = closed

    def broadcast(self, leader_state: list[int] | None, length: int = STATE_LEN) -> list[int]:
        """The leader's encoded state (``length`` int64) on every rank (the others pass anything)."""
        if self.world_size == 1:
            assert leader_state is not None
            return leader_state
        t = torch.tensor(leader_state if self.leader else [0] * length, dtype=torch.int64)
        dist.broadcast(t, src=0, group=self.group)  # gloo, CPU tensor: no device sync
        return t.tolist()

    def publish_texts(self, d: DesiredState) -> bool:
        """Leader: ``d``'s texts where every rank finds them (``text/<key>`` in the store; one rank:
        kept here). False when the store failed."""
        texts = state_texts(d)
        self.proposed_texts = texts
        if self.world_size == 1 or not texts:
            return True
        try:
            for key, text in texts.items():
                self.store.set(f"text/{key}", text)
        except Exception as exc:  # noqa: BLE001 - propose nothing new; retried at the next agreement
            self._on_error("control_text", exc)
            return False
        return True

    def fetch_text(self, key: int) -> str:
        """A text the leader set before the collective that carried its key (so it is there now:
        never a blocking wait)."""
        name = f"text/{key}"
        if self.store is None or not self.store.check([name]):
            raise LookupError(f"the text of key {key} is not in the store")
        return self.store.get(name).decode()

    def decode(self, state: Sequence[int], applied: DesiredState) -> DesiredState | None:
        """The agreed state, its texts read from the store where this rank lacks them; None (an
        agent error, nothing applied) for a state no leader can have sent. A text that cannot be
        read leaves its command's fields as ``applied`` has them (an agent error; the rest applies)."""
        texts = {**state_texts(applied), **self.proposed_texts}
        values = list(state)
        for f in STATE_FIELDS:
            at = STATE_INDEX[f.name]
            if f.kind != "text" or len(values) != STATE_LEN or values[at] == 0 or values[at] in texts:
                continue
            try:
                texts[values[at]] = self.fetch_text(values[at])
            except Exception as exc:  # noqa: BLE001 - keep this command as it was; never hang here
                self._on_error("control_text", exc)
                for kept in _OWNER[f.name].fields:
                    values[STATE_INDEX[kept.name]] = kept.encode(getattr(applied, kept.name))
                texts.update(state_texts(applied))
        try:
            return decode_state(values, texts)
        except ValueError as exc:
            self._on_error("control_state", exc)
            return None

    def publish_paused(self, episode: int, i: int, state: DesiredState) -> bool:
        """Leader: the ``i``-th state applied in pause ``episode``, with its texts; False (after a
        short wait) when its texts could not be published: the client offers it again."""
        if self.world_size == 1:
            return True
        if not self.publish_texts(state):
            time.sleep(self._pause_poll_s)
            return False
        self.store.set(f"pause/{episode}/{i}", ",".join(map(str, encode_state(state))))
        return True

    def next_published(self, episode: int, i: int) -> list[int] | None:
        """The ``i``-th state the leader published in this pause (encoded); None once closed."""
        key = f"pause/{episode}/{i}"
        while not self._closed():
            if self.store.check([key]):
                return [int(x) for x in self.store.get(key).decode().split(",")]
            time.sleep(self._pause_poll_s)
        return None

    def forget_episode(self, episode: int) -> None:
        """Every rank read all keys of ``episode`` before leaving it, and has passed a
        collective since: the leader may delete them."""
        if self.store is None:
            return
        for i in itertools.count():
            key = f"pause/{episode}/{i}"
            try:
                if not self.store.check([key]):
                    return
                self.store.delete_key(key)
            except Exception:  # noqa: BLE001 - a store without delete_key keeps a few bytes more
                return

    def idle(self) -> None:
        """A short wait (the leader's pause loop never spins)."""
        time.sleep(self._pause_poll_s)

    def close(self) -> None:
        """Release the side group when this channel made it."""
        if self._own_group and self.group is not None:
            try:
                dist.destroy_process_group(self.group)
            except Exception as exc:  # noqa: BLE001 - the default group may be gone already
                log.debug("trainguard: side group not destroyed: %r", exc)
            self.group = None
