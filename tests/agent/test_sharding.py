"""Sharded and parallel parameters (DTensors), in real gloo processes: FSDP2 on 2 ranks, HSDP 2x2 on
4 ranks, tensor parallel on 2 ranks.

Every step metric the agent reports is checked against a float64 reference the test builds from
``full_tensor()`` gathers (gradients before the step, weights before and after it, optimizer
state), and ``grad_norm`` against ``clip_grad_norm_``'s total norm. The last step carries a NaN in
one gradient element (on the ranks that hold it): the non-finite counts must count it once.
``skip_nonfinite``: a NaN on a single rank's shard skips the step on every rank. Under FSDP2 with a
real controller, pause / resume / lr-scale / checkpoint / stop at random moments apply at the same
step on every rank, with the LR each rank used equal to the scheduler's times the applied scale.
"""

from __future__ import annotations

import math
import os
from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.control.spawn import spawn_ranks

pytestmark = pytest.mark.distributed

STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 3))


def _parallelize(mode: str, model: nn.Module, world: int) -> bool:
    """Shard ``model`` in place; returns whether the ranks see the same input (tensor parallel)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if mode == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
    elif mode == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)

        mesh = init_device_mesh("cpu", (world,))
        # Layer "4" stays a plain, replicated module.
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        return True
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return False


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().double().clone()


def _by_kind(params: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    from torch.distributed.tensor import DTensor

    return ([p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)])


def _worker(mode: str, world: int, rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    import trainer_agent as ta

    model = _model()
    same_input = _parallelize(mode, model, world)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    agent = ta.attach(model, opt, job="shard", run=f"shard-{mode}",
                      config=ta.AgentConfig(metrics_port=None, report_every=1, layer_depth=1,
                                            per_layer="all", update_ratio="every"))
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    results = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + (0 if same_input else rank))
        x = torch.randn(5, 6, generator=g)
        if step == STEPS - 1 and rank == 0:  # a NaN input: NaN gradients (all of them)
            x[0, 0] = math.nan
        loss = model(x).square().mean()
        loss.backward()
        grads = [_full(p.grad) for p in params]
        before = [_full(p) for p in params]
        # clip_grad_norm_ takes DTensors or plain tensors, not both at once (tensor parallel
        # leaves layer "4" plain): one call per kind, combined.
        clip = math.hypot(*(float(_full(torch.nn.utils.clip_grad_norm_(group, max_norm=1e30)))
                            for group in _by_kind(params) if group))
        opt.step()
        opt.zero_grad()
        after = [_full(p) for p in params]
        state = [_full(t) for p in params for t in opt.state[p].values()]
        agent.end_step(loss)
        results.append({"names": names, "grads": grads, "before": before, "after": after,
                        "state": state, "clip": clip, "latest": agent.latest(),
                        # HSDP and TP replicate some parameters (their fingerprints are compared,
                        # tests/agent/test_fingerprint.py); plain FSDP replicates none.
                        "fingerprinted": agent.reports.fingerprint is not None,
                        "desync": agent.rank_values.get("grad_desync")})
    agent.close()
    dist.destroy_process_group()
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


def _reference(r: dict) -> dict[str, float]:
    def norm(ts: list[torch.Tensor]) -> float:
        return math.sqrt(sum(float(t.square().sum()) for t in ts))

    ref = {
        "trainguard_grad_norm": norm(r["grads"]),
        "trainguard_param_norm": norm(r["after"]),
        "trainguard_update_ratio": norm([a - b for a, b in zip(r["after"], r["before"])]) / norm(r["before"]),
        "trainguard_nonfinite_grads": float(sum(int((~torch.isfinite(g)).sum()) for g in r["grads"])),
        "trainguard_optimizer_state_nonfinite": float(sum(int((~torch.isfinite(t)).sum()) for t in r["state"])),
    }
    for layer in ("0", "2", "4"):
        idx = [i for i, n in enumerate(r["names"]) if n.split(".")[0] == layer]
        key = f'{{layer="{layer}"}}'
        ref[f"trainguard_layer_grad_norm{key}"] = norm([r["grads"][i] for i in idx])
        ref[f"trainguard_layer_param_norm{key}"] = norm([r["after"][i] for i in idx])
        ref[f"trainguard_layer_update_ratio{key}"] = (
            norm([r["after"][i] - r["before"][i] for i in idx]) / norm([r["before"][i] for i in idx]))
    return ref


def _close(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-9)


def _scaler_worker(rank: int, init: str, out: str) -> None:
    """FSDP2 on 2 ranks under a GradScaler not passed to attach: the global gradient norm (each
    rank's share of the sum of squares, summed in the report) against the full tensors'."""
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    import trainer_agent as ta

    model = _model()
    _parallelize("fsdp", model, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    agent = ta.attach(model, opt, job="shard", run="shard-amp", config=ta.AgentConfig(metrics_port=None, report_every=1))
    seen = []
    for step in range(STEPS):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(100 * step + rank))
        loss = model(x).square().mean()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        reference = math.sqrt(sum(float(_full(p.grad).square().sum()) for p in model.parameters()))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        agent.end_step(loss)
        seen.append((reference, agent.latest()))
    found = agent.scaler is scaler
    agent.close()
    dist.destroy_process_group()
    torch.save({"seen": seen, "found": found}, os.path.join(out, f"rank{rank}.pt"))


def test_a_grad_scaler_found_at_its_first_step_unscales_the_sharded_norm(tmp_path) -> None:
    for r in spawn_ranks(_scaler_worker, 2, tmp_path, timeout=240.0):
        assert r["found"]
        for reference, latest in r["seen"]:
            assert latest["trainguard_grad_norm"] == pytest.approx(reference, rel=1e-6)
            assert latest["trainguard_grad_norm_max"] == pytest.approx(reference, rel=1e-6)  # from the shares
            assert latest["trainguard_loss_scale"] == 2.0**12 and latest["trainguard_agent_errors_total"] == 0


@pytest.mark.parametrize("mode,world", [("fsdp", 2), ("hsdp", 4), ("tp", 2)])
def test_every_metric_equals_the_full_tensor_reference(mode: str, world: int, tmp_path) -> None:
    ranks = spawn_ranks(partial(_worker, mode, world), world, tmp_path, timeout=240.0)
    for step in range(STEPS):
        rows = [r[step] for r in ranks]
        ref = _reference(rows[0])
        for rank, row in enumerate(rows):
            latest = row["latest"]
            assert latest["trainguard_agent_errors_total"] == 0.0
            assert "trainguard_grad_noise_scale" not in latest  # absent rather than wrong
            assert row["fingerprinted"] == (mode != "fsdp")
            # Plain FSDP compares nothing: no desync vector (NaN on the wire), never a false "in sync";
            # the leader holds the comparison (the other ranks their own row values only).
            assert (row["desync"] is None) == (mode == "fsdp" or rank != 0)
            if step < STEPS - 1:
                assert _close(latest["trainguard_grad_norm"], row["clip"]), (mode, rank, step)
            else:  # the NaN step: clip_grad_norm_'s total norm and ours are both NaN
                assert math.isnan(row["clip"]) and math.isnan(latest["trainguard_grad_norm"])
                assert latest["trainguard_nonfinite_grads"] > 0
                assert latest["trainguard_nonfinite_steps_total"] == 1.0
            for key, value in ref.items():
                assert _close(latest[key], value), (mode, rank, step, key, latest[key], value)


def _skip_worker(mode: str, world: int, rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    import trainer_agent as ta
    from trainer_agent.measure.sharding import local

    model = _model()
    same_input = _parallelize(mode, model, world)
    params = list(model.parameters())
    engine = torch.autograd.Variable._execution_engine
    inject = [False]

    def put_nan() -> None:  # at the end of backward, after FSDP2's reduce-scatter, before the agent
        if inject[0]:
            local(params[2].grad).view(-1)[-1] = math.nan

    def on_output_grad(grad: torch.Tensor) -> None:
        engine.queue_callback(lambda: engine.queue_callback(put_nan))

    # Registered before attach, so its end-of-backward callback runs before the agent's.
    model.register_forward_hook(lambda m, args, out: out.register_hook(on_output_grad) and None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = ta.attach(model, opt, job="shard", run=f"skip-{mode}",
                      config=ta.AgentConfig(metrics_port=None, report_every=2, skip_nonfinite=True))
    changed = []
    for step in range(4):
        g = torch.Generator().manual_seed(100 * step + (0 if same_input else rank))
        inject[0] = step == 2 and rank == world - 1  # a NaN on the last rank's shard only
        loss = model(torch.randn(5, 6, generator=g)).square().mean()
        loss.backward()
        assert bool(torch.isfinite(_full(params[2].grad)).all()) == (step != 2)  # the NaN is there
        before = [_full(p) for p in params]
        opt.step()
        opt.zero_grad()
        changed.append(any(not torch.equal(b, _full(p)) for b, p in zip(before, params)))
        agent.end_step(loss)
    finite = all(bool(torch.isfinite(_full(p)).all()) for p in params)
    latest = agent.latest()
    agent.close()
    dist.destroy_process_group()
    torch.save({"changed": changed, "finite": finite, "latest": latest}, os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.parametrize("mode,world", [("fsdp", 2), ("tp", 2)])
def test_skip_nonfinite_skips_the_same_step_on_every_rank(mode: str, world: int, tmp_path) -> None:
    ranks = spawn_ranks(partial(_skip_worker, mode, world), world, tmp_path, timeout=240.0)
    for r in ranks:
        assert r["changed"] == [True, True, False, True]
        assert r["finite"]
        assert r["latest"]['trainguard_skipped_steps_total{reason="nonfinite"}'] == 1.0
        assert r["latest"]["trainguard_agent_errors_total"] == 0.0


def test_controller_commands_apply_at_the_same_step_on_every_fsdp_rank(tmp_path) -> None:
    import json
    import random

    from tests.control.procs import ControllerProcess, Ranks
    from tests.control.test_control_distributed import _check_lr, _check_same_on_every_rank, _drive

    ctl = ControllerProcess(tmp_path / "ctl.db").start()
    trials, prefix = 4, "fsdp-trials"
    ranks = Ranks(2, {"scenario": "trials", "parallel": "fsdp", "controller": ctl.url, "prefix": prefix,
                      "trials": trials, "max_steps": 4000, "jitter_s": 0.004}, tmp_path)
    rng = random.Random(7)
    try:
        for k in range(trials):
            _drive(ctl, ranks, f"{prefix}-{k}", rng)
        codes = ranks.wait(180)
    finally:
        ranks.kill()
        ctl.kill()
    assert codes == [0, 0], ranks.output()
    per_rank = [json.loads((tmp_path / f"trials-rank{r}.json").read_text()) for r in range(2)]
    for k in range(trials):
        logs = [per_rank[r][k] for r in range(2)]
        _check_same_on_every_rank(logs)
        for log in logs:
            assert _check_lr(log) == []
            assert log["stopped"] and log["history"][-1][5], log["run"]
