"""Per-layer gradient statistics (``trainer_agent/measure/layer_stats.py``): from the gradients the
index reads per bucket, settled, against a float64 reference per layer, and against the path that
reads each parameter's gradient."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from trainer_agent.measure import staged, stats
from trainer_agent.measure.layer_stats import LayerGradStats
from trainer_agent.measure.params import ParamIndex


class _Blocks(nn.Module):
    """193 parameters: 8 repeated blocks of 24 (the layers) and one head: a bucket the staged passes take."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.ParameterList([nn.Parameter(torch.randn(3 + i % 7)) for i in range(24)])
                                    for _ in range(8))
        self.head = nn.Parameter(torch.randn(5, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = (self.head * x[:20].view(5, 4)).sum()
        for k, block in enumerate(self.blocks):
            for p in block:
                out = out + (p * (k + 1)).square().sum() * x[0]
        return out


def _reference(index: ParamIndex, scale: float = 1.0) -> np.ndarray:
    """(layers, 4): mean, std, max |g| and min |g| of each layer's gradient elements, in float64."""
    out = np.full((len(index.layers), 4), math.nan)
    ids = index.layer_ids.tolist()
    for layer in range(len(index.layers)):
        gs = [p.grad for p, i in zip(index.params, ids) if i == layer and p.grad is not None and p.grad.numel()]
        if gs:
            g = torch.cat([t.double().reshape(-1) for t in gs]) / scale
            out[layer] = [float(g.mean()), float(g.std(unbiased=False)), float(g.abs().max()), float(g.abs().min())]
    return out


@pytest.fixture
def index() -> ParamIndex:
    torch.manual_seed(0)
    model = _Blocks()
    model(torch.randn(20)).backward()
    return ParamIndex(model, torch.optim.SGD(model.parameters(), lr=0.1))


def _per_layer(moments) -> np.ndarray:
    return moments.per_layer(moments.values.cpu().numpy())


def test_settled_gradients_are_measured_without_reading_each_one(index: ParamIndex, monkeypatch) -> None:
    """Every gradient present and the bucket taken by the staged passes: the moments come from the
    gradients as the index read them (no per-parameter read, no ``tensor_moments``), in parameter
    order, and the per-layer values match the float64 reference, the loss scale divided out."""
    monkeypatch.setattr(staged, "ON_CPU", True)
    grads = index.grads()
    assert all(isinstance(b, staged.Settled) for b in grads)
    layer = LayerGradStats(index.layer_ids, len(index.layers), index.device)
    monkeypatch.setattr(stats, "tensor_moments", lambda *a, **k: pytest.fail("read per tensor"))
    moments = layer.measure(index.params, grads=grads)
    assert moments.in_order and moments.params == len(index.params) == 193
    np.testing.assert_allclose(_per_layer(moments), _reference(index), rtol=1e-9)
    scaled = layer.measure(index.params, grads=grads, scale=torch.tensor(1024.0))
    np.testing.assert_allclose(_per_layer(scaled), _reference(index, 1024.0), rtol=1e-9)
    np.testing.assert_allclose(moments.grad_sq(moments.values.cpu().numpy()),
                               [float(p.grad.double().square().sum()) for p in index.params], rtol=1e-12)


def test_a_missing_gradient_or_the_cpu_reads_each_parameter(index: ParamIndex, monkeypatch) -> None:
    """A parameter without a gradient this step leaves its bucket unsettled: the gradients are read
    per parameter and that one left out, as the reference leaves it out; without the staged passes
    (the CPU) the same values come from the chunked passes."""
    layer = LayerGradStats(index.layer_ids, len(index.layers), index.device)
    on_cpu = layer.measure(index.params, grads=index.grads())
    np.testing.assert_allclose(_per_layer(on_cpu), _reference(index), rtol=1e-9)
    monkeypatch.setattr(staged, "ON_CPU", True)
    index.params[3].grad = None
    grads = index.grads()
    assert not isinstance(grads[0], staged.Settled)
    moments = layer.measure(index.params, grads=grads)
    assert not moments.in_order and len(moments.measured) == 192 and 3 not in moments.measured.tolist()
    np.testing.assert_allclose(_per_layer(moments), _reference(index), rtol=1e-9)


def test_a_bucket_the_staged_passes_do_not_take_sends_every_gradient_once_to_the_other_path(monkeypatch) -> None:
    """A large bucket the staged passes take beside a small one they do not (fewer tensors than
    ``STAGED_MIN_TENSORS``, here float64): the settled path gives way before any staged pass runs,
    so the large bucket's gradients are not measured twice (on the CPU the path that takes both
    buckets runs no staged pass), and every layer matches the float64 reference."""
    torch.manual_seed(1)
    model = _Blocks()
    model.extra = nn.Parameter(torch.randn(6, dtype=torch.float64))
    (model(torch.randn(20)) + model.extra.square().sum()).backward()
    index = ParamIndex(model, torch.optim.SGD(model.parameters(), lr=0.1))
    monkeypatch.setattr(staged, "ON_CPU", True)
    grads = index.grads()
    assert [len(b) for b in grads] == [193, 1] and all(isinstance(b, staged.Settled) for b in grads)
    calls = []
    real = staged.staged_moments
    monkeypatch.setattr(staged, "staged_moments", lambda tensors, plan: calls.append(len(tensors)) or real(tensors, plan))
    layer = LayerGradStats(index.layer_ids, len(index.layers), index.device)
    moments = layer.measure(index.params, grads=grads)
    assert calls == []  # (a staged pass of the large bucket thrown away: [193])
    assert len(moments.measured) == 194
    np.testing.assert_allclose(_per_layer(moments), _reference(index), rtol=1e-9)
