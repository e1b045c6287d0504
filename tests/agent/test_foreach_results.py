"""``trainer_agent/compat/foreach_results.py``: fused reductions' 0-dim results joined into one
vector, taken as the buffer they are views of where they lie in one (CUDA's ``_foreach_norm``),
stacked otherwise (the CPU), with the values and dtype ``torch.stack`` gives in every case; and
the metrics the agent computes from such results against float64 references."""

from __future__ import annotations

import pytest
import torch

from tests.agent.test_agent_metrics import (Capture, Net, assert_close, assert_step_and_noise_scale, attach, reference,
                                             train)
from tests.agent.test_step_stats import _bench
from trainer_agent.compat.foreach_results import one_buffer, results_vector
from trainer_agent.compat.torch_private import TorchDispatchMode


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _as_cuda_returns(values: list[float], dtype=torch.float32) -> list[torch.Tensor]:
    """0-dim views of one buffer, as CUDA's ``_foreach_norm`` returns its results."""
    return list(torch.tensor(values, dtype=dtype).unbind(0))


def test_results_in_one_buffer_are_that_buffer_without_a_copy() -> None:
    results = _as_cuda_returns([3.0, 1.0, 4.0, 1.0, 5.0])
    with _Ops() as ops:
        vector = results_vector([results])
    assert ops.names == ["as_strided"]  # a view: no kernel, no stack
    assert vector.tolist() == [3.0, 1.0, 4.0, 1.0, 5.0]
    assert vector.untyped_storage().data_ptr() == results[0].untyped_storage().data_ptr()


def test_separate_results_are_stacked_as_before() -> None:
    tensors = [torch.randn(n) for n in (3, 70, 5)]
    results = torch._foreach_norm(tensors)  # the CPU's: a tensor each
    assert one_buffer(results) is None
    with _Ops() as ops:
        vector = results_vector([results])
    assert ops.names == ["stack"]
    assert torch.equal(vector, torch.stack(results))


@pytest.mark.parametrize("case", ["longer buffer", "offset", "one result", "other storage in the middle",
                                  "mixed dtypes", "not 0-dim"])
def test_results_that_are_not_exactly_one_buffer_are_stacked(case: str) -> None:
    buf = torch.arange(6, dtype=torch.float32)
    results = {
        "longer buffer": lambda: list(buf.unbind(0))[:5],  # a sixth value lies in the same storage
        "offset": lambda: list(buf.unbind(0))[1:],
        "one result": lambda: [buf[0]],
        "other storage in the middle": lambda: [*list(buf.unbind(0))[:3], torch.tensor(9.0), *list(buf.unbind(0))[4:]],
        "mixed dtypes": lambda: [buf[0], torch.tensor(1.0, dtype=torch.float64), buf[5]],
        "not 0-dim": lambda: [buf[0:1], buf[1:2]],
    }[case]()
    assert one_buffer(results) is None
    if case == "other storage in the middle":
        # The middle is checked: [0, 1, 2, 9, 4, 5] must not read as the buffer [0..5].
        assert results_vector([results]).tolist() == [0.0, 1.0, 2.0, 9.0, 4.0, 5.0]
    if case != "not 0-dim":
        assert torch.equal(results_vector([results]), torch.stack(results))


def test_several_calls_keep_their_order_and_stacks_dtype() -> None:
    """Views and separate results mixed: one vector in the calls' order, the loose ones of
    consecutive calls in one stack, the dtype ``torch.stack`` of every result gives (float64 when
    any is), the values exact."""
    norms64 = _as_cuda_returns([1.5, 2.5], torch.float64)
    loose = [torch.tensor(7.0), torch.tensor(8.0)]
    more_loose = [torch.tensor(9.0, dtype=torch.bfloat16)]
    norms32 = _as_cuda_returns([0.1, 0.2, 0.3])
    parts = [norms64, loose, more_loose, norms32]
    with _Ops() as ops:
        vector = results_vector(parts)
    expected = torch.stack([v for part in parts for v in part])
    assert vector.dtype == expected.dtype == torch.float64
    assert torch.equal(vector, expected)
    assert sorted(ops.names) == ["as_strided", "as_strided", "cat", "stack"]


def test_no_results_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="at least one result"):
        results_vector([])


@pytest.mark.parametrize("accum", [1, 3])
def test_every_metric_and_the_noise_scale_from_results_laid_out_as_on_cuda(accum: int) -> None:
    """The accelerator formulations with ``_foreach_norm``'s results laid out as CUDA returns
    them (``bench/agent_overhead.py``'s ``accelerator_paths``): every step metric, the per-layer
    values and the noise scale of accumulated steps against float64 references. Taking a
    result's buffer at the wrong place (an offset, another call's) fails it."""
    torch.manual_seed(3)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    capture = Capture(model)
    agent = attach(model, opt, report_every=2, update_ratio="every")
    try:
        with _bench("agent_overhead").accelerator_paths():
            records = train(agent, model, opt, 4, accum=accum, capture=capture)
        got = agent.latest()
        assert got["trainguard_agent_errors_total"] == 0
        if accum > 1:
            assert_step_and_noise_scale(got, records[-1])
        else:
            assert_close(got, reference(records[-1]))
    finally:
        agent.close()
