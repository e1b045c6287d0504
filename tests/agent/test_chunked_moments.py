"""The CPU's moments chunk by chunk (``trainer_agent/measure/chunked_moments.py``) against a float64
reference per tensor, and against the accelerator's fused passes (``stats.tensor_moments`` with
``chunked=False``), for the layouts the plan makes: tensors cut into rows, tensors of one length
packed as rows of one chunk, a large tensor's last row packed with small tensors of its length."""

from __future__ import annotations

import math

import pytest
import torch

from trainer_agent.measure import chunked_moments, stats


def _reference(t: torch.Tensor) -> list[float]:
    """The five MOMENTS of ``t`` in float64, the obvious way."""
    d = t.detach().double().reshape(-1)
    a = d.abs()
    return [float(d.clamp_min(0).sum()), float(a.sum()), float((d * d).sum()), float(a.max()), -float(a.min())]


def _check(got: torch.Tensor, tensors: list[torch.Tensor], rel: float = 1e-12) -> None:
    assert got.shape == (5, len(tensors)) and got.dtype == torch.float64
    for j, t in enumerate(tensors):
        for k, (value, want) in enumerate(zip(got[:, j].tolist(), _reference(t))):
            if math.isnan(want):
                assert math.isnan(value), (j, stats.MOMENTS[k], value)
            else:
                assert value == want or math.isclose(value, want, rel_tol=rel), (j, stats.MOMENTS[k], value, want)


def _tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    scale = [1e-6, 1.0, 3e3]
    out = [torch.randn(40, generator=g) * scale[i % 3] for i in range(30)]  # one length: packed rows
    out += [torch.randn(5, 8, generator=g), torch.randn(3, 33, generator=g).t()]  # 40 elements; non-contiguous, 99
    out += [torch.randn(100, generator=g), torch.randn(64, 9, generator=g).double()]  # 100 = 64 + 36 rows
    out += [torch.randn(36, generator=g).half(), torch.randn(36, generator=g).bfloat16(), torch.randn(36, generator=g)]
    out += [torch.randn(1, generator=g), torch.full((64,), -0.0)]
    return out


@pytest.mark.parametrize("chunk", [64, 1 << 16])
def test_every_moment_matches_a_float64_reference(monkeypatch, chunk: int) -> None:
    """With a chunk of 64 elements the 100-element tensor is a row of 64 and a row of 36, and the
    30 tensors of 40 elements one row each in chunks of one; at the default chunk every tensor is
    a whole row, the float32 ones all in one chunk, padded to the longest."""
    monkeypatch.setattr(chunked_moments, "MOMENT_CHUNK", chunk)
    tensors = _tensors(0)
    cache: dict = {}
    _check(chunked_moments.chunked_moments(tensors, cache), tensors)
    plan = cache["moment_plan"]
    assert sum(c.rows for c in plan.chunks) == len(plan.owner)
    if chunk == 64:
        assert not plan.identity and max(c.rows for c in plan.chunks) == 1  # 40 > 64 // 2: one row per chunk
    else:  # every float32 tensor in one chunk, each row padded to the longest (100)
        packed = max(plan.chunks, key=lambda c: c.rows)
        assert packed.rows == sum(t.dtype == torch.float32 for t in tensors) and packed.length == 100
        assert packed.pad is not None and int((~packed.pad).sum()) == sum(
            t.numel() for t in tensors if t.dtype == torch.float32)
    # The plan and its buffers are reused for new values of the same shapes.
    again = [t * 2 for t in tensors]
    _check(chunked_moments.chunked_moments(again, cache), again)
    assert cache["moment_plan"] is plan


def test_rows_of_one_length_share_chunks_and_a_large_tensor_its_last_row(monkeypatch) -> None:
    monkeypatch.setattr(chunked_moments, "MOMENT_CHUNK", 128)
    g = torch.Generator().manual_seed(1)
    tensors = [torch.randn(300, generator=g)] + [torch.randn(44, generator=g) for _ in range(5)]
    cache: dict = {}
    _check(chunked_moments.chunked_moments(tensors, cache), tensors)
    chunks = [(c.rows, c.length, c.pieces) for c in cache["moment_plan"].chunks]
    # 300 = 128 + 128 + 44: its last row is packed with the five 44-element tensors, two per chunk.
    assert chunks == [(1, 128, [(0, 0, 128)]), (1, 128, [(0, 128, 128)]), (2, 44, [(0, 256, 44), (1, -1, 44)]),
                      (2, 44, [(2, -1, 44), (3, -1, 44)]), (2, 44, [(4, -1, 44), (5, -1, 44)])]
    assert all(c.pad is None for c in cache["moment_plan"].chunks)


