"""The staged passes (``trainer_agent/measure/staged.py``): one copy of a bucket per stage of
elements and segmented reductions per piece, against float64 references per tensor, against the
fused passes they replace, and end to end against the CPU's own passes; their plan's layout; and
their operator count, which must not grow with the tensor count."""

from __future__ import annotations

import contextlib
import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import trainer_agent as ta
from trainer_agent.measure import staged, stats
from trainer_agent.measure.staged import StagePlan

CPU = torch.device("cpu")


def _bench(name: str):
    path = Path(__file__).resolve().parents[2] / "bench" / f"{name}.py"
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reference(t: torch.Tensor) -> list[float]:
    """The five MOMENTS of ``t`` in float64, the obvious way."""
    d = t.detach().double().reshape(-1)
    a = d.abs()
    return [float(d.clamp_min(0).sum()), float(a.sum()), float((d * d).sum()), float(a.max()), -float(a.min())]


def _close(value: float, want: float, rel: float) -> bool:
    if math.isnan(want):
        return math.isnan(value)
    return value == want or math.isclose(value, want, rel_tol=rel)


def _tensors(seed: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Shapes of every kind the layout meets: 0-dim, non-contiguous, one element, larger than a
    test stage of 64 elements (cut across stages and pieces), values of very different sizes."""
    g = torch.Generator().manual_seed(seed)
    scale = [1e-6, 1.0, 3e3]
    out = [(torch.randn(40, generator=g) * scale[i % 3]) for i in range(20)]
    out += [torch.randn(5, 8, generator=g), torch.randn(3, 33, generator=g).t(), torch.randn((), generator=g)]
    out += [torch.randn(300, generator=g), torch.randn(1, generator=g), torch.full((64,), -0.0), torch.randn(7, 9, generator=g)]
    return [t.to(dtype) for t in out]


def _plan(tensors: list[torch.Tensor], stage: int = 64, piece: int = 16) -> StagePlan:
    return StagePlan([t.shape for t in tensors], CPU, stage=stage, piece=piece)


@pytest.mark.parametrize("stage, piece", [(64, 16), (1 << 24, 1 << 16)])
def test_the_plan_covers_every_element_once_in_bounded_stages_and_pieces(stage: int, piece: int) -> None:
    tensors = _tensors(0)
    plan = _plan(tensors, stage, piece)
    numels = [t.numel() for t in tensors]
    assert plan.elements == sum(numels)
    begin, seen = 0, [0] * len(tensors)
    pieces_owner = []
    for st in plan.stages:
        assert st.begin == begin and 0 < st.size <= stage
        bounds = st.offsets.tolist()
        assert bounds[0] == 0 and bounds[-1] == st.size
        assert all(0 < b - a <= piece for a, b in zip(bounds, bounds[1:]))
        at = 0
        for i, start, n in st.members:
            assert (start < 0) == (n == numels[i])  # whole, or a part of a tensor larger than a stage
            first = seen[i]
            assert (start < 0 and first == 0) or start == first
            seen[i] += n
            # every piece lies in one member
            inside = [a for a in bounds[:-1] if at <= a < at + n]
            pieces_owner += [i] * len(inside)
            at += n
        begin += st.size
    assert seen == numels
    assert plan.owner.tolist() == pieces_owner
    if stage == 64:
        # a tensor that fits a stage is never cut: only those of 99 and 300 elements are
        cut = {i for st in plan.stages for i, start, _ in st.members if start >= 0}
        assert cut == {i for i, n in enumerate(numels) if n > stage} == {numels.index(99), numels.index(300)}
        assert not plan.identity
    else:
        assert len(plan.stages) == 1 and plan.identity


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("stage, piece", [(64, 16), (1 << 24, 1 << 16)])
def test_moments_match_a_float64_reference(dtype: torch.dtype, stage: int, piece: int) -> None:
    tensors = _tensors(1, dtype)
    got = staged.staged_moments(tensors, _plan(tensors, stage, piece))
    assert got.shape == (5, len(tensors)) and got.dtype == torch.float64
    for j, t in enumerate(tensors):
        for k, want in enumerate(_reference(t)):
            assert _close(float(got[k, j]), want, 1e-12), (j, stats.MOMENTS[k], float(got[k, j]), want)


def test_non_finite_values_propagate_per_tensor() -> None:
    """NaN makes every moment of its tensor NaN (also where it lies in one piece of a cut tensor);
    infinities give infinite sums and maxima and leave the minimum finite; neighbours keep their
    values."""
    g = torch.Generator().manual_seed(2)
    tensors = [torch.randn(300, generator=g) for _ in range(4)]
    tensors[0][250] = math.nan
    tensors[1][3] = math.inf
    tensors[2][100] = -math.inf
    got = staged.staged_moments(tensors, _plan(tensors))
    assert all(math.isnan(v) for v in got[:, 0].tolist())
    pos, l1, sq, top, neg_low = got[:, 1].tolist()
    assert pos == l1 == sq == top == math.inf and math.isfinite(neg_low)
    pos, l1, sq, top, neg_low = got[:, 2].tolist()
    assert math.isfinite(pos) and l1 == sq == top == math.inf
    for k, want in enumerate(_reference(tensors[3])):
        assert _close(float(got[k, 3]), want, 1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_nonfinite_count_is_exact(dtype: torch.dtype) -> None:
    tensors = _tensors(3, dtype)
    tensors[2][5] = math.nan
    tensors[3][::2] = math.inf  # several in one tensor
    tensors[-4][299] = -math.inf  # in the last piece of the tensor cut across stages
    want = sum(int((~torch.isfinite(t)).sum()) for t in tensors)
    assert want > 20
    for stage, piece in ((64, 16), (1 << 24, 1 << 16)):
        assert float(staged.staged_nonfinite(tensors, _plan(tensors, stage, piece))) == want


def test_squared_norms_match_a_float64_reference() -> None:
    tensors = _tensors(4) + [torch.zeros(0)]  # an empty tensor: 0
    plan = _plan(tensors)
    got = staged.staged_sq_norms(tensors, plan)
    want = [float(t.double().square().sum()) for t in tensors]
    assert all(_close(a, b, 1e-12) for a, b in zip(got.tolist(), want))
    # per stage one norm: together the norm of all of them (what the noise scale reads)
    stages = staged.staged_norms(tensors, plan, torch.float64)
    assert len(stages) == len(plan.stages) > 1
    assert _close(float(torch.linalg.vector_norm(stages)), math.sqrt(sum(want)), 1e-12)


@pytest.mark.parametrize("flat", [False, True], ids=["copied-snapshot", "flat-snapshot"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_update_norms_match_a_float64_reference(flat: bool, dtype: torch.dtype) -> None:
    """``||before - after||^2`` (the difference in the tensors' dtype, as the optimizer's update
    was), ``||after||^2`` and ``||before||^2``; with a flat snapshot the difference is made in it."""
    after = [t.contiguous() for t in _tensors(5, dtype)]
    before = [(t.double() + 1e-2 * torch.randn(t.shape, dtype=torch.float64)).to(dtype) for t in after]
    plan = _plan(after)
    want_delta = [float((b - a).double().square().sum()) for b, a in zip(before, after)]
    want_after = [float(a.double().square().sum()) for a in after]
    want_before = [float(b.double().square().sum()) for b in before]
    flat_before = torch.cat([b.reshape(-1) for b in before]) if flat else None
    delta, param, old = staged.staged_update_sq_norms(before, after, plan, before_norms=True, flat_before=flat_before)
    for got, want in ((delta, want_delta), (param, want_after), (old, want_before)):
        assert all(_close(a, b, 1e-12) for a, b in zip(got.tolist(), want))
    if flat:  # the difference was made in the snapshot, as the fused pass makes it
        assert torch.equal(flat_before[:after[0].numel()], (before[0] - after[0]).reshape(-1))
    # parameters that require grad, measured with autograd on: no graph recorded, nothing held
    params = [nn.Parameter(a.clone()) for a in after]
    flat_before = torch.cat([b.reshape(-1) for b in before]) if flat else None
    results = staged.staged_update_sq_norms(before, params, plan, before_norms=True, flat_before=flat_before)
    assert not any(r.requires_grad for r in results)
    assert flat_before is None or not flat_before.requires_grad
    assert not staged.staged_moments(params, plan).requires_grad


def test_plan_for_takes_many_plain_tensors_of_one_dtype_on_an_accelerator_only(monkeypatch) -> None:
    many = [torch.randn(3) for _ in range(staged.STAGED_MIN_TENSORS)]
    assert staged.plan_for(many, CPU) is None  # the CPU's own passes are chunked
    monkeypatch.setattr(staged, "ON_CPU", True)
    plan = staged.plan_for(many, CPU)
    assert plan is not None and plan.identity and staged.plan_for([torch.randn(3) for _ in many], CPU) is plan
    assert staged.plan_for(many[:-1], CPU) is None  # too few: the fused passes are a launch or two
    assert staged.plan_for(many[:-1] + [torch.randn(3).double()], CPU) is None  # two dtypes

    class Wrapped(torch.Tensor):  # a tensor subclass (a DTensor is one) dispatches its own way
        pass

    assert staged.plan_for(many[:-1] + [torch.randn(3).as_subclass(Wrapped)], CPU) is None
    assert staged.plan_for([torch.zeros(3, dtype=torch.long)] * len(many), CPU) is None
    assert staged.plan_for([torch.zeros(0)] * len(many), CPU) is None  # nothing to copy


def test_stats_take_the_staged_passes_for_a_large_bucket_and_agree_with_the_fused_ones(monkeypatch) -> None:
    g = torch.Generator().manual_seed(6)
    tensors = [torch.randn(int(n), generator=g) for n in torch.randint(1, 400, (300,), generator=g)]
    tensors += [torch.randn(50, generator=g).double() for _ in range(3)]  # a small float64 bucket: fused
    tensors[7][3] = math.inf
    fused_values, fused_order = stats.tensor_moments(tensors, CPU, chunked=False)
    fused_count = float(stats.nonfinite_count(tensors, CPU, scan="device"))
    buckets = [[t for t in tensors if t.dtype == torch.float32], [t for t in tensors if t.dtype == torch.float64]]
    fused_norms = stats.bucket_norms(buckets, CPU)
    monkeypatch.setattr(staged, "ON_CPU", True)
    values, order = stats.tensor_moments(tensors, CPU, chunked=False)
    assert order == list(range(300, 303)) + list(range(300))  # the fused bucket first, then the staged one
    assert fused_order == list(range(303))
    got = values.view(5, -1)[:, [order.index(i) for i in range(303)]]
    torch.testing.assert_close(got, fused_values.view(5, -1), rtol=1e-6, atol=0, equal_nan=True)
    assert float(stats.nonfinite_count(tensors, CPU, scan="device")) == fused_count == 1
    norms = stats.bucket_norms(buckets, CPU, staged_ok=True)
    assert norms.dtype == fused_norms.dtype == torch.float64  # a float64 bucket widens the vector
    torch.testing.assert_close(norms, fused_norms, rtol=1e-6, atol=0)


def test_update_norms_through_stats_with_staged_and_fused_buckets(monkeypatch) -> None:
    g = torch.Generator().manual_seed(7)
    after = [[torch.randn(20, generator=g) for _ in range(200)], [torch.randn(9, generator=g).double()]]
    before = [[a + 0.1 * torch.randn(a.shape, generator=g, dtype=a.dtype) for a in bucket] for bucket in after]
    want = stats.update_sq_norms([[t.clone() for t in b] for b in before], after, CPU, chunked=False,
                                 before_norms=True)
    monkeypatch.setattr(staged, "ON_CPU", True)
    for flat_before in (None, [torch.cat([t.reshape(-1) for t in before[0]]), None]):
        got = stats.update_sq_norms([[t.clone() for t in b] for b in before], after, CPU, chunked=False,
                                    before_norms=True, flat_before=flat_before)
        assert got[3] is False
        for a, b in zip(got[:3], want[:3]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


def test_operators_do_not_grow_with_the_tensor_count() -> None:
    """The staged passes over 200 and over 2,000 tensors of the same total size dispatch the
    same operators, and a model of their CUDA launches gives the same count (deterministic: no
    timing)."""
    overhead = _bench("agent_overhead")
    counts = []
    for n in (200, 2000):
        tensors = [torch.randn(40_000 // n) for _ in range(n)]
        before = [t + 1 for t in tensors]
        plan = StagePlan([t.shape for t in tensors], CPU)
        with overhead.OpCounter() as count:
            staged.staged_moments(tensors, plan)
            staged.staged_nonfinite(tensors, plan)
            staged.staged_sq_norms(tensors, plan)
            staged.staged_update_sq_norms(before, tensors, plan, before_norms=True)
        counts.append((count.ops, count.launches))
    assert counts[0] == counts[1]
    assert counts[0][1] < 60


class _Wide(nn.Module):
    """A model of many small parameter tensors (one bucket of 300), its layers side by side."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(150))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # side by side: no gradient vanishes
        return torch.stack([torch.tanh(layer(x)) for layer in self.layers]).sum(0).square().mean()


@pytest.mark.parametrize("break_at, every", [(None, 1), (2, 1), (None, 3)],
                         ids=["staged", "staged-then-failing", "staged-ordinary-steps"])
def test_every_metric_of_the_staged_passes_agrees_with_the_cpu_passes(monkeypatch, break_at: int | None,
                                                                       every: int) -> None:
    """The same training twice, one step at a time, every metric on every step: on the CPU's own
    passes, and on the accelerator formulations (``accelerator_paths``), where the 300-tensor
    bucket takes the staged passes, the update's snapshot one flat buffer. Every reported value
    agrees; a non-finite step is counted alike. Where the staged copy starts failing (step 2 of
    ``staged-then-failing``: first met by the snapshot's copy before the optimizer step), nothing
    is lost: the fused passes measure from then on, the snapshot copied into its flat buffer's
    views, and every value still agrees, with no agent error. With a report every 3 steps the
    ordinary steps' gradient norm is one norm of the staged copy (``OneCopyNorm``):
    the interval's largest and the reported values agree too."""
    from trainer_agent.compat import torch_private

    monkeypatch.setattr(staged, "FAILED", None)
    overhead = _bench("agent_overhead")
    torch.manual_seed(0)
    models = [_Wide(), _Wide()]
    models[1].load_state_dict(models[0].state_dict())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in models]
    config = ta.AgentConfig(metrics_port=None, report_every=every, update_ratio="every", per_layer="all", layer_depth=2)
    agents = [ta.attach(m, o, job="staged", run=f"staged-{i}", config=config) for i, (m, o) in enumerate(zip(models, opts))]
    try:
        for step in range(6):
            x = torch.randn(16, 8)
            if step == 4:
                x[0, 0] = math.nan
            if step == break_at:
                monkeypatch.setattr(torch_private, "chunk_cat", _raises)
            latest = []
            for i, (model, opt, agent) in enumerate(zip(models, opts, agents)):
                with overhead.accelerator_paths() if i else contextlib.nullcontext():
                    loss = model(x)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    agent.end_step(loss)
                latest.append(agent.latest())
            cpu, acc = latest
            assert acc["trainguard_agent_errors_total"] == cpu["trainguard_agent_errors_total"] == 0
            assert (staged.FAILED is not None) == (break_at is not None and step >= break_at)
            assert set(acc) == set(cpu)
            for key, value in cpu.items():
                if "seconds" in key or "per_second" in key or "memory" in key or "overhead" in key:
                    continue
                assert _close(acc[key], value, 1e-6) or (value == 0 and abs(acc[key]) < 1e-12), (step, key, acc[key], value)
            if every == 1:
                assert (cpu["trainguard_nonfinite_grads"] > 0) == (step >= 4)  # (NaN weights from step 4 on)
        if every == 3:  # the second report's interval held step 4's NaN, an ordinary step
            assert acc["trainguard_nonfinite_steps_total"] == cpu["trainguard_nonfinite_steps_total"] >= 1
            assert math.isfinite(acc["trainguard_grad_norm_max"])
        # The 300-tensor bucket was planned from its settled layout (the staged passes ran on it).
        planned = [plan for bucket in agents[1].parts.params.buckets for plan in bucket.layout._plans.values()]
        assert break_at is not None or any(plan is not None and plan.tensors == 300 for plan in planned)
        # The ordinary steps (every 3: steps 1, 3, 4; step 0 reports) normed from one copy, until it failed.
        assert agents[1].parts.params.one_copy.used == {(None, 3): 3, (None, 1): 0, (2, 1): 0}[break_at, every]
        assert agents[0].parts.params.one_copy.used == 0  # the CPU's own passes
    finally:
        for agent in agents:
            agent.close()


