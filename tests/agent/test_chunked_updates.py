"""The update's squared norms chunk by chunk (``trainer_agent/measure/chunked_updates.py``): the
rows of the parameters and the snapshot kept between calls, and read again when a tensor is
another one or laid out otherwise at the same address."""

from __future__ import annotations

import pytest
import torch

from trainer_agent.measure import chunked_updates


def _reference(before: list[torch.Tensor], after: list[torch.Tensor]) -> list[list[float]]:
    """Per tensor, in float64: ||before - after||^2, ||after||^2, ||before||^2."""
    return [[float((b.double() - a.double()).pow(2).sum()) for b, a in zip(before, after)],
            [float(a.double().pow(2).sum()) for a in after],
            [float(b.double().pow(2).sum()) for b in before]]


def _check(before: list[torch.Tensor], after: list[torch.Tensor], cache: dict) -> None:
    want = _reference(before, after)
    got = chunked_updates.chunked_update_sq_norms(before, after, cache, before_norms=True, refresh=True)
    for column, reference in zip(got, want):
        assert column.tolist() == pytest.approx(reference, rel=1e-5)
    assert all(torch.equal(b, a) for b, a in zip(before, after))  # refreshed: the snapshot holds W_after


def test_rows_are_kept_for_the_same_tensors_and_made_again_for_others(monkeypatch) -> None:
    monkeypatch.setattr(chunked_updates, "UPDATE_CHUNK", 16)  # 8x8 and 40: rows of 16; 4s packed
    g = torch.Generator().manual_seed(7)
    after = [torch.randn(8, 8, generator=g), torch.randn(4, generator=g), torch.randn(40, generator=g),
             torch.randn(4, generator=g)]
    before = [a + 0.1 * torch.randn(a.shape, generator=g) for a in after]
    cache: dict = {}
    _check(before, after, cache)
    plan = cache["update_plan"]
    rows = plan.rows_of(before, after)
    for a in after:
        a.mul_(0.5).add_(0.25)  # an optimizer step: in place, same tensors
    _check(before, after, cache)
    assert cache["update_plan"] is plan and plan.rows_of(before, after) is rows
    after[2] = after[2] * 3 + 1  # another tensor of the same shape
    _check(before, after, cache)
    square = after[0]
    after[0] = square.t()  # the same address, laid out otherwise: read as the tensor it is now
    before[0].copy_(square.t() - 0.5)
    _check(before, after, cache)
    after[0] = square  # contiguous again
    before[0].sub_(0.125)
    _check(before, after, cache)


@pytest.mark.parametrize("dtypes", [(torch.float32,), (torch.float64,), (torch.float32, torch.float64)])
def test_a_result_is_not_written_over_by_the_next_pass(dtypes: tuple[torch.dtype, ...]) -> None:
    """The plan's norms are written in place by every pass: what a pass returned (a measured
    step's ``||W_after||^2`` is kept as the next step's ``||W_before||^2``), of float32 and
    float64 parameters, stays the norms of the tensors it measured."""
    g = torch.Generator().manual_seed(8)
    after = [torch.randn(30, generator=g, dtype=dtypes[0]), torch.randn(5, 6, generator=g, dtype=dtypes[-1])]
    before = [a + 0.1 * torch.randn(a.shape, generator=g, dtype=a.dtype) for a in after]
    want = _reference(before, after)
    cache: dict = {}
    got = chunked_updates.chunked_update_sq_norms(before, after, cache, before_norms=True, refresh=False)
    chunked_updates.chunked_update_sq_norms([b * 2 for b in before], [a * 3 for a in after], cache,
                                            before_norms=True, refresh=False)
    for column, reference in zip(got, want):
        assert column.tolist() == pytest.approx(reference, rel=1e-5)
