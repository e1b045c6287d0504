"""Layouts whose ranks hold different values by design (``trainer_agent/measure/fingerprint_layouts.py``),
on real gloo ranks: post-local SGD (DDP's hook, PostLocalSGDOptimizer's averaging), FSDP1 and expert layers
held as plain tensors are not reported desynchronised, each says so once in a warning, and a one-rank
corruption of a parameter that is compared is still found and names that rank."""

from __future__ import annotations

import gc
import logging
import os
from datetime import timedelta
from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.control.spawn import spawn_ranks

STEPS = 60
#: Step at which rank 1 corrupts one element of a compared parameter (the expert-layer test).
CORRUPT = 41


def _model(mode: str, rank: int) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    """(the module trained, the inner model, the optimizer given to attach, the one stepped)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    if mode == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        wrapped = FSDP(model, device_id=torch.device("cpu"))  # use_orig_params=False: FlatParameters
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
        return wrapped, model, opt, opt
    if mode == "experts":  # layer 2 an expert of each rank's own (its own init, its gradients never reduced)
        with torch.no_grad():
            model[2].weight.copy_(torch.randn(model[2].weight.shape, generator=torch.Generator().manual_seed(rank)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return model, model, opt, opt
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    ddp = nn.parallel.DistributedDataParallel(model)
    inner = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    ddp.register_comm_hook(PostLocalSGDState(process_group=None, subgroup=dist.new_subgroups(group_size=1)[0],
                                             start_localSGD_iter=10), post_localSGD_hook)
    outer = PostLocalSGDOptimizer(optim=inner, averager=PeriodicModelAverager(period=10, warmup_steps=10))
    return ddp, model, inner, outer


def _worker(mode: str, world: int, rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    import trainer_agent as ta

    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("trainer_agent").addHandler(handler)
    trained, model, given, stepped = _model(mode, rank)
    config = ta.AgentConfig(metrics_port=None, report_every=5, layer_depth=1,
                            rank_local_params=("2",) if mode == "experts" else ())
    agent = ta.attach(trained, given, job="layouts", run="layouts-" + mode, config=config)
    target = torch.randn(16, 1, generator=torch.Generator().manual_seed(1))
    seen, apart = [], []
    for step in range(1, STEPS + 1):
        x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1000 * step + rank))
        loss = (trained(x) - x @ target).square().mean()
        loss.backward()
        if mode == "experts":  # data parallelism by hand for the shared layer, the expert left alone
            for p in model[0].parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        stepped.step()
        stepped.zero_grad()
        if mode == "experts" and rank == 1 and step == CORRUPT:
            with torch.no_grad():
                model[0].weight[3, 4] += 1e-2 * float(model[0].weight.norm())
        agent.end_step(loss.detach())
        if step % 5 == 0:
            agent.latest()
            seen.append((step, [(d.kind, d.layer, d.ranks) for d in agent.desync],
                         agent.rank_values.get("grad_desync"), agent.rank_values.get("param_desync")))
            local = torch.cat([p.detach().reshape(-1) for p in trained.parameters()])
            gathered = [torch.zeros_like(local) for _ in range(world)]
            dist.all_gather(gathered, local)
            apart.append(float((gathered[0] - gathered[1]).abs().max()))
    torch.save({"seen": seen, "apart": apart, "warnings": [w for w in warnings if "by design" in w or "FSDP1" in w
                                                            or "rank-local" in w]}, f"{out}/rank{rank}.pt")
    agent.close()
    del agent, trained
    gc.collect()
    dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["localsgd", "fsdp1"])
def test_ranks_that_differ_by_design_are_not_reported_desynchronised(tmp_path, mode: str) -> None:
    out = spawn_ranks(partial(_worker, mode, 2), 2, tmp_path, timeout=240)
    assert max(out[0]["apart"]) > 1e-4  # the ranks' values do differ (what the comparison would flag)
    for rank in out:
        assert len(rank["warnings"]) == 1  # said once, at attach
        assert ("post-local SGD" if mode.startswith("localsgd") else "FSDP1") in rank["warnings"][0]
    assert all(found == [] for _, found, _, _ in out[0]["seen"])
    assert all(grad is None and param is None for _, _, grad, param in out[0]["seen"])  # nothing left to compare


@pytest.mark.distributed
def test_declared_rank_local_layers_are_left_out_and_a_corrupted_rank_is_still_found(tmp_path) -> None:
    out = spawn_ranks(partial(_worker, "experts", 3), 3, tmp_path, timeout=240)
    assert all(len(rank["warnings"]) == 1 and "rank-local" in rank["warnings"][0] for rank in out)
    before = [s for s in out[0]["seen"] if s[0] < CORRUPT]
    assert before and all(found == [] and max(param) == 0.0 for _, found, _, param in before)
    after = [s for s in out[0]["seen"] if s[0] > CORRUPT]
    assert after and all(("param", "0", (1,)) in found for _, found, _, _ in after)
    assert all(param[1] > 1e-3 and param[0] == param[2] == 0.0 for _, _, _, param in after)


def test_a_rank_local_prefix_that_names_no_parameter_is_refused() -> None:
    from trainer_agent.config import AgentConfig
    from trainer_agent.measure.fingerprint_layouts import rank_local

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    params = list(model.parameters())
    assert rank_local(model, params, ("1",)).left_out == frozenset({2, 3})
    assert rank_local(model, params, ()).left_out == frozenset()
    with pytest.raises(ValueError, match="names no parameter"):
        rank_local(model, params, ("1.weigh",))
    for bad in ("blocks", ("",), (".x",), (3,), ["a", None]):
        with pytest.raises(ValueError, match="rank_local_params"):
            AgentConfig(rank_local_params=bad)  # type: ignore[arg-type]
    assert AgentConfig(rank_local_params=["a.b"]).rank_local_params == ("a.b",)
