"""Gradient recompute check (``trainer_agent/diagnostics/verify.py``): a clean run (dropout included) follows
the same weights and RNG stream bit for bit as a run without checks and is never flagged; a
"faulty device" that changes one gradient element on the first pass only is flagged with the
exact relative size of the change, its layer and its rank (2 gloo ranks under DDP)."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import trainer_agent as ta
from tests.control.spawn import spawn_ranks

WORLD = 2


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.3), nn.Tanh(), nn.Linear(32, 4))


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return (model(batch[0]) - batch[1]).square().mean()


class FaultyDevice:
    """A gradient hook that adds ``delta`` to element ``index`` of a parameter's gradient the first
    time that parameter gets a gradient at step ``at`` (a device that computed one value wrong
    once). Registered before ``attach``, so the agent's hook sees the wrong value."""

    def __init__(self, param: nn.Parameter, at: int, delta: float, index: int = 5) -> None:
        self.at, self.delta, self.index = at, delta, index
        self.step = 0
        self.fired_at: int | None = None
        param.register_hook(self._hook)

    def _hook(self, grad: torch.Tensor) -> torch.Tensor:
        if self.step == self.at and self.fired_at is None:
            self.fired_at = self.step
            grad = grad.clone()
            grad.view(-1)[self.index] += self.delta
        return grad


def _train(verify_every: int | None, steps: int = 6, fault: tuple[int, float] | None = None, micro: int = 1):
    torch.manual_seed(0)
    model = _model()
    faulty = FaultyDevice(model[3].weight, *fault) if fault else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    agent = ta.attach(model, opt, job="v", run="v-1",
                      config=ta.AgentConfig(metrics_port=None, verify_every=verify_every, report_every=2))
    results, agains = [], []
    for step in range(steps):
        if faulty is not None:
            faulty.step = step + 1
        batches = [(torch.randn(16, 8), torch.randn(16, 4)) for _ in range(micro)]
        for b in batches:
            loss = _loss(model, b) / micro
            loss.backward()
        results.append(agent.verify_step(batches[-1], lambda m, b: _loss(m, b) / micro))
        if results[-1] is not None and faulty is not None and faulty.fired_at == step + 1:
            agains.append(model[3].weight.grad.clone())
        opt.step()
        opt.zero_grad()
        agent.end_step(loss.detach())
    values = agent.latest()
    agent.close()
    return [p.detach().clone() for p in model.parameters()], results, values, torch.rand(3)


def test_a_clean_run_is_unchanged_bit_for_bit_and_never_flagged() -> None:
    weights, results, values, rng = _train(None)
    assert results == [None] * 6 and values["trainguard_verify_steps_total"] == 0.0
    checked_w, checked, checked_values, checked_rng = _train(2)
    # weights, optimizer-driven updates and the RNG stream (dropout masks) are exactly those of the
    # run without checks
    assert all(torch.equal(a, b) for a, b in zip(weights, checked_w))
    assert torch.equal(rng, checked_rng)
    assert [r is not None for r in checked] == [False, True, False, True, False, True]
    assert all(r.bitwise and r.rel_diff == 0.0 and not r.mismatch for r in checked if r is not None)
    assert [r.step for r in checked if r is not None] == [2, 4, 6]
    assert checked_values["trainguard_verify_steps_total"] == 3.0
    assert checked_values["trainguard_verify_mismatches_total"] == 0.0
    assert checked_values["trainguard_verify_rel_diff"] == 0.0
    assert checked_values["trainguard_agent_errors_total"] == 0.0


def test_the_last_micro_batch_of_an_accumulated_step_is_checked() -> None:
    _, results, _, _ = _train(1, steps=3, micro=3)
    assert all(r is not None and r.bitwise for r in results)


def test_a_changed_gradient_element_is_flagged_with_its_exact_size_and_layer() -> None:
    delta = 1e-3
    _, results, values, _ = _train(1, steps=5, fault=(3, delta))
    flagged = [r for r in results if r.mismatch]
    assert [r.step for r in flagged] == [3] and flagged[0].layer == "3" and not flagged[0].bitwise
    assert all(r.rel_diff == 0.0 for r in results if r.step != 3)
    assert values["trainguard_verify_mismatches_total"] == 1.0