def _raises(*args, **kwargs):
    raise RuntimeError("chunk_cat: not on this build")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_staged_passes_on_cuda_match_the_fused_ones(dtype: torch.dtype) -> None:
    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(8)
    tensors = [torch.randn(int(n), generator=g, device=device, dtype=dtype) for n in range(1, 3000, 7)]
    tensors[5][0] = math.nan
    assert staged.plan_for(tensors, device) is not None  # what stats.tensor_moments takes on CUDA
    values, order = stats.tensor_moments(tensors, device)
    assert order == list(range(len(tensors)))
    ref = torch.tensor([_reference(t.cpu()) for t in tensors], dtype=torch.float64).t()
    torch.testing.assert_close(values.view(5, -1).cpu(), ref, rtol=1e-9, atol=0, equal_nan=True)
    assert float(stats.nonfinite_count(tensors, device)) == 1
    after = [t.nan_to_num() for t in tensors]
    before = [t + 1 for t in after]
    delta, _, _, _ = stats.update_sq_norms([[t.clone() for t in before]], [after], device)
    want = torch.tensor([float((b - a).double().square().sum()) for b, a in zip(before, after)], dtype=torch.float64)
    torch.testing.assert_close(delta.cpu(), want, rtol=1e-9, atol=0)


def test_a_failing_staged_pass_turns_them_off_and_the_fused_passes_measure(monkeypatch, caplog) -> None:
    """A staged pass that raises (an operator a build lacks, a layout it refuses) costs nothing
    but a warning: the fused passes measure the same values, this time and from then on."""
    monkeypatch.setattr(staged, "ON_CPU", True)
    monkeypatch.setattr(staged, "FAILED", None)
    g = torch.Generator().manual_seed(9)
    tensors = [torch.randn(int(n), generator=g) for n in torch.randint(1, 400, (200,), generator=g)]
    tensors[3][1] = math.nan
    want_values, _ = stats.tensor_moments(tensors, CPU, chunked=False)  # staged: works

    def broken(*args, **kwargs):
        raise RuntimeError("segment_reduce: not implemented for this build")

    monkeypatch.setattr(torch, "segment_reduce", broken)
    with caplog.at_level("WARNING"):
        values, order = stats.tensor_moments(tensors, CPU, chunked=False)
    assert staged.FAILED is not None and "not implemented" in staged.FAILED
    assert sum("fused passes from now on" in r.getMessage() for r in caplog.records) == 1
    assert order == list(range(200))
    torch.testing.assert_close(values, want_values, rtol=1e-6, atol=0, equal_nan=True)
    assert staged.plan_for(tensors, CPU) is None  # off from now on
    assert float(stats.nonfinite_count(tensors, CPU, scan="device")) == 1


