"""The optimizer commands (``trainer_agent/control/optimizer_actuators.py``) on 2 gloo ranks, under DDP and
FSDP2: a controller (the in-process fake, on rank 0) sets ``grad_clip_norm``, then
``momentum_scale`` with ``weight_decay_scale`` (the clipping ended), then ``reset_optimizer`` of
the layer ``0.`` (a text field: the non-leader reads the name from the store). Each rank records
every step in full (parameters, gradients and AdamW state before and after, gathered from the
shards under FSDP2) and the state in force; the test recomputes every step with a fresh
``torch.optim.AdamW`` built with the scaled beta1 and weight decay, from the recorded state, on
the recorded gradients clipped by a global norm it computes itself. So a command changes
training exactly from the step after the one every rank applied it at, and never before."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.control.procs import until
from tests.control.spawn import spawn_ranks

pytestmark = pytest.mark.distributed

WORLD = 2
LR, BETAS, WD = 1e-2, (0.9, 0.99), 0.1
CLIP = 0.05  # well below the gradient norm (about 1): the clipping binds
MOMENTUM, DECAY = 0.5, 3.0
STEPS = 18
#: step -> the command the leader gives before that step's end (it waits until its client has it,
#: so every rank applies it at that step's end and it is in force from the next step)
COMMANDS = {
    3: {"grad_clip_norm": CLIP},
    7: {"grad_clip_norm": 0.0, "momentum_scale": MOMENTUM, "weight_decay_scale": DECAY},
    11: {"reset_optimizer_seq": 1, "reset_optimizer_layers": "0."},
    14: {"momentum_scale": 1.0, "weight_decay_scale": 1.0},
}


def _full(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)  # a DTensor (FSDP2): gathered from every rank's shard
    return (full() if full is not None else t).detach().clone()


def _opt_state(opt: torch.optim.Optimizer, params: list[nn.Parameter]) -> list[dict[str, torch.Tensor] | None]:
    return [{k: _full(v) for k, v in sorted(opt.state[p].items())} if p in opt.state else None for p in params]


def _worker(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    import os

    import trainer_agent as ta
    from tests.control.fake_controller import finish_rank, rank_controller

    mode = os.environ["TG_TEST_PARALLEL"]
    fake, url = rank_controller(rank)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    if mode == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (WORLD,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WD)
    agent = ta.attach(model, opt, job="opt-cmd", run=f"opt-cmd-{mode}", controller=url,
                      config=ta.AgentConfig(metrics_port=None, report_every=1, request_timeout_s=5.0))
    g = torch.Generator().manual_seed(rank)
    rows = []
    for step in range(1, STEPS + 1):
        x = torch.randn(16, 8, generator=g)
        loss = (model(x) - x.sum(1, keepdim=True)).square().mean()
        loss.backward()
        in_force = agent.control.applied
        row = {"step": step, "in_force": {k: getattr(in_force, k) for k in
                                          ("grad_clip_norm", "momentum_scale", "weight_decay_scale")},
               "before": [_full(p) for p in params], "grads": [_full(p.grad) for p in params],
               "state_before": _opt_state(opt, params)}
        opt.step()
        row.update(after=[_full(p) for p in params], state_after=_opt_state(opt, params),
                   groups=[(tuple(gr["betas"]), gr["weight_decay"], gr["lr"]) for gr in opt.param_groups],
                   saved_groups=[(tuple(gr["betas"]), gr["weight_decay"]) for gr in opt.state_dict()["param_groups"]])
        opt.zero_grad()
        if fake is not None and step in COMMANDS:
            generation = fake.command(f"opt-cmd-{mode}", **COMMANDS[step], reason="test").generation
            assert until(lambda: (d := agent.control.client.desired) is not None and d.generation >= generation, 30.0)
        agent.end_step(loss.detach())
        rows.append(row)
    res = {"rows": rows, "names": names,
           "history": [(h.generation, h.step, h.desired.reset_optimizer_layers, h.desired.grad_clip_norm)
                       for h in agent.control.history],
           "values": agent.control.values()}
    finish_rank(agent, fake, res, out, rank)


def _clipped(grads: list[torch.Tensor], max_norm: float) -> list[torch.Tensor]:
    if max_norm <= 0:
        return grads
    norm = math.sqrt(sum(float(gr.double().square().sum()) for gr in grads))  # the global norm, by hand
    coef = min(1.0, max_norm / (norm + 1e-6))
    return [gr * coef for gr in grads]


def _reference_step(row: dict) -> tuple[list[torch.Tensor], list[dict]]:
    """One step of a fresh AdamW with the in-force multipliers, from the recorded state."""
    f = row["in_force"]
    params = [nn.Parameter(p.clone()) for p in row["before"]]
    beta1 = min(BETAS[0] * f["momentum_scale"], 0.999)
    ref = torch.optim.AdamW(params, lr=LR, betas=(beta1, BETAS[1]), weight_decay=WD * f["weight_decay_scale"])
    for p, gr, st in zip(params, _clipped(row["grads"], f["grad_clip_norm"]), row["state_before"]):
        p.grad = gr.clone()
        if st is not None:
            ref.state[p] = {k: v.clone() for k, v in st.items()}
    ref.step()
    return [p.detach() for p in params], [{k: v for k, v in sorted(ref.state[p].items())} for p in params]


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_optimizer_commands_change_training_from_the_agreed_step_on_every_rank(tmp_path, monkeypatch, parallel) -> None:
    monkeypatch.setenv("TG_TEST_PARALLEL", parallel)
    out = spawn_ranks(_worker, WORLD, tmp_path, timeout=240.0)
    # every command applied at the end of the step it was given at, on both ranks; the non-leader
    # got the reset's layer names (a text) from the store
    applied = [[(s, layers, clip) for _, s, layers, clip in o["history"]] for o in out]
    assert applied[0] == applied[1]
    assert [s for s, _, _ in applied[0]] == sorted(COMMANDS)
    assert applied[1][2] == (11, "0.", 0.0) and applied[1][0] == (3, "", CLIP)
    names = out[0]["names"]
    reset = [n.removeprefix("module.").startswith("0.") for n in names]
    assert sum(reset) == 2
    for o in out:
        rows = o["rows"]
        expected_in_force = {"grad_clip_norm": 0.0, "momentum_scale": 1.0, "weight_decay_scale": 1.0}
        for row in rows:
            assert row["in_force"] == expected_in_force, row["step"]
            if row["step"] in COMMANDS:
                expected_in_force = {**expected_in_force, **{k: v for k, v in COMMANDS[row["step"]].items()
                                                             if k in expected_in_force}}
            want_params, want_state = _reference_step(row)
            for name, got, want in zip(names, row["after"], want_params):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=lambda m: f"step {row['step']} {name}: {m}")
            for got, want in zip(row["state_after"], want_state):
                assert got.keys() == want.keys()
                for k in got:
                    torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-8)
            # the groups hold the run's own values outside the step (scheduler, checkpoints)
            assert row["groups"] == [(BETAS, WD, LR)] and row["saved_groups"] == [(BETAS, WD)]
        # the reset at the end of step 11: the named layers' state is gone (the step after starts
        # it afresh: step count 1), the others' is the same tensors' values as before
        after11, before12 = rows[10]["state_after"], rows[11]["state_before"]
        for is_reset, a, b in zip(reset, after11, before12):
            if is_reset:
                assert b is None and rows[11]["state_after"][reset.index(True)]["step"].item() == 1.0
            else:
                assert all(torch.equal(a[k], b[k]) for k in a) and b["step"].item() == 11.0
        assert o["values"]["trainguard_optimizer_resets_total"] == 1.0
        assert o["values"]["trainguard_optimizer_reset_parameters"] == 2.0
        assert o["values"]["trainguard_grad_clip_norm"] == 0.0 and o["values"]["trainguard_momentum_scale"] == 1.0
    # the clipping changed the steps it was in force for: its reference without clipping differs
    row = out[0]["rows"][4]
    assert row["in_force"]["grad_clip_norm"] == CLIP
    unclipped = _reference_step({**row, "in_force": {**row["in_force"], "grad_clip_norm": 0.0}})[0]
    assert not all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(row["after"], unclipped))


def test_the_clipping_norm_counts_sparse_gradients() -> None:
    """``global_grad_norm`` with a sparse embedding gradient (repeated indices: not coalesced)
    beside dense ones, against the norm of their dense forms; clipping with it leaves the whole
    gradient at the clipping norm (``torch.nn.utils.get_total_norm`` raises on a sparse tensor)."""
    from trainer_agent.control.optimizer_actuators import global_grad_norm

    torch.manual_seed(0)
    emb, lin = nn.Embedding(20, 4, sparse=True), nn.Linear(4, 3)
    lin(emb(torch.tensor([[1, 1, 5], [5, 7, 1]]))).square().sum().backward()
    params = [emb.weight, lin.weight, lin.bias]
    assert emb.weight.grad.is_sparse and not emb.weight.grad.is_coalesced()
    want = math.sqrt(sum(float(p.grad.to_dense().double().square().sum()) for p in params))
    norm = global_grad_norm([p.grad for p in params])
    assert math.isclose(float(norm), want, rel_tol=1e-6)
    torch.nn.utils.clip_grads_with_norm_(params, 0.5, norm)
    clipped = math.sqrt(sum(float(p.grad.to_dense().double().square().sum()) for p in params))
    assert math.isclose(clipped, 0.5, rel_tol=1e-5)
    dense_only = [lin.weight.grad, lin.bias.grad]
    assert torch.equal(global_grad_norm(dense_only), torch.nn.utils.get_total_norm(dense_only))


def test_the_controllers_clipping_of_a_fused_optimizer_under_a_grad_scaler_clips_the_unscaled_norm() -> None:
    """A fused SGD unscales in its kernel, so in the pre-step hook its gradients still carry the
    loss scale (2^12): the clip norm is the unscaled gradients', and the step equals the unfused
    one, whose gradients the scaler unscaled first (clipped as scaled, they moved 4096x too little)."""
    from trainer_agent.control.actuators import ActuatorEnv
    from trainer_agent.control.optimizer_actuators import GradClip

    def step(fused: bool) -> tuple[list[torch.Tensor], float]:
        torch.manual_seed(0)
        model = nn.Linear(6, 4)
        before = [p.detach().clone() for p in model.parameters()]
        opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=fused)
        clip = GradClip(ActuatorEnv(optimizer=opt, leader=False, on_error=lambda kind, exc: None))
        clip.max_norm = 0.05
        opt.register_step_pre_hook(lambda o, a, k: clip.before_step())
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
        scaler.scale(model(torch.randn(8, 6, generator=torch.Generator().manual_seed(1))).square().mean()).backward()
        norm = math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters())) / 2.0**12
        scaler.step(opt)
        return [(b - p.detach()) / 0.1 for b, p in zip(before, model.parameters())], norm

    (fused, norm), (plain, _) = step(True), step(False)
    assert norm > 0.05  # the clip applies
    applied = math.sqrt(sum(float(g.double().square().sum()) for g in fused))
    assert math.isclose(applied, 0.05, rel_tol=1e-4)
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)