def test_the_relative_difference_is_the_change_over_the_layer_norm() -> None:
    """Independent reference: the layer's recomputed gradient (float64 norm) and the injected delta."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    delta = 3e-4
    faulty = FaultyDevice(model.weight, 1, delta)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = ta.attach(model, opt, job="v", run="v-1", config=ta.AgentConfig(metrics_port=None, verify_every=1))
    faulty.step = 1
    batch = (torch.randn(16, 8), torch.randn(16, 4))
    _loss(model, batch).backward()
    with_fault = [p.grad.clone() for p in model.parameters()]
    result = agent.verify_step(batch, _loss)
    agent.close()
    clean = with_fault[0].double().clone()
    clean.view(-1)[5] -= delta
    norm = math.sqrt(float(clean.square().sum()))  # a bare Linear: "weight" and "bias" are layers of their own
    # the projections are float32 sums of the 32 elements: rounding bounded by n * eps * sum |g|
    rounding = 2 * 32 * 2.0**-24 * float(clean.abs().sum()) / norm
    assert result.rel_diff == pytest.approx(delta / norm, abs=rounding)
    assert rounding < 0.1 * delta / norm  # the bound is tight enough to mean something
    assert result.mismatch and result.layer == "weight"


def test_a_change_below_the_tolerance_is_not_flagged_but_not_bitwise() -> None:
    _, results, _, _ = _train(1, steps=4, fault=(2, 1e-6))
    second = results[1]
    assert not second.mismatch and not second.bitwise and 0 < second.rel_diff < 1e-5


def _amp_loop(style: str, *, float32_at: tuple[int, ...] = (), steps: int = 4):
    """A bare Linear trained under bfloat16 autocast for ``steps`` steps, a float32 recompute
    asked for before each step in ``float32_at``. ``style``: ``loop`` (the loop's autocast wraps the
    loss; ``loss_fn`` has none), ``inside`` (``loss_fn`` enters autocast itself), ``none`` (no
    autocast). Returns (weights, results, values, (step's weight grad, float32 weight grad) of the
    first checked step)."""
    torch.manual_seed(0)
    model = nn.Linear(64, 16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    agent = ta.attach(model, opt, job="v", run="v-1", config=ta.AgentConfig(metrics_port=None, report_every=1))

    def plain(m, b):
        return (m(b[0]).float() - b[1]).square().mean()

    def inside(m, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return plain(m, b)

    results, grads = [], None
    for step in range(steps):
        if step in float32_at:
            agent.request_verify(float32=True)
        batch = (torch.randn(32, 64), torch.randn(32, 16))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=style == "loop"):
            loss = (inside if style == "inside" else plain)(model, batch)
        loss.backward()
        if grads is None and step in float32_at:
            with torch.random.fork_rng():  # (its init draws random numbers: the next batches stay the same)
                reference = nn.Linear(64, 16)
            reference.load_state_dict(model.state_dict())
            plain(reference, batch).backward()  # no autocast anywhere: the float32 gradient
            grads = (model.weight.grad.double().clone(), reference.weight.grad.double().clone(),
                     model.bias.grad.double().clone(), reference.bias.grad.double().clone())
        results.append(agent.verify_step(batch, inside if style == "inside" else plain))
        opt.step()
        opt.zero_grad()
        agent.end_step(loss.detach())
        if step in float32_at:
            values = agent.latest()
    agent.close()
    return [p.detach().clone() for p in model.parameters()], results, values if float32_at else None, grads


def test_a_float32_recompute_measures_how_far_autocast_moved_the_gradient() -> None:
    """Independent reference: the same step's gradient computed by hand without autocast. The
    projections are +-1 sums, so each layer's difference is at most the L1 norm of the change over
    the layer's L2 norm, and (K random signs) not far below its L2 norm."""
    weights, results, values, (w_amp, w_f32, b_amp, b_f32) = _amp_loop("loop", float32_at=(2,))
    plain_weights, _, _, _ = _amp_loop("loop")
    assert all(torch.equal(a, b) for a, b in zip(weights, plain_weights))  # training unchanged, bit for bit
    checked = results[2]
    assert [r is None for r in results] == [True, True, False, True]
    # the same-precision recompute replayed the loop's autocast: bit for bit, not a mismatch
    assert checked.bitwise and checked.rel_diff == 0.0 and not checked.mismatch
    l1 = max(float((w_amp - w_f32).abs().sum() / w_f32.norm()), float((b_amp - b_f32).abs().sum() / b_f32.norm()))
    l2 = max(float((w_amp - w_f32).norm() / w_f32.norm()), float((b_amp - b_f32).norm() / b_f32.norm()))
    assert 1e-4 < l2 < 0.1  # bfloat16 rounding: real, and small
    assert 0.3 * l2 <= checked.float32_rel_diff <= l1 * (1 + 1e-6)
    assert checked.float32_layer in ("weight", "bias")
    assert values["trainguard_verify_float32_rel_diff"] == checked.float32_rel_diff
    assert values["trainguard_verify_mismatches_total"] == 0.0 and values["trainguard_agent_errors_total"] == 0.0


def test_a_float32_recompute_is_not_measured_where_it_cannot_be(caplog) -> None:
    # a loss function that enters autocast itself: an outer autocast(enabled=False) cannot undo it
    _, results, values, _ = _amp_loop("inside", float32_at=(1,))
    assert results[1].rel_diff == 0.0 and math.isnan(results[1].float32_rel_diff)
    assert "trainguard_verify_float32_rel_diff" not in values
    assert "enters torch.autocast itself" in caplog.text
    # a step without autocast: nothing to compare (the same-precision check covers it)
    _, results, values, _ = _amp_loop("none", float32_at=(1,))
    assert results[1].bitwise and math.isnan(results[1].float32_rel_diff)
    assert "ran without autocast" in caplog.text


def test_misuse_and_scheduling() -> None:
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = ta.attach(model, opt, job="v", run="v-1", config=ta.AgentConfig(metrics_port=None))
    batch = (torch.randn(4, 8), torch.randn(4, 4))

    def step(verify_before: bool = True):
        _loss(model, batch).backward()
        out = agent.verify_step(batch, _loss) if verify_before else None
        opt.step()
        if not verify_before:
            with pytest.raises(ValueError, match="before optimizer.step"):
                agent.verify_step(batch, _loss)
        opt.zero_grad()
        agent.end_step(0.0)
        return out

    assert step() is None  # verify_every=None: nothing is due
    agent.request_verify()  # arms the next step
    assert step() is not None
    assert step() is None
    agent.request_verify()
    step(verify_before=False)
    agent.close()
    with pytest.raises(ValueError, match="verify_every"):
        ta.AgentConfig(verify_every=0)
    with pytest.raises(ValueError, match="verify_rel_tol"):
        ta.AgentConfig(verify_rel_tol=-1.0)


def _worker(rank: int, init: str, out: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        runs = {}
        for name, fault in (("clean", None), ("faulty", (4, 1e-3) if rank == 1 else None)):
            torch.manual_seed(0)
            inner = _model()
            faulty = FaultyDevice(inner[3].weight, *fault) if fault else None
            model = nn.parallel.DistributedDataParallel(inner)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            agent = ta.attach(model, opt, job="v", run=f"v-{name}",
                              config=ta.AgentConfig(metrics_port=None, verify_every=2, report_every=2))
            gen = torch.Generator().manual_seed(100 + rank)
            results, mismatch = [], []
            for step in range(1, 7):
                if faulty is not None:
                    faulty.step = step
                batch = (torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen))
                loss = _loss(model, batch)
                loss.backward()
                results.append(agent.verify_step(batch, _loss))
                opt.step()
                opt.zero_grad()
                agent.end_step(loss.detach())
                if step % 2 == 0:
                    agent.latest()
                    mismatch.append(list(agent.rank_values["verify_mismatch"]))
            runs[name] = {"results": results, "mismatch": mismatch,
                          "params": [p.detach().clone() for p in model.parameters()]}
            agent.close()
        torch.save(runs, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_ddp_the_rank_whose_device_erred_is_named(tmp_path) -> None:
    out = spawn_ranks(_worker, WORLD, tmp_path, timeout=180)
    for rank in range(WORLD):
        clean = out[rank]["clean"]
        assert [r.step for r in clean["results"] if r is not None] == [2, 4, 6]
        assert all(r.bitwise and not r.mismatch for r in clean["results"] if r is not None)
        # the leader holds every rank's check in every report, the other rank its own
        held = [0.0, 0.0] if rank == 0 else [0.0]
        assert clean["mismatch"] == [held] * 3
        faulty = out[rank]["faulty"]
        flagged = [r.step for r in faulty["results"] if r is not None and r.mismatch]
        assert flagged == ([4] if rank == 1 else [])
        # the report of step 4 names rank 1 only (rank 0's local gradient recomputed exactly)
        at4 = faulty["mismatch"][1]
        if rank == 0:
            assert at4[0] == 0.0 and at4[1] > 1e-5
        else:
            assert at4[0] > 1e-5
        assert faulty["mismatch"][0] == held and faulty["mismatch"][2] == held
    # the check changed nothing the ranks hold in common: they stay in sync
    assert all(torch.equal(a, b) for a, b in zip(out[0]["faulty"]["params"], out[1]["faulty"]["params"]))


def test_a_loss_computed_beside_forward_is_refused_not_misjudged() -> None:
    """Without the model's forward hooks the random state cannot be replayed: counted as an error."""

    class Beside(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 4)

        def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            return (self.lin(batch[0]) - batch[1]).square().mean()

    model = Beside()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = ta.attach(model, opt, job="v", run="v-1", config=ta.AgentConfig(metrics_port=None, verify_every=1))
    batch = (torch.randn(4, 8), torch.randn(4, 4))
    for _ in range(2):
        model.loss(batch).backward()
        assert agent.verify_step(batch, lambda m, b: m.loss(b)) is None
        opt.step()
        opt.zero_grad()
        agent.end_step(0.0)
    values = agent.latest()
    assert values["trainguard_agent_errors_total"] == 2.0 and values["trainguard_verify_steps_total"] == 0.0
    agent.close()
