"""Which snapshots a run keeps (``trainguard/protocol/retention.py``), against the rule written out
by hand: the ideal steps t_0 = newest, t_i = the largest multiple of every * 2**i below t_{i-1}."""

from __future__ import annotations

import pytest

from trainguard.protocol.retention import retained


def _ideal(newest: int, every: int, keep: int) -> set[int]:
    out, t = {newest}, newest
    for i in range(1, keep):
        span = every * 2 ** i
        t = (t - 1) // span * span
        if t <= 0:
            break
        out.add(t)
    return out


@pytest.mark.parametrize(("every", "keep"), [(1, 1), (10, 3), (50, 4), (7, 5)])
def test_taking_every_snapshot_keeps_the_ideal_ones_and_their_ages_double(every: int, keep: int) -> None:
    held: list[int] = []
    for step in range(every, every * 600, every):
        held = retained(held + [step], every=every, keep=keep)
        assert len(held) == min(keep, step // every)
        ideal = _ideal(step, every, keep)
        assert ideal <= set(held), (step, ideal, held)  # nothing the rule wants was dropped earlier
        if step >= every * 2 ** keep:  # past the start: the oldest is (2**(keep-1) - 1) to twice that old
            age = (step - held[0]) // every
            assert 2 ** (keep - 1) - 1 <= age <= 2 * (2 ** (keep - 1) - 1)


def test_snapshots_not_taken_during_trouble_leave_the_older_ones() -> None:
    held: list[int] = []
    for step in range(10, 160, 10):
        held = retained(held + [step], every=10, keep=4)
    assert held == [80, 120, 140, 150]
    # No snapshot between 160 and 200 (the agent skipped steps in those intervals), then 210.
    held = retained(held + [210], every=10, keep=4)
    assert held == [80, 140, 150, 210]  # 150 and 140, from before the trouble, stay
    held = retained(held + [220], every=10, keep=4)
    assert 150 in held and max(held) == 220


def test_bad_arguments_are_value_errors() -> None:
    with pytest.raises(ValueError, match="every"):
        retained([1], every=0, keep=2)
    with pytest.raises(ValueError, match="keep"):
        retained([1], every=1, keep=True)
    assert retained([], every=5, keep=3) == [] and retained([5, 5, 10], every=5, keep=3) == [5, 10]