def test_a_failing_staged_update_loses_that_report_only(monkeypatch) -> None:
    """The update's staged pass makes the difference in the snapshot itself: where it fails it
    raises (the report step counts an agent error and goes on), and the next measurement takes
    the fused passes."""
    monkeypatch.setattr(staged, "ON_CPU", True)
    monkeypatch.setattr(staged, "FAILED", None)
    after = [[torch.randn(20) for _ in range(200)]]
    before = [[a + 0.5 for a in after[0]]]

    def broken(*args, **kwargs):
        raise RuntimeError("no segmented reduction here")

    monkeypatch.setattr(torch, "segment_reduce", broken)
    with pytest.raises(RuntimeError, match="fused passes from the next report on"):
        stats.update_sq_norms([[t.clone() for t in before[0]]], after, CPU, chunked=False)
    delta, param, _, _ = stats.update_sq_norms([[t.clone() for t in before[0]]], after, CPU, chunked=False)
    torch.testing.assert_close(delta, torch.full((200,), 0.25 * 20, dtype=torch.float64), rtol=1e-6, atol=0)
    torch.testing.assert_close(param, torch.stack([a.double().square().sum() for a in after[0]]), rtol=1e-6, atol=0)



def test_every_input_is_copied_in_logical_order() -> None:
    """CUDA's ``_chunk_cat`` copies a dense tensor in memory order: a non-contiguous tensor (a
    transposed weight, a channels_last convolution) is handed to it flattened in logical order,
    so that the snapshot's views and the fused fallback see the same elements."""
    tensors = [torch.randn(3, 4).t(), torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last), torch.randn(5)]
    plan = StagePlan([t.shape for t in tensors], CPU)
    inputs = plan.stages[0].inputs(tensors)
    assert all(x.is_contiguous() for x in inputs)
    assert torch.equal(torch.cat([x.reshape(-1) for x in inputs]), torch.cat([t.reshape(-1) for t in tensors]))


