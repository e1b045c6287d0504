"""Text fields of the desired state across 2 gloo ranks (``trainer_agent/control/plane.py``): the
agreement carries a key, the leader puts the text in the c10d store first.

- While the run is paused, a ``reset_optimizer`` of the layer ``2.`` reaches the non-leader
  through the pause's store publication: both ranks drop the same parameters' optimizer state at
  the paused step.
- A rank that cannot read a text (its store read made to fail) counts an agent error, keeps the
  reset's fields as they were and applies the rest of the same state (the LR multiplier); the loop
  goes on, nothing hangs.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.control.procs import until
from tests.control.spawn import spawn_ranks

pytestmark = pytest.mark.distributed

WORLD = 2
RUN = "texts"


def _worker(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    import trainer_agent as ta
    from tests.control.fake_controller import finish_rank, rank_controller

    fake, url = rank_controller(rank)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    agent = ta.attach(model, opt, job="texts", run=RUN, controller=url,
                      config=ta.AgentConfig(metrics_port=None, report_every=1, request_timeout_s=5.0))
    errors: list[str] = []
    count = agent.control._on_error
    agent.control._on_error = lambda kind, exc: (errors.append(kind), count(kind, exc))

    def seen(generation: int) -> bool:
        return (d := agent.control.client.desired) is not None and d.generation >= generation

    def operator() -> None:  # rank 0, while the main thread waits paused in end_step(3)
        assert until(lambda: agent.control.paused, 30.0)
        g = fake.command(RUN, reset_optimizer_seq=1, reset_optimizer_layers="2.").generation
        assert until(lambda: agent.control.applied_generation >= g, 30.0)
        fake.command(RUN, paused=False)

    g = torch.Generator().manual_seed(rank)
    with_state = []  # after each end_step: which parameters have optimizer state
    for step in range(1, 9):
        x = torch.randn(16, 8, generator=g)
        (model(x) - x.sum(1, keepdim=True)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if step == 3 and fake is not None:
            generation = fake.command(RUN, paused=True).generation
            assert until(lambda: seen(generation), 30.0)
            threading.Thread(target=operator, daemon=True).start()
        if step == 6:
            if rank == 1:  # this rank cannot read the text of the next state
                def unreadable(key: int) -> str:
                    raise ConnectionError("store read failed")
                agent.control._channel.fetch_text = unreadable
            if fake is not None:
                generation = fake.command(RUN, reset_optimizer_seq=2, reset_optimizer_layers="0.", lr_scale=0.5).generation
                assert until(lambda: seen(generation), 30.0)
        agent.end_step(1.0)
        with_state.append([p in opt.state for p in model.parameters()])
    res = {"history": [(h.generation, h.step, h.paused, h.desired.reset_optimizer_seq,
                        h.desired.reset_optimizer_layers, h.lr_scale) for h in agent.control.history],
           "with_state": with_state, "errors": errors, "lr_scale": agent.control.lr_scale,
           "resets": agent.control.values()["trainguard_optimizer_resets_total"]}
    finish_rank(agent, fake, res, out, rank)


def test_a_text_field_reaches_every_rank_and_a_rank_without_it_keeps_that_command(tmp_path) -> None:
    leader, other = spawn_ranks(_worker, WORLD, tmp_path, timeout=180.0)
    paused = [(1, 3, True, 0, "", 1.0), (2, 3, True, 1, "2.", 1.0), (3, 3, False, 1, "2.", 1.0)]
    assert leader["history"] == [*paused, (4, 6, False, 2, "0.", 0.5)]
    # the non-leader: the pause's reset with its layer name; then the text it could not read: the
    # reset kept as it was, the LR multiplier of the same state applied
    assert other["history"] == [*paused, (4, 6, False, 1, "2.", 0.5)]
    for rank in (leader, other):
        assert rank["with_state"][2] == [True, True, False, False]  # layer 2 reset at the paused step 3
        assert rank["with_state"][3] == [True, True, True, True]  # and started afresh by step 4
        assert rank["lr_scale"] == 0.5
    assert leader["with_state"][5] == [False, False, True, True] and leader["resets"] == 2.0
    assert other["with_state"][5] == [True, True, True, True] and other["resets"] == 1.0
    assert "control_text" in other["errors"] and "control_text" not in leader["errors"]
