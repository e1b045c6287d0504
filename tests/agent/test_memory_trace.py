"""Memory-leak localisation (``trainer_agent/diagnostics/memory_trace.py``): the guide's own example, a loop
that keeps every loss with its graph, is charged to the loop; a layer whose activation cache grows
is charged to that layer; a healthy loop retains nothing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import trainer_agent as ta
from trainer_agent.diagnostics.memory_trace import GRAPH


class Cache(nn.Module):
    """Keeps a detached copy of every input it sees (a leak inside a layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.kept.append(x.detach())
        return x


def _run(kind: str, steps: int = 3) -> tuple[list, int]:
    torch.manual_seed(0)
    width, batch = 256, 64
    model = nn.Sequential(nn.Linear(width, width), nn.Tanh(), Cache() if kind == "cache" else nn.Identity(),
                          nn.Linear(width, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = ta.attach(model, opt, job="m", run="m-1", config=ta.AgentConfig(metrics_port=None))
    kept = []
    for step in range(6):
        if step == 1:
            agent.trace_memory(steps=steps)
        x = torch.randn(batch, width)
        loss = model(x).square().mean()
        loss.backward(retain_graph=kind == "loss")  # "loss_nodes": backward frees the saved activations
        opt.step()
        opt.zero_grad()
        if kind in ("loss", "loss_nodes"):
            kept.append(loss)  # the loss with its whole graph (retained: its saved activations too)
        agent.end_step(loss.detach())
    report = agent.memory_report
    agent.close()
    return report, batch * width * 4


def test_a_loop_keeping_losses_with_their_graphs_is_charged_to_the_loop() -> None:
    report, activation = _run("loss")
    top = report[0]
    assert top.owner == GRAPH
    # Each kept graph holds at least the saved activations of the step: the tanh output and the
    # input of the second linear (64 x 256 float32 each; the input x is created in the loop).
    assert top.bytes_per_step >= 2 * activation
    assert all(r.owner not in ("0", "1", "2", "3") or r.bytes_per_step < 0.1 * top.bytes_per_step for r in report)


def test_a_layer_caching_its_activations_is_charged_to_that_layer() -> None:
    report, activation = _run("cache")
    top = report[0]
    assert top.owner == "1"  # Tanh creates the storage the cache keeps a view of
    assert top.bytes_per_step == pytest.approx(activation, rel=0.01)
    assert all(r.owner != GRAPH for r in report)


def test_a_healthy_loop_retains_nothing_that_grows() -> None:
    report, activation = _run("healthy")
    assert report is not None
    assert sum(r.bytes_per_step for r in report) < 0.1 * activation


def test_losses_kept_after_backward_still_name_the_loop() -> None:
    report, _ = _run("loss_nodes", steps=3)
    assert report[0].owner == GRAPH and report[0].tensors == 3  # one kept loss (with its graph's nodes) per step


def test_tensors_without_memory_left_in_the_process_do_not_end_the_trace() -> None:
    """torch.compile's tracing leaves FunctionalTensors and FakeTensors among the process's
    objects, which the census walks. A FunctionalTensor's storage refuses its data pointer: the
    trace ended at the first one ("memory_trace failed", no report). They are now passed by (a
    FakeTensor's pointer reads 0, with a warning), and the loop is charged as before."""
    import warnings

    from torch._subclasses.fake_tensor import FakeTensorMode

    functional = [torch._to_functional_tensor(torch.ones(1024)) for _ in range(4)]
    with pytest.raises(RuntimeError):
        functional[0].untyped_storage().data_ptr()  # what the census met
    with FakeTensorMode():
        fakes = [torch.empty(1024, 1024) for _ in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the census's own reads warn nothing
        report, activation = _run("loss")
    assert report is not None and report[0].owner == GRAPH and report[0].bytes_per_step >= 2 * activation
    assert len(functional) == len(fakes) == 4  # (alive through the trace)