def test_an_empty_tensor_among_cut_ones_has_no_extremes() -> None:
    """Pieces combined per tensor: a tensor without pieces (empty) keeps the extremes of no
    element, -inf and +inf, never an uninitialized value."""
    tensors = [torch.randn(300), torch.zeros(0), torch.randn(100)]
    plan = _plan(tensors)
    assert not plan.identity
    got = staged.staged_moments(tensors, plan)
    assert got[3, 1] == -math.inf and got[4, 1] == -math.inf  # max |t| = -inf, -min |t| = -inf
    assert got[:3, 1].tolist() == [0.0, 0.0, 0.0]


def test_plan_for_lays_out_with_the_module_sizes(monkeypatch) -> None:
    monkeypatch.setattr(staged, "ON_CPU", True)
    monkeypatch.setattr(staged, "STAGE_ELEMENTS", 1000)
    monkeypatch.setattr(staged, "PIECE", 100)
    tensors = [torch.randn(30) for _ in range(staged.STAGED_MIN_TENSORS)]
    plan = staged.plan_for(tensors, CPU)
    assert len(plan.stages) == math.ceil(30 * len(tensors) / 990) and max(st.size for st in plan.stages) <= 1000


def test_out_of_memory_falls_back_for_that_call_only(monkeypatch, caplog) -> None:
    monkeypatch.setattr(staged, "FAILED", None)

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 192.00 MiB")

    with caplog.at_level("WARNING"):
        assert staged.attempt(oom) is None
    assert staged.FAILED is None  # the next report tries the staged passes again
    assert any("out of memory" in r.getMessage() for r in caplog.records)


