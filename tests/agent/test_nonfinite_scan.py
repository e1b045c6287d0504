"""The CPU's non-finite scan (``trainer_agent/measure/nonfinite_scan.py``): the sums of squares by
dots (which tensors they read, their values against a float64 reference, the non-finite elements
they see wherever they lie), the chunked count against an element-wise one, and
``stats.nonfinite_count`` over an optimizer-state-like list against an element-wise count."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from trainer_agent.compat.torch_private import TorchDispatchMode
from trainer_agent.measure import nonfinite_scan, stats
from trainer_agent.measure.nonfinite_scan import DOT_MIN_ELEMENTS, dot_sq_norms, nonfinite_elements

CPU = torch.device("cpu")
N = DOT_MIN_ELEMENTS


class _Ops(TorchDispatchMode):
    """The ATen operators dispatched inside the block, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def _state(g: torch.Generator) -> list[torch.Tensor]:
    """AdamW-like state: large float32 moments, a float64 one, a step counter, a small tensor, a
    large strided one and a large bfloat16 one."""
    return [torch.randn(N, generator=g), torch.rand(2 * N + 5, generator=g), torch.randn(N, generator=g).double(),
            torch.tensor(3.0), torch.randn(N - 1, generator=g), torch.randn(N, 2, generator=g).t(),
            torch.randn(N, generator=g).bfloat16()]


def test_large_contiguous_float32_and_float64_tensors_are_dotted_in_order() -> None:
    tensors = _state(torch.Generator().manual_seed(0))
    dotted, sq, rest = dot_sq_norms(tensors)
    assert [id(t) for t in dotted] == [id(t) for t in tensors[:3]]
    assert [id(t) for t in rest] == [id(t) for t in tensors[3:]]
    assert sq is not None and sq.dtype == torch.float64 and sq.shape == (3,)
    for value, t in zip(sq.tolist(), dotted):
        want = float((t.double() ** 2).sum())
        assert math.isclose(value, want, rel_tol=1e-5 if t.dtype == torch.float32 else 1e-12), (value, want)
    assert dot_sq_norms(tensors[3:]) == ([], None, tensors[3:])


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_non_finite_element_anywhere_makes_the_sum_of_squares_non_finite(value: float) -> None:
    for n in (N, N + 1, N + 15, 3 * N + 7):
        for at in sorted({0, 1, 15, 16, n // 2, n - 16, n - 1}):
            t = torch.randn(n, generator=torch.Generator().manual_seed(at))
            t[at] = value
            _, sq, _ = dot_sq_norms([t])
            assert not math.isfinite(float(sq[0])), (n, at)
    both = torch.randn(N)
    both[3], both[-1] = math.inf, -math.inf
    assert float(dot_sq_norms([both])[1][0]) == math.inf  # (both squares are +inf)


def _put(t: torch.Tensor, k: int, value: float) -> None:
    """``value`` at the ``k``-th element of ``t`` in logical order (strided and 0-dim tensors too)."""
    t[torch.unravel_index(torch.tensor(k % t.numel()), t.shape)] = value


def test_the_count_over_a_state_like_list_matches_an_element_wise_count() -> None:
    tensors: list[torch.Tensor | None] = list(_state(torch.Generator().manual_seed(1)))
    places = ((7, math.nan), (-1, math.inf), (100, -math.inf), (0, math.inf), (3, math.nan), (5, -math.inf),
              (9, math.nan))
    for t, (k, value) in zip(tensors, places):
        _put(t, k, value)
    _put(tensors[0], 8, -math.inf)
    huge = torch.full((N,), 1e30)  # finite, but its sum of squares overflows: scanned, counting 0
    tensors += [huge, None]
    expected = sum(int((~torch.isfinite(t)).sum()) for t in tensors if t is not None)
    assert expected == 8
    assert float(stats.nonfinite_count(tensors, CPU)) == expected
    assert float(stats.nonfinite_count([huge, torch.ones(N), torch.tensor(1.0)], CPU)) == 0


def test_large_state_tensors_are_read_by_one_dot_each_and_no_norm() -> None:
    tensors = _state(torch.Generator().manual_seed(2))
    with _Ops() as ops:
        assert float(stats.nonfinite_count(tensors, CPU)) == 0
    assert ops.names["dot"] == 3
    # the fused norm reads only the four others (one call, whatever their count)
    assert ops.names["_foreach_norm"] + ops.names["linalg_vector_norm"] <= 4
    assert "isfinite" not in ops.names


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_the_chunked_count_matches_an_element_wise_count(monkeypatch, dtype: torch.dtype) -> None:
    monkeypatch.setattr(nonfinite_scan, "COUNT_CHUNK", 16)
    g = torch.Generator().manual_seed(3)
    t = torch.randn(7, 11, generator=g).to(dtype)  # 77 elements: four full chunks and a short one
    for k, value in ((0, math.nan), (15, math.inf), (16, -math.inf), (40, math.nan), (76, math.inf)):
        _put(t, k, value)
    _put(t, 5, -0.0)
    _put(t, 6, torch.finfo(dtype).max)  # finite: its product with 0 is 0
    cases = [t, t.t(), t[0, 0], t[:, 2:3], torch.full((3,), math.nan, dtype=dtype), torch.zeros(2, dtype=dtype)]
    for case in cases:
        assert nonfinite_elements(case) == int((~torch.isfinite(case)).sum()), case.shape
    assert [nonfinite_elements(c) for c in cases[:2]] == [5, 5]
    nan_payload = torch.tensor([0x7FC00001, -0x00400000, 0x7F800000, 0x7F7FFFFF], dtype=torch.int32).view(torch.float32)
    assert nonfinite_elements(nan_payload) == 3  # two NaNs (one with the sign bit) and +inf, not the largest float


def test_a_flagged_tensor_is_counted_without_a_whole_size_temporary() -> None:
    t = torch.randn(3 * N)
    t[5], t[-2] = math.nan, -math.inf
    with _Ops() as ops:
        assert float(stats.nonfinite_count([t, torch.ones(N)], CPU)) == 2
    assert "isfinite" not in ops.names and ops.names["count_nonzero"] >= 1
