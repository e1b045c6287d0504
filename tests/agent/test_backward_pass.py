"""The noise scale's incoming gradients (``trainer_agent/measure/backward_pass.py``): taken in a few
fused norms per backward pass, never one per tensor, where ``.grad`` keeps them until the pass's
end, and at once where DDP rebinds ``.grad`` during the pass; the noise scale against a float64
reference of every rank's local gradients, on two real gloo ranks."""

from __future__ import annotations

import gc
import math
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.control.spawn import spawn_ranks
from trainer_agent.measure.backward_pass import BackwardPass

WORLD, TOKENS, STEPS, LAYERS = 2, 16, 4, 6


def test_fresh_gradients_are_normed_from_grad_in_one_call_per_bucket() -> None:
    params = [nn.Parameter(torch.zeros(n)) for n in (3, 5, 4)]
    incoming = [torch.arange(float(n)) + 1 for n in (3, 5, 4)]
    bp = BackwardPass(2, lambda dtype: torch.float64)
    for i, p in enumerate(params):
        bp.fresh(i, incoming[i])
        p.grad = incoming[i]  # what autograd does: the incoming tensor moved in
    bp.norm_fresh(params, bucket_of=[0, 1, 0])
    got = sorted(float(n) for part in bp.norms for n in part)
    assert got == pytest.approx(sorted(float(g.double().norm()) for g in incoming), rel=1e-12)
    assert [len(part) for part in bp.norms] == [2, 1] and not bp.missed  # one fused call per bucket

    bp.clear()
    flat = torch.zeros(12)
    for i, p in enumerate(params):
        bp.fresh(i, incoming[i])
    params[1].grad = flat[3:8]  # rebound to a view of other memory (a DDP bucket): not the incoming one
    bp.norm_fresh(params, bucket_of=[0, 1, 0])
    assert bp.missed and bp.norms == []
    assert bp.rebound  # a DDP with bucket views the agent was not given: at once from the next pass on
    bp.begin(first_step=False)
    assert not bp.grads_stay
    bp.rebound = False
    bp.begin(first_step=False)
    assert bp.grads_stay

    bp.clear()
    bp.fresh(0, incoming[0])
    params[0].grad = incoming[0].clone()  # a copy that is no view: autograd could not move it in
    bp.fresh(2, incoming[2])
    params[2].grad = None  # gone (an optimizer stepping in backward): missed, not a made-up norm
    bp.norm_fresh(params, bucket_of=[0, 1, 0])
    assert bp.missed and not bp.rebound


def _worker(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    import trainer_agent as ta
    from trainer_agent.measure import backward_pass

    variant = Path(out, "variant").read_text()
    at_once = [0]
    norm = backward_pass.BackwardPass.norm

    def counted(self, grad):  # the per-tensor path
        at_once[0] += 1
        norm(self, grad)

    backward_pass.BackwardPass.norm = counted
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(LAYERS)])
    ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=variant.endswith("bucket_view"),
                                              static_graph=variant == "static_graph", bucket_cap_mb=0.0001)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    local: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        p.register_hook(lambda g, name=name: local.__setitem__(name, g.detach().double().clone()))
    # "inner_bucket_view": attached to the module inside the DDP wrapper, as a framework's callback is
    agent = ta.attach(model if variant.startswith("inner") else ddp, opt, job="ddp", run="ddp-fresh",
                      config=ta.AgentConfig(metrics_port=None, report_every=1))
    steps = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        loss = ddp(torch.randn(8, 4, generator=g)).square().mean()
        before = at_once[0]
        loss.backward()
        reduced = {n: p.grad.double().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()  # set_to_none: every first incoming gradient goes into an empty .grad
        agent.end_step(loss, tokens=TOKENS)
        gathered: list[dict[str, torch.Tensor]] = [None] * WORLD  # type: ignore[list-item]
        dist.all_gather_object(gathered, local)
        latest = agent.latest()
        steps.append({"reduced": reduced, "locals": gathered, "at_once": at_once[0] - before,
                      "noise": latest.get("trainguard_grad_noise_scale"), "errors": latest["trainguard_agent_errors_total"]})
    agent.close()
    del agent, ddp
    gc.collect()
    dist.destroy_process_group()
    torch.save(steps, f"{out}/rank{rank}.pt")


def _sq(tensors) -> float:
    return sum(float((t * t).sum()) for t in tensors)


@pytest.mark.distributed
@pytest.mark.parametrize("variant", ["default", "bucket_view", "static_graph", "inner_bucket_view"])
def test_ddp_noise_scale_on_every_step_with_gradients_set_to_none(tmp_path, variant: str) -> None:
    """Report every step, ``zero_grad()`` setting the gradients to None: each step's noise scale
    from the ranks' local gradients. DDP's default copies the all-reduced gradients into ``.grad``
    at the end of the pass, after the incoming ones were normed from it (no norm per tensor);
    with ``gradient_as_bucket_view`` ``.grad`` becomes a view of the bucket being all-reduced, so
    each incoming gradient is normed at once; with ``static_graph`` the first step's all-reduce
    is queued before the agent's callback, so that step too. Attached to the module inside a
    DDP wrapper with bucket views, the agent finds ``.grad`` rebound at the end of its first pass:
    that step's noise scale is absent (not wrong), and each gradient is normed at once after it."""
    (tmp_path / "variant").write_text(variant)
    ranks = spawn_ranks(_worker, WORLD, tmp_path)
    tensors = 2 * LAYERS
    for step, last in enumerate(ranks[0]):
        if variant == "inner_bucket_view" and step == 0:
            assert last["noise"] is None and last["errors"] == 0
            continue
        g_small = sum(_sq(loc.values()) for loc in last["locals"]) / WORLD
        g_big = _sq(last["reduced"].values())
        b_small, b_big = TOKENS, WORLD * TOKENS
        g2 = (b_big * g_big - b_small * g_small) / (b_big - b_small)
        s = (g_small - g_big) / (1 / b_small - 1 / b_big)
        # float32 norms (relative error ~1e-7) enter a difference of two near sums: 1e-4
        assert last["noise"] == pytest.approx(s / g2, rel=1e-4), step
        assert last["errors"] == 0
        assert math.isfinite(last["noise"])
    per_tensor = [[s["at_once"] for s in rank] for rank in ranks]
    expected = {"default": [0] * STEPS, "bucket_view": [tensors] * STEPS,
                "static_graph": [tensors] + [0] * (STEPS - 1), "inner_bucket_view": [0] + [tensors] * (STEPS - 1)}[variant]
    assert per_tensor == [expected] * WORLD