def test_only_buckets_of_many_small_tensors_norm_an_ordinary_step_from_one_copy(monkeypatch) -> None:
    """Decided once from the parameters: every bucket of at least STAGED_MIN_TENSORS tensors and
    at most one stage of elements; a larger model's ordinary steps then look up no plan."""
    monkeypatch.setattr(staged, "STAGE_ELEMENTS", 1000)
    many = [torch.randn(5) for _ in range(staged.STAGED_MIN_TENSORS)]
    assert staged.fits_one_stage([many])
    assert not staged.fits_one_stage([many, many[:-1]])  # a bucket of too few
    assert not staged.fits_one_stage([many + [torch.randn(400)]])  # more than one stage
    assert not staged.fits_one_stage([])


def _plan_layout(plan: StagePlan) -> list:
    return [(st.begin, st.size, st.members, st.whole, st._bounds) for st in plan.stages] + [plan._owner_host]


def test_a_settled_list_is_planned_from_its_layout_as_from_its_shapes(monkeypatch) -> None:
    """A list tagged with its settled layout (``staged.Settled``: a bucket of parameters, its
    gradients) gets the plan its shapes give, made once per stage and piece size, and reads no
    tensor's shape to get it; a list whose first tensor no longer has the layout's dtype (a model
    cast since) is planned from its own shapes."""
    monkeypatch.setattr(staged, "ON_CPU", True)
    monkeypatch.setattr(staged, "STAGE_ELEMENTS", 256)
    monkeypatch.setattr(staged, "PIECE", 32)
    g = torch.Generator().manual_seed(4)
    params = [torch.randn(int(n), generator=g) for n in torch.randint(1, 90, (staged.STAGED_MIN_TENSORS,), generator=g)]
    params[5] = torch.randn(3, 7, generator=g).t()
    layout = staged.Layout(params)
    settled = staged.Settled([torch.zeros_like(p) for p in params], layout)
    plan = staged.plan_for(settled, CPU)
    assert _plan_layout(plan) == _plan_layout(StagePlan([p.shape for p in params], CPU, stage=256, piece=32))
    assert staged.plan_for(staged.Settled(list(settled), layout), CPU) is plan  # made once

    class NoShape(torch.Tensor):  # a read of .shape would raise
        pass
    monkeypatch.setattr(staged, "PLAIN", (torch.Tensor, torch.nn.Parameter, NoShape))
    blind = staged.Settled([settled[0].as_subclass(NoShape)] + list(settled[1:]), layout)
    monkeypatch.setattr(NoShape, "shape", property(lambda self: (_ for _ in ()).throw(AssertionError("read"))))
    assert staged.plan_for(blind, CPU) is plan
    monkeypatch.setattr(staged, "PIECE", 16)  # another piece size: another plan, from the same layout
    assert staged.plan_for(settled, CPU).stages[0]._bounds[1] == min(16, params[0].numel())
    cast = staged.Settled([p.double() for p in params], layout)
    assert staged.plan_for(cast, CPU) is not None and staged.plan_for(cast, CPU) is not plan


