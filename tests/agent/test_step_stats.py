"""``step_stats``: the gradient norm under a GradScaler with an extreme (finite) scale."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import trainer_agent as ta


def test_grad_norm_is_right_for_a_scale_of_2_pow_127() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127, growth_interval=1000)
    agent = ta.attach(model, opt, job="scale", run="scale-1", scaler=scaler,
                      config=ta.AgentConfig(metrics_port=None, report_every=1, per_layer="all", layer_depth=1))
    loss = model(torch.randn(8, 16)).square().mean()
    scaler.scale(loss).backward()
    scaled = [p.grad.double() for p in model.parameters()]
    # The scaled gradients are finite, but the sum of their squares is not, in float32.
    assert all(torch.isfinite(g.float()).all() for g in scaled)
    assert not math.isfinite(float(torch.linalg.vector_norm(torch.cat([g.float().reshape(-1) for g in scaled]))))
    true = math.sqrt(sum(float((g / 2.0**127).square().sum()) for g in scaled))
    layer0 = math.sqrt(sum(float((g / 2.0**127).square().sum()) for g in scaled[:2]))
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    agent.end_step(loss)
    latest = agent.latest()
    agent.close()
    assert math.isclose(latest["trainguard_grad_norm"], true, rel_tol=1e-6)
    assert math.isclose(latest['trainguard_layer_grad_norm{layer="0"}'], layer0, rel_tol=1e-6)
    assert latest["trainguard_nonfinite_grads"] == 0.0
    assert latest["trainguard_agent_errors_total"] == 0.0


class _Blocks(nn.Module):
    """Three layers (repeated blocks) of two parameter tensors each."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x.square().mean()


def _hooked(model: nn.Module) -> int:
    return sum(1 for p in model.parameters() if p._backward_hooks)


def test_ordinary_steps_hook_one_parameter_per_layer_and_noise_scale_steps_every_parameter() -> None:
    torch.manual_seed(0)
    model = _Blocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = ta.attach(model, opt, job="hooks", run="hooks-1", config=ta.AgentConfig(metrics_port=None, report_every=3))
    micro = [torch.randn(4, 6) for _ in range(6)]
    hooked_during_second_pass = []
    ref_sq = []
    for step in range(1, 4):  # two micro-batches per step; step 3 reports
        incoming = []
        for j in range(2):
            before = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
            loss = model(micro[2 * (step - 1) + j])
            if j == 1:
                hooked_during_second_pass.append(_hooked(model))
            loss.backward()
            incoming.append(sum(float((p.grad.double() - b.double()).square().sum())
                                for p, b in zip(model.parameters(), before)))
        total_sq = sum(float(p.grad.double().square().sum()) for p in model.parameters())
        ref_sq.append((incoming, total_sq))
        opt.step()
        opt.zero_grad()
        agent.end_step(loss)
        assert _hooked(model) == 3  # after every step: the sentinels only
    latest = agent.latest()
    agent.close()
    # Step 2 ran with one hook per layer; the report steps 1 and 3 hooked every parameter after their first pass.
    assert hooked_during_second_pass == [6, 3, 6]
    incoming, big_sq = ref_sq[-1]
    small_sq = 2**2 * sum(incoming) / 2
    grad_sq = (2 * big_sq - small_sq) / 1
    trace = 1.0 * 2 * (small_sq - big_sq) / 1
    assert math.isclose(latest["trainguard_grad_noise_scale"], trace / grad_sq, rel_tol=1e-4)
    assert _hooked(model) == 0  # close removes every hook
    assert all(p._backward_hooks is None for p in model.parameters())


def test_accumulation_that_starts_on_a_report_step_leaves_the_noise_scale_out() -> None:
    torch.manual_seed(0)
    model = _Blocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = ta.attach(model, opt, job="hooks", run="hooks-2", config=ta.AgentConfig(metrics_port=None, report_every=2))
    for step in range(1, 3):
        for _ in range(1 if step == 1 else 2):  # one pass at step 1, two at the report step 2
            loss = model(torch.randn(4, 6))
            loss.backward()
        opt.step()
        opt.zero_grad()
        agent.end_step(loss)
    latest = agent.latest()
    agent.close()
    assert "trainguard_grad_noise_scale" not in latest  # its second pass had no hooks: absent, not wrong
    assert latest["trainguard_agent_errors_total"] == 0.0


