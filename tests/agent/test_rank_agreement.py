"""What every rank must hold alike (trainer_agent/report/rank_agreement.py): ranks that measure
different parameters (pipeline stages) or attach with different report settings are refused at
attach on every rank, instead of gathering rows of different widths or at different steps (garbage
on gloo, a hang on NCCL); settings that are a rank's own may differ."""

from __future__ import annotations

import functools
import gc
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

import trainer_agent as ta
from trainer_agent.measure.params import ParamIndex
from trainer_agent.report.rank_agreement import RANK_LOCAL_SETTINGS, config_digest, layout_digest
from tests.control.spawn import spawn_ranks

WORLD = 2

CASES = {
    # rank 0 holds the first two layers of the model, rank 1 the last one (two pipeline stages)
    "pipeline_stages": (lambda rank: [nn.Linear(4, 4), nn.Linear(4, 4)] if rank == 0 else [nn.Linear(4, 2)],
                        lambda rank: {}),
    "report_every": (lambda rank: [nn.Linear(4, 2)], lambda rank: {"report_every": 2 + rank}),
    "controller_on_rank_0_only": (lambda rank: [nn.Linear(4, 2)],
                                  lambda rank: {"controller": "http://127.0.0.1:9" if rank == 0 else None}),
    "rank_local_settings": (lambda rank: [nn.Linear(4, 2)],
                            lambda rank: {"metrics_port": None, "per_layer": "all" if rank else "rank0",
                                          "request_timeout_s": 1.0 + rank, "peak_flops": 1e12 * (rank + 1)}),
}


def _worker(case: str, rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD, timeout=timedelta(seconds=20))
    layers, settings = CASES[case]
    torch.manual_seed(0)
    model = nn.Sequential(*layers(rank))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = {"metrics_port": None, "report_every": 2, **settings(rank)}
    result: dict = {}
    try:
        agent = ta.attach(model, opt, job="agree", run="agree-1", config=ta.AgentConfig(**config))
    except ValueError as exc:
        result["error"] = str(exc)
        result["hooks_left"] = bool(opt._optimizer_step_pre_hooks or model._forward_pre_hooks
                                    or any(p._backward_hooks for p in model.parameters()))
    else:
        for step in range(4):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * step + rank))
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            agent.end_step(loss.detach())
            result.setdefault("losses", []).append(float(loss))
        result["latest"] = agent.latest()
        result["rank_values"] = agent.rank_values
        agent.close()
    torch.save(result, f"{out}/rank{rank}.pt")
    gc.collect()


def _case(case: str) -> functools.partial:
    return functools.partial(_worker, case)  # picklable for the ranks' processes


pytestmark = pytest.mark.distributed


def test_pipeline_stages_are_refused_on_every_rank(tmp_path) -> None:
    out = spawn_ranks(_case("pipeline_stages"), WORLD, tmp_path)
    assert "this rank: 4 tensors in 2 layers, from '0' to '1'" in out[0]["error"]
    assert "this rank: 2 tensors in 1 layers, from '0' to '0'" in out[1]["error"]
    for result in out:
        assert "Pipeline-parallel stages" in result["error"] and not result["hooks_left"]


@pytest.mark.parametrize("case", ["report_every", "controller_on_rank_0_only"])
def test_settings_that_shape_the_report_step_must_agree(tmp_path, case: str) -> None:
    out = spawn_ranks(_case(case), WORLD, tmp_path)
    for result in out:
        assert "attached with different AgentConfig settings" in result["error"], result
        assert "report_every" in result["error"] and not result["hooks_left"]


def test_a_rank_s_own_settings_may_differ_and_the_ranks_report_together(tmp_path) -> None:
    out = spawn_ranks(_case("rank_local_settings"), WORLD, tmp_path)
    for rank, result in enumerate(out):
        assert "error" not in result
        assert result["latest"]["trainguard_step"] == 4
    # the leader holds both ranks' losses of the last report step, as each rank computed them
    assert out[0]["rank_values"]["loss"] == pytest.approx([out[0]["losses"][-1], out[1]["losses"][-1]])


def test_layout_digest_reads_layers_shapes_and_dtypes_not_values() -> None:
    def index(model: nn.Module) -> ParamIndex:
        return ParamIndex(model, torch.optim.SGD(model.parameters(), lr=0.1))

    torch.manual_seed(0)
    first = index(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    torch.manual_seed(1)
    other_values = index(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    assert layout_digest(first) == layout_digest(other_values)
    for different in (nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3)), nn.Sequential(nn.Linear(4, 4)),
                      nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).double()):
        assert layout_digest(index(different)) != layout_digest(first)
    assert 0 <= layout_digest(first) < 2**62


def test_config_digest_leaves_out_a_rank_s_own_settings() -> None:
    base = ta.AgentConfig(metrics_port=None)
    assert config_digest(base) == config_digest(ta.AgentConfig(metrics_port=9500, per_layer="all", token="t",
                                                               request_timeout_s=9.0, controller=None))
    assert config_digest(ta.AgentConfig(metrics_port=None, controller="http://a:1")) == \
        config_digest(ta.AgentConfig(metrics_port=None, controller="http://b:2"))
    for shared in ({"report_every": 5}, {"skip_spikes": True}, {"fingerprint": False}, {"controller": "http://a:1"}):
        assert config_digest(ta.AgentConfig(metrics_port=None, **shared)) != config_digest(base), shared
    assert RANK_LOCAL_SETTINGS <= {f for f in ta.AgentConfig.__dataclass_fields__}