def test_order_free_passes_take_non_contiguous_tensors_as_they_are() -> None:
    """The norms, moments and counts of whole tensors copy them without testing or fixing their
    layout (the elements of a tensor in any order have its statistics), and still match float64
    references for transposed, channels-last and strided tensors; the ordered inputs (the
    update's snapshot) stay contiguous in logical order."""
    g = torch.Generator().manual_seed(5)
    tensors = [torch.randn(30, 20, generator=g).t(), torch.randn(2, 3, 4, 4, generator=g).to(memory_format=torch.channels_last),
               torch.randn(50, generator=g)[::2], torch.randn(40, generator=g)]
    tensors[1][0, 1, 2, 3] = math.nan
    plan = StagePlan([t.shape for t in tensors], CPU)
    stage = plan.stages[0]
    taken = stage.inputs(tensors, ordered=False)
    assert len(taken) == 4 and all(x is t for x, t in zip(taken, tensors))
    ordered = stage.inputs(tensors)
    assert ordered[0].is_contiguous() and ordered[1].is_contiguous()
    assert torch.equal(torch.cat([x.reshape(-1) for x in ordered]).nan_to_num(), torch.cat([t.reshape(-1) for t in tensors]).nan_to_num())
    got = staged.staged_moments(tensors, plan)
    for j, t in enumerate(tensors):
        for k, want in enumerate(_reference(t)):
            assert _close(float(got[k, j]), want, 1e-12), (j, k)
    sq = staged.staged_sq_norms(tensors, plan)
    assert _close(float(sq[0]), float(tensors[0].double().square().sum()), 1e-12) and math.isnan(sq[1])
    assert float(staged.staged_nonfinite(tensors, plan)) == 1


