"""The ``torch.distributed.checkpoint`` snapshot backend (``trainer_agent/control/dcp_snapshots.py``).

- One process: a save is a copy taken before ``save`` returns (the weights changed right after it
  do not leak into the snapshot), a load right after the save (its write still pending) restores
  the model and optimizer state bitwise, a drop right after a save removes the directory for good.
- FSDP2 on 2 gloo ranks, the agent attached with the backend, the writes running beside the next
  steps: the step directories on disk (listed at two steps) are exactly the snapshots the
  retention rule keeps, and ``restore`` brings back on each rank the
  local shards of the parameters and of the optimizer state that rank had right after the
  snapshot's step, bitwise.
"""

from __future__ import annotations

import gc
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.control.spawn import spawn_ranks
from trainer_agent.control.dcp_snapshots import DcpSnapshots
from trainguard.protocol.retention import retained

WORLD = 2


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """This rank's own part of the parameters and optimizer state, copied."""
    return {"params": [_local(p) for p in model.parameters()],
            "opt": [{k: _local(v) if isinstance(v, torch.Tensor) else v for k, v in opt.state[p].items()}
                    for p in model.parameters()],
            "lr": [g["lr"] for g in opt.param_groups]}


def _equal(a: dict, b: dict) -> bool:
    if a["lr"] != b["lr"] or len(a["params"]) != len(b["params"]) or len(a["opt"]) != len(b["opt"]):
        return False
    if not all(torch.equal(x, y) for x, y in zip(a["params"], b["params"])):
        return False
    for x, y in zip(a["opt"], b["opt"]):
        if x.keys() != y.keys():
            return False
        for k in x:
            same = torch.equal(x[k], y[k]) if isinstance(x[k], torch.Tensor) else x[k] == y[k]
            if not same:
                return False
    return True


