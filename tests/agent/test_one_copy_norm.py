"""``one_copy_norm.OneCopyNorm``: an ordinary step's gradient norm from one copy per bucket of
many small gradients, against the float64 norm of every gradient taken one by one; which
parameters qualify (decided at attach); a missing gradient, a 0-dim one, non-contiguous ones,
NaN and Inf; the fallback when a copy fails; and its operators, which must not grow with the
tensor count."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from trainer_agent.measure import staged
from trainer_agent.measure.one_copy_norm import OneCopyNorm

CPU = torch.device("cpu")
N = staged.STAGED_MIN_TENSORS


@pytest.fixture(autouse=True)
def _staged_on_cpu(monkeypatch):
    monkeypatch.setattr(staged, "ON_CPU", True)
    monkeypatch.setattr(staged, "FAILED", None)


def _params(dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.nn.Parameter]:
    """N parameters of every shape the copy meets, their gradients set: 0-dim, one element,
    matrices with transposed (non-contiguous) gradients, a channels_last convolution's, values of
    very different sizes."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(), (1,), (4, 3), (2, 3, 4, 4), (17,)] * (N // 5 + 1)
    params = [torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shapes[:N]]
    for i, p in enumerate(params):
        scale = (1e-6, 1.0, 3e3)[i % 3]
        if p.dim() == 2:
            p.grad = (torch.randn(3, 4, generator=g) * scale).to(dtype).t()
        elif p.dim() == 4:
            p.grad = (torch.randn(2, 3, 4, 4, generator=g) * scale).to(dtype).to(memory_format=torch.channels_last)
        else:
            p.grad = (torch.randn(p.shape, generator=g) * scale).to(dtype)
    return params


def _reference(params) -> float:
    return math.sqrt(sum(float(p.grad.detach().double().square().sum()) for p in params if p.grad is not None))


def _grads(params) -> list[torch.Tensor | None]:
    return [p.grad for p in params]


def _norm(params) -> torch.Tensor | None:
    buckets = [[p for p in params if p.dtype == d] for d in dict.fromkeys(p.dtype for p in params)]
    norm = OneCopyNorm.for_buckets(buckets)
    assert norm is not None
    return norm.norm(_grads([p for b in buckets for p in b]), CPU)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_norm_of_one_copy_equals_the_norm_of_every_gradient(dtype: torch.dtype) -> None:
    params = _params(dtype)
    assert any(not p.grad.is_contiguous() for p in params)
    got = _norm(params)
    assert got.dtype == torch.float64 and got.dim() == 0
    assert math.isclose(float(got), _reference(params), rel_tol=1e-12)


def test_two_buckets_and_missing_gradients() -> None:
    """Buckets of two dtypes; in each a parameter unused this step (no gradient: counts 0), one
    of them 0-dim, and the next step's with every gradient present again."""
    params = _params(torch.float32, 1) + _params(torch.float64, 2)
    kept = {id(p): p.grad for p in params}
    for i in (0, 3, N + 7):
        params[i].grad = None
    assert math.isclose(float(_norm(params)), _reference(params), rel_tol=1e-12)
    for p in params:
        p.grad = kept[id(p)]
    assert math.isclose(float(_norm(params)), _reference(params), rel_tol=1e-12)


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_non_finite_gradient_makes_the_norm_non_finite(value: float) -> None:
    params = _params()
    params[9].grad[0] = value
    got = float(_norm(params))
    assert math.isnan(got) if math.isnan(value) else got == math.inf


def test_only_buckets_of_many_small_plain_tensors_qualify(monkeypatch) -> None:
    """Decided at attach from the parameters: every bucket of at least STAGED_MIN_TENSORS plain
    floating-point tensors and at most one stage of elements."""
    monkeypatch.setattr(staged, "STAGE_ELEMENTS", 1000)
    many = [torch.randn(5) for _ in range(N)]
    assert OneCopyNorm.for_buckets([many]) is not None
    assert OneCopyNorm.for_buckets([many, many[:-1]]) is None  # a bucket of too few
    big = many + [torch.randn(400)]
    assert OneCopyNorm.for_buckets([big]) is None  # more than one stage

    class Wrapped(torch.Tensor):
        pass

    wrapped = many[:-1] + [torch.randn(5).as_subclass(Wrapped)]
    assert OneCopyNorm.for_buckets([wrapped]) is None  # a subclass dispatches its own way
    assert OneCopyNorm.for_buckets([]) is None


def test_nothing_on_the_cpu_unless_the_staged_passes_run_there(monkeypatch) -> None:
    params = _params()
    norm = OneCopyNorm.for_buckets([params])
    monkeypatch.setattr(staged, "ON_CPU", False)
    assert norm.norm(_grads(params), CPU) is None and norm.used == 0
    monkeypatch.setattr(staged, "ON_CPU", True)
    assert norm.norm(_grads(params), CPU) is not None and norm.used == 1


def test_a_copy_that_fails_turns_the_staged_passes_off_and_returns_nothing(caplog) -> None:
    """A sparse gradient set by hand among the dense ones: the copy raises, the caller takes the
    fused norms (None here), and the staged passes are off from then on."""
    params = _params()
    params[6].grad = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.tensor([2.0]), (1,), check_invariants=True)
    norm = OneCopyNorm.for_buckets([params])
    with caplog.at_level("WARNING"):
        assert norm.norm(_grads(params), CPU) is None
    assert staged.FAILED is not None
    params[6].grad = torch.ones(1)
    assert norm.norm(_grads(params), CPU) is None  # off for the process


def test_operators_do_not_grow_with_the_tensor_count() -> None:
    """200 and 2,000 gradients of the same total size, some missing: the same operators and the
    same modeled CUDA launches (deterministic: no timing)."""
    path = Path(__file__).resolve().parents[2] / "bench" / "agent_overhead.py"
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location("agent_overhead", path)
    overhead = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(overhead)
    counts = []
    for n in (200, 2000):
        params = [torch.nn.Parameter(torch.zeros(40_000 // n)) for _ in range(n)]
        for p in params:
            p.grad = torch.randn(p.shape)
        norm = OneCopyNorm.for_buckets([params])
        with overhead.OpCounter() as count:
            norm.norm(_grads(params), CPU)
        counts.append((count.ops - count.views, count.launches))
    assert counts[0] == counts[1]
    assert counts[0][1] <= 4


def test_an_empty_parameter_is_left_out_and_a_cast_model_takes_the_fused_norms() -> None:
    """``_chunk_cat`` refuses an empty tensor: an empty parameter (and its empty gradient) is left
    out of the copy, nothing turned off. A model cast to another dtype after the norm was built
    (``model.half()``) is normed by the fused passes for that step (None here), nothing turned off."""
    params = _params()
    empty = torch.nn.Parameter(torch.zeros(0, 4))
    empty.grad = torch.zeros(0, 4)
    with_empty = params[:7] + [empty] + params[7:]
    norm = OneCopyNorm.for_buckets([with_empty])
    assert math.isclose(float(norm.norm(_grads(with_empty), CPU)), _reference(params), rel_tol=1e-12)
    assert staged.FAILED is None
    for p in params:
        p.data = p.data.double()
        p.grad = p.grad.double()
    assert norm.norm(_grads(with_empty), CPU) is None and staged.FAILED is None