@pytest.mark.parametrize("chunk", [None, 64, 7])
def test_sums_and_extremes_match_a_float64_reference_per_tensor(monkeypatch, chunk: int | None) -> None:
    """The fused passes, and on the CPU the chunked pass over the tensors of more than ``chunk``
    elements (``chunked_moments.py``; 7 leaves a short last chunk)."""
    from trainer_agent.measure import chunked_moments, stats

    if chunk is not None:
        monkeypatch.setattr(chunked_moments, "MOMENT_CHUNK", chunk)

    torch.manual_seed(0)
    tensors = [torch.randn(1000), torch.randn(3, 7).double(), torch.empty(0), torch.randn(5).half(),
               torch.tensor([1.0, math.nan, -2.0]), torch.randn(200) * 1e-3,
               torch.tensor([60000.0, -1.0, 3.0], dtype=torch.half), torch.tensor([3e38, -1e38])]
    chunk = stats._STATS_CHUNK_BYTES
    for limit in (chunk, 64):  # fused chunks, and every tensor over the limit measured on its own
        stats._STATS_CHUNK_BYTES = limit
        try:
            sums, maxes, mins = stats.sums_and_extremes(tensors, torch.device("cpu"))
        finally:
            stats._STATS_CHUNK_BYTES = chunk
        for i, t in enumerate(tensors):
            d = t.double()
            ref = (float(d.sum()), float(d.abs().max()) if t.numel() else -math.inf,
                   float(d.abs().min()) if t.numel() else math.inf)
            for got, want in zip((float(sums[i]), float(maxes[i]), float(mins[i])), ref):
                if math.isnan(want):
                    assert math.isnan(got), (limit, i)
                else:
                    assert got == want or math.isclose(got, want, rel_tol=1e-6), (limit, i, got, want)



def _bench(name: str):
    """A module of ``bench/`` (the benchmarks are scripts, not a package)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / f"{name}.py"
    sys.path.insert(0, str(path.parent))  # its own imports of its neighbours
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


_COUNTS = ("ops", "report_ops", "computing", "report_computing")


def test_report_steps_dispatch_a_constant_number_of_operators() -> None:
    """The report step's statistics are fused over every tensor (``stats.tensor_moments``,
    ``layer_stats``, the host-derived values of ``report_host``), and over a bucket of 128
    tensors or more staged (``trainer_agent/measure/staged.py``): the ATen operators the agent
    adds, counted as ``bench/agent_scale.py`` counts them (a ``torch._foreach_*`` call once, on
    the accelerator formulations), are the same at 200 and 2,000 tensors, and so is the model
    of their CUDA launches (a fused call one per ~110 tensors): at most 100 on a report step,
    views aside, at 100 tensors (fused) as at 2,000 (staged); at most 10 operators and modeled
    launches on an ordinary step (at 2,000 tensors one norm of their staged copy). Operator counts
    are deterministic: no timing is asserted."""
    scale = _bench("agent_scale")
    fused, few, many = (scale.measure(200_000, tensors, rounds=1, device="cpu") for tensors in (100, 200, 2000))
    assert [few[k] for k in (*_COUNTS, "report_launches")] == [many[k] for k in (*_COUNTS, "report_launches")]
    for counts in (fused, few, many):
        assert counts["ops"] <= 10 and counts["launches"] <= 10
        assert counts["report_computing"] <= 100 and counts["report_launches"] <= 100
        assert 0 < counts["report_computing"] < counts["report_ops"]


def _ddp_operator_counts(rank: int, init: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    scale = _bench("agent_scale")
    counts = [scale.measure(200_000, tensors, rounds=1, device="cpu", ddp=True) for tensors in (200, 2000)]
    torch.save(counts, f"{out}/rank{rank}.pt")


def test_report_steps_under_ddp_dispatch_a_constant_number_of_operators(tmp_path) -> None:
    """Under DDP (2 gloo ranks) a report step also fingerprints every layer, compares the
    screens and measures the noise scale's incoming gradients: its operators are the same at 200
    and 2,000 tensors on every rank, and with views aside (they launch no kernel on a GPU) at
    most 100, as are the modeled CUDA launches; an ordinary step stays at most 10."""
    from tests.control.spawn import spawn_ranks

    for few, many in spawn_ranks(_ddp_operator_counts, 2, tmp_path):
        assert [few[k] for k in _COUNTS] == [many[k] for k in _COUNTS]
        assert few["ops"] <= 10
        assert few["report_computing"] <= 100 and many["report_launches"] <= 100


@pytest.mark.parametrize("accelerator", [False, True], ids=["cpu-paths", "accelerator-paths"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_every_metric_on_models_of_other_dtypes(dtype: torch.dtype, accelerator: bool) -> None:
    """A float64, bfloat16 and float16 model with every metric on every step, on the CPU's own
    passes and on the accelerator formulations (``bench/agent_overhead.py``'s
    ``accelerator_paths``): no agent error (a float64 model's gradients once raised in the
    accelerator's non-finite scan and lost the whole report), the gradient norm and the per-layer
    norms against float64 references of the gradients the optimizer used, and the non-finite
    count against an element-wise count."""
    import contextlib

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4)).to(dtype)
    # AdamW's default eps (1e-8) is 0 in float16: 0/0 on the first step.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4 if dtype == torch.float16 else 1e-8)
    agent = ta.attach(model, opt, job="dtypes", run=f"dtypes-{dtype}-{accelerator}",
                      config=ta.AgentConfig(metrics_port=None, report_every=1, update_ratio="every",
                                            per_layer="all", layer_depth=1))
    paths = _bench("agent_overhead").accelerator_paths() if accelerator else contextlib.nullcontext()
    try:
        with paths:
            for step in range(3):
                x = torch.randn(8, 16)
                if step == 2:  # a corrupt sample: non-finite gradients
                    x[0, :3] = torch.tensor([math.inf, -math.inf, math.nan])
                loss = model(x.to(dtype)).float().square().mean()
                loss.backward()
                grads = [p.grad.double() for p in model.parameters()]
                opt.step()
                opt.zero_grad()
                agent.end_step(loss)
                latest = agent.latest()
                assert latest["trainguard_agent_errors_total"] == 0.0
                finite = step < 2
                true = math.sqrt(sum(float(g.square().sum()) for g in grads))
                nonfinite = sum(int((~torch.isfinite(g)).sum()) for g in grads)
                assert latest["trainguard_nonfinite_grads"] == nonfinite
                assert (nonfinite > 0) == (step == 2)
                if finite:
                    assert math.isclose(latest["trainguard_grad_norm"], true, rel_tol=1e-6)
                    layer0 = math.sqrt(sum(float(g.square().sum()) for g in grads[:2]))
                    assert math.isclose(latest['trainguard_layer_grad_norm{layer="0"}'], layer0, rel_tol=1e-6)
                else:
                    assert math.isnan(latest["trainguard_grad_norm"])
    finally:
        agent.close()


class _SparseNet(nn.Module):
    """An ``nn.Embedding`` and an ``nn.EmbeddingBag`` with sparse gradients beside dense layers."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 8, sparse=True)
        self.bag = nn.EmbeddingBag(50, 8, mode="sum", sparse=True)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids).mean(1) + self.bag(ids % 50)
        return self.head(torch.tanh(self.body(x))).square().mean()