def test_empty_tensors_between_whole_ones_are_left_out_of_the_copy() -> None:
    """An empty parameter between others of one stage (the copy refuses empty tensors): the
    members around it are copied without it, every statistic matches the reference, the empty
    tensor's norm is 0 and its extremes those of no element."""
    g = torch.Generator().manual_seed(7)
    tensors = [torch.randn(5, generator=g), torch.zeros(0), torch.randn(3, 4, generator=g), torch.zeros(2, 0),
               torch.randn(7, generator=g)]
    plan = StagePlan([t.shape for t in tensors], CPU)
    assert plan.stages[0].whole == [0, 2, 4]
    got = staged.staged_moments(tensors, plan)
    for j in (0, 2, 4):
        for k, want in enumerate(_reference(tensors[j])):
            assert _close(float(got[k, j]), want, 1e-12), (j, k)
    assert got[:3, 1].tolist() == [0.0, 0.0, 0.0] and got[3, 1] == -math.inf
    sq = staged.staged_sq_norms(tensors, plan)
    assert sq[1] == sq[3] == 0 and _close(float(sq[2]), float(tensors[2].double().square().sum()), 1e-12)
    assert float(staged.staged_nonfinite(tensors, plan)) == 0
    after = [t + 1 for t in tensors]
    delta, param = staged.staged_update_sq_norms(tensors, after, plan, before_norms=False)
    assert delta.tolist() == pytest.approx([5.0, 0.0, 12.0, 0.0, 7.0], rel=1e-6)  # (float32 differences)