def test_non_finite_values_propagate_per_tensor(monkeypatch) -> None:
    """NaN anywhere in a tensor, in a packed row or a tensor's later row, makes each of its
    moments NaN (the smallest |x| too, which an integer minimum would pass over), and leaves the
    tensors packed beside it alone, padded rows included; infinities are infinite, and the
    positive part (the fused passes' ``||relu(t)||_1``) stays exact beside them."""
    monkeypatch.setattr(chunked_moments, "MOMENT_CHUNK", 16)
    tensors = [torch.randn(8) for _ in range(4)] + [torch.randn(40), torch.randn(8).half(), torch.randn(5),
                                                    torch.randn(3)]
    tensors[1][3] = math.nan
    tensors[2][0] = math.inf
    tensors[3][5], tensors[3][6] = math.inf, -math.inf
    tensors[4][37] = math.nan  # the 40-element tensor's last row (8 of 16)
    tensors[5][2] = -math.inf
    tensors[6][4] = math.nan  # padded to 8 beside a row of 8
    tensors[7][0] = -math.inf
    cache: dict = {}
    got = chunked_moments.chunked_moments(tensors, cache)
    _check(got, tensors)
    padded = [c for c in cache["moment_plan"].chunks if c.pad is not None]
    assert [[i for i, _, _ in c.pieces] for c in padded] == [[4, 6]]  # the 40's last row of 8, and the 5
    assert all(math.isnan(v) for v in got[:, 1].tolist())
    assert all(math.isnan(v) for v in got[:, 4].tolist())
    assert got[3, 2] == math.inf and got[3, 5] == math.inf
    assert got[3, 3] == math.inf and got[1, 3] == math.inf and got[0, 3] == math.inf  # +inf and -inf
    assert math.isfinite(got[0, 5]) and got[1, 5] == math.inf  # -inf only: a finite positive part
    assert all(math.isfinite(v) for v in got[:, 0].tolist())


def test_the_cpu_path_agrees_with_the_fused_passes() -> None:
    """``tensor_moments`` on the CPU (this module) beside ``chunked=False`` (the accelerator's eight
    fused passes), on the same tensors: every moment to float32 rounding (the fused pass's squared
    norm is a float32 norm), the extremes exactly; both in the order of the tensors."""
    tensors = _tensors(2) + [torch.randn(200_000)]
    cpu, order = stats.tensor_moments(tensors, torch.device("cpu"))
    fused, fused_order = stats.tensor_moments(tensors, torch.device("cpu"), chunked=False)
    n = len(tensors)
    assert order == list(range(n))
    a = cpu.view(5, n)
    b = fused.view(5, n)[:, torch.tensor([fused_order.index(i) for i in range(n)])]
    assert torch.equal(a[3:], b[3:])
    assert torch.allclose(a[:3], b[:3], rtol=1e-5, atol=0)


def test_a_new_set_of_shapes_makes_a_new_plan() -> None:
    cache: dict = {}
    first = [torch.randn(10), torch.randn(20)]
    chunked_moments.chunked_moments(first, cache)
    plan = cache["moment_plan"]
    second = [torch.randn(10), torch.randn(4, 5), torch.randn(3)]
    _check(chunked_moments.chunked_moments(second, cache), second)
    assert cache["moment_plan"] is not plan


def test_a_result_is_not_written_over_by_the_next_pass() -> None:
    """The plan's results are written in place by every pass: what a pass returned, float64
    tensors' columns included, stays the moments of the tensors it measured."""
    cache: dict = {}
    first = _tensors(5)
    got = chunked_moments.chunked_moments(first, cache)
    chunked_moments.chunked_moments(_tensors(6), cache)
    _check(got, first)
