"""Which in-memory snapshots a run keeps: the agent holds them, the controller mirrors the list.

A run snapshots its training state every ``every`` steps and keeps ``keep`` snapshots. Keeping
only the newest ``keep`` fails exactly when a rollback is needed: an incident that lasts longer
than ``keep x every`` steps leaves only snapshots taken after its onset. So the kept snapshots
are spaced out geometrically, as backup rotations are: the newest, then gaps of up to ``2 x
every``, ``4 x every``, ``8 x every`` and so on. The oldest kept snapshot is between
``(2**(keep - 1) - 1) x every`` and twice that many steps old (``every=50``, ``keep=4``: 350 to 700 steps),
and the newest at most ``every``.

Exactly: the ideal steps are ``t_0`` = the newest snapshot's step and ``t_i`` = the largest
multiple of ``every x 2**i`` strictly below ``t_{i-1}``. When every snapshot was taken (steps
``every, 2 x every, ...``), each ``t_i`` is one that is held, and it stays held until it is
replaced by a newer one of its tier: nothing the rule wants later is ever dropped. When some were
not taken (the agent takes none while it is skipping steps: that state is suspect), each tier
keeps the newest held snapshot at or before its ideal step that no newer tier took, so older
snapshots, from before the trouble, stay. Free slots keep the newest of the rest.

The controller applies the same rule to the snapshot steps the agent reports, so both sides
agree on what a rollback can reach (the agent restores the newest snapshot at or before the
step the controller picks).
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["retained"]


def retained(steps: Iterable[int], *, every: int, keep: int) -> list[int]:
    """The snapshot steps to keep out of ``steps`` (ascending, without duplicates)."""
    if type(every) is not int or every < 1:
        raise ValueError(f"every must be an int >= 1, got {every!r}")
    if type(keep) is not int or keep < 1:
        raise ValueError(f"keep must be an int >= 1, got {keep!r}")
    held = sorted(set(steps))
    if len(held) <= keep:
        return held
    kept = {held[-1]}
    ideal = held[-1]
    for tier in range(1, keep):
        span = every << tier
        ideal = (ideal - 1) // span * span  # the largest multiple of span strictly below
        pick = next((s for s in reversed(held) if s <= ideal and s not in kept), None)
        if pick is None:
            break
        kept.add(pick)
    for s in reversed(held):  # free slots: the newest of the rest
        if len(kept) >= keep:
            break
        kept.add(s)
    return sorted(kept)
