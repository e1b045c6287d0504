"""Report values the host derives (``trainer_agent/report/host_derived.py``): the per-layer vectors."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from trainer_agent.measure.layer_stats import LayerGradStats
from trainer_agent.measure.params import ParamIndex
from trainer_agent.measure.triage_stats import LAYER_STATS
from trainer_agent.report.exporter import parse_key, sample_key
from trainer_agent.report.host_derived import Raw, layer_vectors


class _Branches(nn.Module):
    """Three repeated blocks (the layers); ``forward`` takes blocks 0 and 2: block 1 is a branch
    unused on the step, so its parameters get no ``.grad``."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[2](torch.tanh(self.blocks[0](x))).square().sum()


def _layer_values(index: ParamIndex) -> dict[str, float]:
    """What ``layer_vectors`` publishes for the current gradients of ``index``'s parameters."""
    moments = LayerGradStats(index.layer_ids, len(index.layers), torch.device("cpu")).measure(index.params)
    square = [float(p.detach().double().square().sum()) for p in index.params]
    grad_sq = [0.0 if p.grad is None else float(p.grad.double().square().sum()) for p in index.params]
    raw = Raw({}, [np.asarray(square), np.asarray(grad_sq), moments.values.numpy()], None)
    values: dict[str, float] = {}
    with np.errstate(invalid="ignore"):  # as HostDerived.apply runs it (a NaN gradient: NaN extremes)
        layer_vectors(raw, values, layer_of=np.asarray(index.layer_ids.tolist()),
                      keys=lambda *ms: [sample_key(m, layer=layer) for layer in index.layers for m in ms],
                      grads=1, scale=None, param=0, delta=None, before=None, moments=(2, moments))
    return values


def test_a_layer_without_a_gradient_has_no_gradient_statistics_and_a_nan_gradient_stays_nan() -> None:
    torch.manual_seed(0)
    model = _Branches()
    index = ParamIndex(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.randn(8, 4)).backward()
    model.blocks[2].weight.grad[1, 3] = math.nan
    values = _layer_values(index)
    assert index.layers == ["blocks.0", "blocks.1", "blocks.2"] and model.blocks[1].weight.grad is None
    g = torch.cat([model.blocks[0].weight.grad.reshape(-1), model.blocks[0].bias.grad]).double()
    expected = [float(g.mean()), float(g.std(unbiased=False)), float(g.abs().max()), float(g.abs().min())]
    np.testing.assert_allclose([values[sample_key(m, layer="blocks.0")] for m in LAYER_STATS], expected, rtol=1e-9)
    # The unused branch: its gradient norm is 0, and it has no mean, std, max |g| or min |g| (not NaN).
    assert values[sample_key("trainguard_layer_grad_norm", layer="blocks.1")] == 0.0
    assert [sample_key(m, layer="blocks.1") in values for m in LAYER_STATS] == [False] * 4
    # A NaN element is a real non-finite gradient: it shows as NaN.
    assert all(math.isnan(values[sample_key(m, layer="blocks.2")]) for m in LAYER_STATS[:3])


def _update_ratios(delta: list[float], before: list[float], ungraded: list[int] | None) -> dict[str, float]:
    """The layer update ratios ``layer_vectors`` publishes for per-tensor squared norms of four
    layers of two tensors each (``blocks.0`` to ``blocks.3``)."""
    names = [f"blocks.{i}" for i in range(4)]
    values: dict[str, float] = {}
    vectors = [np.asarray(before), np.asarray(delta), np.asarray(before)]
    layer_vectors(Raw({}, vectors, None), values, layer_of=np.repeat(np.arange(4), 2),
                  keys=lambda *ms: [sample_key(m, layer=layer) for layer in names for m in ms],
                  grads=None, scale=None, param=0, delta=1, before=2, moments=None,
                  ungraded=None if ungraded is None else np.asarray(ungraded))
    return {parse_key(k)[1]["layer"]: v for k, v in values.items() if k.startswith("trainguard_layer_update_ratio")}


def test_a_layer_without_a_gradient_that_did_not_move_has_no_update_ratio() -> None:
    # Layers: (0) trained, (1) no gradient and no move (frozen, unused, an expert no token
    # reached), (2) no gradient on one tensor only, (3) no gradient yet moved (an update without
    # a gradient, e.g. a decay outside the gradient): only layer 1 is not measured.
    delta = [1.0, 3.0, 0.0, 0.0, 4.0, 0.0, 0.0, 2.0]
    before = [4.0, 12.0, 9.0, 7.0, 16.0, 9.0, 1.0, 7.0]
    assert _update_ratios(delta, before, [2, 3, 5, 6, 7]) == {"blocks.0": 0.5, "blocks.2": 0.4, "blocks.3": 0.5}
    # Every tensor with a gradient: a layer that did not move has a real update ratio of 0.
    assert _update_ratios(delta, before, None) == {"blocks.0": 0.5, "blocks.1": 0.0, "blocks.2": 0.4, "blocks.3": 0.5}