@pytest.mark.parametrize("accelerator", [False, True], ids=["cpu-paths", "accelerator-paths"])
def test_sparse_gradients_count_in_the_norm_and_the_nonfinite_count(accelerator: bool, caplog) -> None:
    """Sparse gradients (repeated indices, so not coalesced) count in the step's gradient norm and
    non-finite count, against float64 references of their dense form; the per-parameter
    measurements leave them out with a warning naming them, and nothing raises (they once failed
    every measurement of the step)."""
    import contextlib
    import logging

    torch.manual_seed(0)
    model = _SparseNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="trainer_agent.agent"):
        agent = ta.attach(model, opt, job="sparse", run=f"sparse-{accelerator}",
                          config=ta.AgentConfig(metrics_port=None, report_every=1, update_ratio="every",
                                                per_layer="all", layer_depth=1))
    assert "emb.weight, bag.weight: sparse gradients" in caplog.text
    paths = _bench("agent_overhead").accelerator_paths() if accelerator else contextlib.nullcontext()
    gen = torch.Generator().manual_seed(1)
    try:
        with paths:
            for step in range(3):
                if step == 2:  # a non-finite weight: every gradient but its own is NaN
                    with torch.no_grad():
                        model.head.weight[0, 0] = math.nan
                loss = model(torch.randint(0, 100, (16, 6), generator=gen))
                loss.backward()
                assert not model.emb.weight.grad.is_coalesced()
                dense = [p.grad.to_dense().double() for p in model.parameters()]
                opt.step()
                opt.zero_grad()
                agent.end_step(loss)
                latest = agent.latest()
                assert latest["trainguard_agent_errors_total"] == 0.0
                want = math.sqrt(sum(float(g.square().sum()) for g in dense))
                nonfinite = sum(int((~torch.isfinite(g)).sum()) for g in dense)
                assert latest["trainguard_nonfinite_grads"] == nonfinite
                if step < 2:
                    assert math.isclose(latest["trainguard_grad_norm"], want, rel_tol=1e-6)
                else:
                    assert nonfinite > 0 and math.isnan(latest["trainguard_grad_norm"])
                layers = {k for k in latest if k.startswith("trainguard_layer_grad_norm")}
                assert layers == {f'trainguard_layer_grad_norm{{layer="{name}"}}' for name in ("body", "head")}
    finally:
        agent.close()


def test_a_parameter_frozen_after_attach_is_hooked_without_an_error() -> None:
    """Freezing part of the model after ``attach`` (a fine-tuning schedule): the report step's
    per-parameter hooks go on every attached parameter, the frozen ones included, without an
    error (``register_hook`` refuses a tensor that requires no gradient); the frozen ones never
    fire, and the noise scale is the one of the parameters that train."""
    torch.manual_seed(0)
    model = _Blocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = ta.attach(model, opt, job="hooks", run="hooks-3", config=ta.AgentConfig(metrics_port=None, report_every=2))
    model.blocks[0].requires_grad_(False)
    for step in range(1, 5):  # two micro-batches per step; steps 2 and 4 report
        for _ in range(2):
            model(torch.randn(4, 6)).backward()
        hooked = _hooked(model)
        opt.step()
        opt.zero_grad()
        agent.end_step(0.0)
    latest = agent.latest()
    agent.close()
    assert hooked == 6  # during the report step's second pass: every parameter, frozen or not
    assert latest["trainguard_agent_errors_total"] == 0.0
    assert math.isfinite(latest["trainguard_grad_noise_scale"])
    assert all(p._backward_hooks is None for p in model.parameters())