def _step(model: nn.Module, opt: torch.optim.Optimizer, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(16, 8, generator=g)
    loss = (model(x) - x.sum(1, keepdim=True)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def test_save_copies_before_returning_and_load_restores_bitwise(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        _step(model, opt, g)
    snaps = DcpSnapshots(tmp_path / "snaps", model, opt)
    saved = _state(model, opt)
    handle = snaps.save(3)
    with torch.no_grad():  # changed while the write may still be running: not in the snapshot
        for p in model.parameters():
            p.add_(1.0)
    for _ in range(4):
        _step(model, opt, g)
    opt.param_groups[0]["lr"] = 0.5
    assert not _equal(_state(model, opt), saved)
    snaps.load(handle)
    assert _equal(_state(model, opt), saved)
    assert sorted(os.listdir(handle)) == [".metadata", "__0_0.distcp"]
    # Training goes on from the restored state exactly as from the original.
    twin = _model()
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    g2 = torch.Generator().manual_seed(1)
    for _ in range(3):
        _step(twin, twin_opt, g2)
    g3, g4 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    for _ in range(2):
        _step(model, opt, g3)
        _step(twin, twin_opt, g4)
    assert _equal(_state(model, opt), _state(twin, twin_opt))
    snaps.drop(handle)
    assert not os.path.exists(handle)
    snaps.close()


def test_a_drop_while_the_write_is_pending_removes_the_directory_for_good(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt, torch.Generator().manual_seed(1))
    snaps = DcpSnapshots(tmp_path / "snaps", model, opt)
    first, second = snaps.save(5), snaps.save(10)  # the second save waits for the first write
    snaps.drop(second)
    snaps.close()
    assert sorted(os.listdir(tmp_path / "snaps")) == [Path(first).name]
    snaps.drop(first)
    assert os.listdir(tmp_path / "snaps") == []


def test_a_failed_write_is_counted_and_its_snapshot_refuses_to_load(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt, torch.Generator().manual_seed(1))
    snaps = DcpSnapshots(tmp_path / "snaps", model, opt)
    (tmp_path / "snaps" / "step-000000005").write_text("in the way")  # the write cannot make its directory
    bad = snaps.save(5)
    saved = _state(model, opt)
    good = snaps.save(10)  # the failed write does not fail the next save
    assert snaps.failed_writes == 1
    _step(model, opt, torch.Generator().manual_seed(2))
    with pytest.raises(RuntimeError, match="failed"):
        snaps.load(bad)
    snaps.load(good)
    assert _equal(_state(model, opt), saved)
    snaps.close()


def test_mistakes_are_value_errors(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="directory"):
        DcpSnapshots(3, model, opt)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a directory"):
        DcpSnapshots(tmp_path / "file", model, opt)
    with pytest.raises(ValueError, match="model"):
        DcpSnapshots(tmp_path, opt, opt)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="optimizer"):
        DcpSnapshots(tmp_path, model, model)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout_s"):
        DcpSnapshots(tmp_path, model, opt, timeout_s=0)
    with pytest.raises(ValueError, match="process_group"):
        DcpSnapshots(tmp_path, model, opt, process_group=object())  # type: ignore[arg-type]
    snaps = DcpSnapshots(tmp_path / "snaps", model, opt)
    with pytest.raises(ValueError, match="step"):
        snaps.save(-1)
    with pytest.raises(ValueError, match="handle"):
        snaps.load(str(tmp_path / "elsewhere" / "step-000000005"))
    with pytest.raises(ValueError, match="handle"):
        snaps.drop(5)  # type: ignore[arg-type]


EVERY, KEEP, STEPS = 5, 3, 30
LISTED = (15, 30)


def _fsdp_worker(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    import trainer_agent as ta
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model()
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    snaps = DcpSnapshots(Path(out) / "snaps", model, opt, timeout_s=60.0)
    agent = ta.attach(model, opt, job="dcp", run="dcp-run", snapshot_backend=snaps,
                      config=ta.AgentConfig(metrics_port=None, controller=None, snapshot_every=EVERY,
                                            snapshot_keep=KEEP))
    g = torch.Generator().manual_seed(rank)
    recorded: dict[int, dict] = {}
    on_disk: dict[int, list[str]] = {}
    for step in range(1, STEPS + 1):
        agent.end_step(_step(model, opt, g))
        if step % EVERY == 0:
            recorded[step] = _state(model, opt)
        if step in LISTED:  # elsewhere the writes run beside the next steps (and FSDP's collectives)
            snaps.close()  # this rank's write is done
            dist.barrier()  # and every rank's drops are done: the directories are final
            on_disk[step] = sorted(os.listdir(Path(out) / "snaps"))
    kept = [s.step for s in agent.snapshots.snapshots]
    target = kept[0]
    pre = _state(model, opt)
    restored = agent.snapshots.restore(target)
    after = _state(model, opt)
    snaps.close()
    dist.barrier()
    after_disk = sorted(os.listdir(Path(out) / "snaps"))
    result = {"kept": kept, "restored": restored, "pre": pre, "after": after, "recorded": recorded,
              "on_disk": on_disk, "after_disk": after_disk, "errors": agent.latest()["trainguard_agent_errors_total"],
              "failed_writes": snaps.failed_writes}
    agent.close()
    del agent
    gc.collect()
    dist.destroy_process_group()
    torch.save(result, f"{out}/rank{rank}.pt")


@pytest.mark.distributed
def test_fsdp2_snapshots_on_disk_are_the_kept_ones_and_restore_each_ranks_shards_bitwise(tmp_path: Path) -> None:
    out = spawn_ranks(_fsdp_worker, WORLD, tmp_path, timeout=240.0)
    kept: list[int] = []
    for step in range(EVERY, STEPS + 1, EVERY):
        kept = retained(kept + [step], every=EVERY, keep=KEEP)
        if step in LISTED:
            for o in out:
                assert o["on_disk"][step] == [f"step-{s:09d}" for s in kept], step
    target = kept[0]
    assert len(kept) == KEEP and target < STEPS
    for rank, o in enumerate(out):
        assert o["kept"] == kept and o["restored"] == target
        assert o["errors"] == 0.0 and o["failed_writes"] == 0
        assert _equal(o["after"], o["recorded"][target]), rank
        assert not _equal(o["pre"], o["recorded"][target])  # the restore changed something
        assert o["after_disk"] == [f"step-{target:09d}"]  # the newer snapshots were dropped
    # Each rank holds its own shard: what the ranks restored differs (the test sees real shards).
    assert not torch.equal(out[0]["after"]["params"][0], out[1]["after"]["params"][0])
