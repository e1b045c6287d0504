"""Every step metric of the agent against a naive float64 per-parameter reference computed here."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import pytest
import torch
from prometheus_client.registry import CollectorRegistry
from torch import nn
from torch.nn import functional as F

import trainer_agent as ta

V, D, B, L = 32, 16, 4, 8
RTOL = 1e-5


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    """Embedding, two residual blocks, a frozen projection, a head, and a module that gets no
    gradient (in the optimizer, never used)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.frozen = nn.Linear(D, D)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(D, V)
        self.unused = nn.Linear(D, 3)

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids[:, :-1])
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.frozen(x))
        return F.cross_entropy(logits.reshape(-1, V), ids[:, 1:].reshape(-1))


def layer_of(name: str) -> str:
    return ".".join(name.rsplit(".", 1)[0].split(".")[:2])


def make_optimizer(kind: str, model: Net) -> torch.optim.Optimizer:
    blocks = [p for n, p in model.named_parameters() if n.startswith("blocks.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("blocks.") and p.requires_grad]
    groups = [{"params": rest}, {"params": blocks, "lr": 0.03}]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=0.1)
    if kind == "sgd_momentum":
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1)
    if kind == "adafactor":
        return torch.optim.Adafactor(groups, lr=1e-2)
    raise AssertionError(kind)


@dataclass
class Record:
    """What the reference saw in one step (float64)."""

    loss: float
    grads: dict[str, torch.Tensor]          # accumulated, unscaled, before clipping
    micro: list[dict[str, torch.Tensor]]    # incoming gradient of each backward pass, unscaled
    before: dict[str, torch.Tensor]
    after: dict[str, torch.Tensor]
    lrs: list[float]
    tokens: int
    stepped: bool
    state_nonfinite: int = 0
    extra: dict[str, float] = field(default_factory=dict)


class Capture:
    """Test-side gradient hooks: the incoming gradient of every backward pass."""

    def __init__(self, model: nn.Module) -> None:
        self.current: dict[str, torch.Tensor] = {}
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.register_hook(self._hook(name))

    def _hook(self, name: str):
        def hook(grad: torch.Tensor) -> None:
            self.current[name] = grad.detach().double().clone()
        return hook

    def take(self) -> dict[str, torch.Tensor]:
        out, self.current = self.current, {}
        return out


def batch(step: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randint(0, V, (B, L), generator=g)


def train(agent, model, opt, steps, *, accum=1, divide=True, clip=None, scaler=None, sched=None,
          loss_fault=None, capture=None, autocast=None) -> list[Record]:
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    device = next(model.parameters()).device
    records = []
    for step in range(1, steps + 1):
        micro = []
        for j in range(accum):
            with autocast or contextlib.nullcontext():
                loss = model.loss(batch(step, j).to(device))
            if divide:
                loss = loss / accum
            backward_loss = loss if loss_fault is None else loss_fault(step, loss)
            (scaler.scale(backward_loss) if scaler is not None else backward_loss).backward()
            if capture is not None:
                micro.append(capture.take())
        scale = scaler.get_scale() if scaler is not None else 1.0
        grads = {n: p.grad.double() / scale for n, p in trainable.items() if p.grad is not None}
        micro = [{n: g / scale for n, g in m.items()} for m in micro]
        before = {n: p.detach().double().clone() for n, p in trainable.items()}
        lrs = [float(g["lr"]) for g in opt.param_groups]
        if scaler is not None:
            scaler.unscale_(opt)
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        stepped = []
        handle = opt.register_step_post_hook(lambda *a: stepped.append(True))
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        handle.remove()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        after = {n: p.detach().double().clone() for n, p in trainable.items()}
        state_nonfinite = sum(int((~torch.isfinite(t)).sum()) for s in opt.state.values()
                              for t in s.values() if isinstance(t, torch.Tensor))
        tokens = accum * B * L
        agent.end_step(loss, tokens=tokens)
        records.append(Record(float(loss.detach()), grads, micro, before, after, lrs, tokens, bool(stepped),
                              state_nonfinite))
    return records


def sq(tensors) -> float:
    return sum(float((t * t).sum()) for t in tensors)


def reference(rec: Record, layers: bool = True) -> dict[str, float]:
    """The catalogue metrics of one step, per parameter in float64."""
    out = {"trainguard_loss": rec.loss}
    gnorm = math.sqrt(sq(rec.grads.values()))
    out["trainguard_grad_norm"] = gnorm
    pnorm = math.sqrt(sq(rec.after.values()))
    out["trainguard_param_norm"] = pnorm
    out["trainguard_param_scale"] = pnorm / math.sqrt(sum(t.numel() for t in rec.after.values()))
    if rec.stepped:
        delta = math.sqrt(sq(rec.after[n] - rec.before[n] for n in rec.after))
        out["trainguard_update_ratio"] = delta / math.sqrt(sq(rec.before.values()))
        out["trainguard_effective_lr"] = delta / gnorm
    for i, lr in enumerate(rec.lrs):
        out[f'trainguard_learning_rate{{group="{i}"}}'] = lr
    if layers:
        names = sorted({layer_of(n) for n in rec.after})
        for layer in names:
            members = [n for n in rec.after if layer_of(n) == layer]
            out[f'trainguard_layer_grad_norm{{layer="{layer}"}}'] = math.sqrt(
                sq(rec.grads[n] for n in members if n in rec.grads))
            out[f'trainguard_layer_param_norm{{layer="{layer}"}}'] = math.sqrt(sq(rec.after[n] for n in members))
            moved = math.sqrt(sq(rec.after[n] - rec.before[n] for n in members))
            if rec.stepped and (moved or any(n in rec.grads for n in members)):  # else not measured: absent
                out[f'trainguard_layer_update_ratio{{layer="{layer}"}}'] = moved / math.sqrt(
                    sq(rec.before[n] for n in members))
    return out


def mccandlish(rec: Record) -> tuple[float, float]:
    """B_simple and tr(Sigma) from the paper's two-batch-size estimators (appendix A.1), with
    B_small = one micro-batch (tokens / k) and B_big = the accumulated batch."""
    k = len(rec.micro)
    b_small, b_big = rec.tokens / k, rec.tokens
    big = {n: sum(m[n] for m in rec.micro if n in m) for n in rec.grads}
    mean_big = {n: g / k for n, g in big.items()}           # mean gradient of the big batch
    g_big_sq = sq(mean_big.values())
    g_small_sq = sum(sq(m.values()) for m in rec.micro) / k  # mean over the small batches
    g2 = (b_big * g_big_sq - b_small * g_small_sq) / (b_big - b_small)
    s = (g_small_sq - g_big_sq) / (1 / b_small - 1 / b_big)
    # The agent expresses tr(Sigma) in units of the reported (accumulated) gradient: scale by
    # (|H| / |mean_big|)^2 = (the factor between the accumulated gradient and the mean one)^2.
    factor = sq(rec.grads.values()) / g_big_sq
    return s / g2, s * factor


def assert_close(got: dict[str, float], want: dict[str, float], rtol: float = RTOL) -> None:
    for key, value in want.items():
        assert key in got, f"{key} missing from latest()"
        if math.isnan(value):
            assert math.isnan(got[key]), key
        else:
            assert got[key] == pytest.approx(value, rel=rtol, abs=1e-12), key


def assert_step_and_noise_scale(got: dict[str, float], last: Record) -> None:
    """Every step metric and the noise scale of an accumulated step against the references."""
    assert_close(got, reference(last))
    b_simple, trace = mccandlish(last)
    assert got["trainguard_grad_noise_scale"] == pytest.approx(b_simple, rel=RTOL)
    assert got["trainguard_grad_variance"] == pytest.approx(trace, rel=RTOL)


def attach(model, opt, **cfg) -> ta.Agent:
    cfg.setdefault("metrics_port", None)
    cfg.setdefault("per_layer", "all")
    return ta.attach(model, opt, job="test-job", run="test-run-1", config=ta.AgentConfig(**cfg))


@pytest.fixture
def model() -> Net:
    torch.manual_seed(0)
    return Net()


@pytest.mark.parametrize("kind", ["sgd", "sgd_momentum", "adamw", "adafactor"])
def test_every_metric_matches_reference(kind: str, model: Net) -> None:
    opt = make_optimizer(kind, model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    agent = attach(model, opt, report_every=3)
    try:
        records = train(agent, model, opt, 6, sched=sched)
        got = agent.latest()
        last = records[-1]
        assert_close(got, reference(last))
        assert got["trainguard_step"] == 6
        base0 = 1e-2 if kind in ("adamw", "adafactor") else 0.1
        assert last.lrs == pytest.approx([base0 / 6, 0.03 / 6], rel=1e-12)  # LambdaLR after 5 steps
        assert got["trainguard_nonfinite_grads"] == 0
        assert got["trainguard_nonfinite_steps_total"] == 0
        assert got["trainguard_optimizer_state_nonfinite"] == 0
        assert got["trainguard_amp_skipped_steps_total"] == 0
        assert got["trainguard_agent_errors_total"] == 0
        # No accumulation, one rank: no noise scale; no scaler: no loss scale.
        for absent in ("trainguard_grad_noise_scale", "trainguard_grad_variance", "trainguard_loss_scale"):
            assert absent not in got
        # The unused module got no gradient: its layer's grad norm is 0, it has no update ratio
        # (it did not train: not a layer that stopped moving); the frozen one is absent.
        assert got['trainguard_layer_grad_norm{layer="unused"}'] == 0
        assert 'trainguard_layer_update_ratio{layer="unused"}' not in got
        assert not any('layer="frozen"' in k for k in got)
        assert got["trainguard_tokens_per_second"] * got["trainguard_step_duration_seconds"] == pytest.approx(last.tokens)
        assert got["trainguard_memory_allocated_bytes"] > 1e6
        assert got["trainguard_memory_peak_bytes"] >= got["trainguard_memory_allocated_bytes"]
        assert got["trainguard_agent_overhead_seconds"] > 0
    finally:
        agent.close()


def test_a_layer_frozen_then_unfrozen_has_no_update_ratio_while_frozen(model: Net) -> None:
    # AdamW skips a parameter without a gradient: blocks.1, frozen on steps 3 and 4, does not
    # move although its optimizer state holds momentum; on steps 5 and 6 it trains again.
    opt = make_optimizer("adamw", model)
    registry = CollectorRegistry()
    agent = ta.attach(model, opt, job="j", run="r", registry=registry,
                      config=ta.AgentConfig(metrics_port=None, per_layer="all", report_every=1))
    key = 'trainguard_layer_update_ratio{layer="%s"}'
    try:
        for step in range(1, 7):
            model.blocks[1].requires_grad_(step not in (3, 4))
            before = model.blocks[1].fc.weight.detach().clone()
            (rec,) = train(agent, model, opt, 1)
            got = agent.latest()
            assert_close(got, {k: v for k, v in reference(rec).items() if k.startswith("trainguard_layer_update")})
            frozen = step in (3, 4)
            assert model.blocks[1].fc.weight.equal(before) is frozen, step
            assert (key % "blocks.1" in got) is not frozen, step
            assert got[key % "blocks.0"] > 0 and key % "unused" not in got
            exported = {(s.labels["layer"]) for f in registry.collect() for s in f.samples
                        if s.name == "trainguard_layer_update_ratio"}
            assert exported == {"emb", "blocks.0", "head"} | (set() if frozen else {"blocks.1"}), step
    finally:
        agent.close()


def test_clipping_reports_the_norm_before_clipping(model: Net) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = attach(model, opt, report_every=1)
    try:
        records = train(agent, model, opt, 2, clip=1e-3)
        got, last = agent.latest(), records[-1]
        assert_close(got, reference(last, layers=False))
        assert got["trainguard_grad_norm"] > 100 * 1e-3
        # Plain SGD moved by lr * clipped gradient: effective lr = lr * max_norm / pre-clip norm.
        assert got["trainguard_effective_lr"] == pytest.approx(0.1 * 1e-3 / got["trainguard_grad_norm"], rel=1e-4)
    finally:
        agent.close()


@pytest.mark.parametrize("divide", [True, False])
def test_accumulation_and_noise_scale(divide: bool, model: Net) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    capture = Capture(model)
    agent = attach(model, opt, report_every=2, update_ratio="every")
    try:
        records = train(agent, model, opt, 2, accum=4, divide=divide, capture=capture)
        assert_step_and_noise_scale(agent.latest(), records[-1])
    finally:
        agent.close()


def test_noise_scale_ignores_loss_division_and_loss_scale() -> None:
    results = []
    for divide, use_scaler in ((True, False), (False, False), (True, True)):
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12) if use_scaler else None
        agent = ta.attach(model, opt, job="j", run="r", scaler=scaler,
                          config=ta.AgentConfig(metrics_port=None, report_every=1))
        train(agent, model, opt, 1, accum=3, divide=divide, scaler=scaler)
        results.append(agent.latest()["trainguard_grad_noise_scale"])
        agent.close()
    assert results[1] == pytest.approx(results[0], rel=RTOL)
    assert results[2] == pytest.approx(results[0], rel=RTOL)


@pytest.mark.parametrize("passed", [True, False], ids=["scaler_passed", "scaler_found"])
def test_grad_scaler_overflow_is_a_skipped_step(model: Net, passed: bool, caplog) -> None:
    # Not passed to attach, the scaler is found in the first step it takes (its step() runs the
    # optimizer's): that step's values are already the unscaled ones, as with the scaler passed.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1000)
    capture = Capture(model)
    agent = ta.attach(model, opt, job="j", run="r", scaler=scaler if passed else None,
                      config=ta.AgentConfig(metrics_port=None, report_every=1, per_layer="off"))

    def overflow(step: int, loss: torch.Tensor) -> torch.Tensor:
        return loss * 1e37 if step == 2 else loss  # times the scale: beyond float32, like fp16 overflow

    seen = []
    try:
        for _ in range(3):
            records = train(agent, model, opt, 1, accum=2, scaler=scaler, capture=capture,
                            loss_fault=lambda s, loss: overflow(agent.step + 1, loss))
            seen.append((records[-1], agent.latest()))
        (r1, m1), (r2, m2), (r3, m3) = seen
        assert_close(m1, reference(r1, layers=False))
        assert m1["trainguard_loss_scale"] == 256 and m1["trainguard_amp_skipped_steps_total"] == 0
        assert not r2.stepped
        assert m2["trainguard_amp_skipped_steps_total"] == 1
        assert m2["trainguard_loss_scale"] == 128
        assert not math.isfinite(m2["trainguard_grad_norm"])
        assert m2["trainguard_nonfinite_grads"] > 0
        assert m2["trainguard_nonfinite_steps_total"] == 1
        assert "trainguard_update_ratio" not in m2
        assert_close(m3, reference(r3, layers=False))
        b_simple, trace = mccandlish(r3)
        assert m3["trainguard_grad_noise_scale"] == pytest.approx(b_simple, rel=RTOL)
        assert m3["trainguard_grad_variance"] == pytest.approx(trace, rel=RTOL)
        assert m3["trainguard_amp_skipped_steps_total"] == 1 and m3["trainguard_loss_scale"] == 128
        assert m3["trainguard_agent_errors_total"] == 0
        assert agent.scaler is scaler
        found = [r for r in caplog.records if "was not passed to attach(scaler=...)" in r.getMessage()]
        assert len(found) == (0 if passed else 1) and (passed or "from step 1 on" in found[0].getMessage())
    finally:
        agent.close()


def test_nan_loss_is_reported_and_counted(model: Net) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = attach(model, opt, report_every=1)
    try:
        train(agent, model, opt, 1)
        records = train(agent, model, opt, 1, loss_fault=lambda s, loss: loss * math.nan)
        agent.end_step(torch.tensor(math.nan))  # a step with no backward: NaN loss alone counts
        got = agent.latest()
        assert math.isnan(got["trainguard_loss"])
        assert got["trainguard_nonfinite_steps_total"] == 2
        assert math.isfinite(records[-1].loss)  # the loss passed was finite; its backward was not
        assert got["trainguard_agent_errors_total"] == 0
    finally:
        agent.close()


def test_nan_in_one_gradient(model: Net) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    target = model.blocks[0].fc.weight
    poison = {"on": False}

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if poison["on"]:
            grad = grad.clone()
            grad[0, 0] = math.nan
        return grad

    target.register_hook(hook)
    agent = attach(model, opt, report_every=1)
    try:
        train(agent, model, opt, 1)
        poison["on"] = True
        records = train(agent, model, opt, 1)
        got = agent.latest()
        assert got["trainguard_nonfinite_grads"] == 1
        assert math.isnan(got["trainguard_grad_norm"])
        assert math.isnan(got['trainguard_layer_grad_norm{layer="blocks.0"}'])
        assert_close(got, {k: v for k, v in reference(records[-1]).items()
                           if "blocks.0" not in k and "layer" in k and "grad_norm" in k})
        assert got["trainguard_nonfinite_steps_total"] == 1
        # AdamW's moments of that element turned NaN; the reference counted them.
        assert got["trainguard_optimizer_state_nonfinite"] == records[-1].state_nonfinite > 0
        assert got["trainguard_agent_errors_total"] == 0
    finally:
        agent.close()


def test_error_inside_the_agent_is_counted_and_training_goes_on(model: Net, monkeypatch, caplog) -> None:
    from trainer_agent.measure import stats

    def broken(*args, **kwargs):
        raise RuntimeError("injected failure")

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = attach(model, opt, report_every=1)
    try:
        train(agent, model, opt, 1)
        assert agent.latest()["trainguard_agent_errors_total"] == 0
        monkeypatch.setattr(stats, "sq_norms", broken)
        before = [p.detach().clone() for p in model.parameters()]
        with caplog.at_level("WARNING", logger="trainer_agent.agent"):
            train(agent, model, opt, 3)
        errors = agent.latest()["trainguard_agent_errors_total"]
        assert errors >= 3
        # Training went on: the optimizer kept updating the weights.
        assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        # Logged once per kind, not once per occurrence.
        messages = [r.getMessage() for r in caplog.records if "trainguard agent" in r.getMessage()]
        assert 0 < len(messages) < errors
        monkeypatch.undo()
        train(agent, model, opt, 1)
        assert agent.latest()["trainguard_step"] == 5
    finally:
        agent.close()


def test_update_ratio_every_step_and_weights_changed_between_steps(model: Net) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    agent = attach(model, opt, report_every=1, update_ratio="every")
    try:
        for step in range(4):
            if step == 2:
                with torch.no_grad():  # e.g. a weight reload between steps: ||W_before|| changes
                    model.head.weight.mul_(3.0)
            records = train(agent, model, opt, 1)
            assert_close(agent.latest(), reference(records[-1]))
    finally:
        agent.close()


def test_nonfinite_count_scans_only_what_it_must() -> None:
    from trainer_agent.measure import stats

    cpu = torch.device("cpu")
    finite = torch.ones(5)
    bad = torch.tensor([1.0, math.nan, math.inf, -math.inf])
    huge = torch.full((4,), 1e30)  # finite, but its float32 norm overflows to inf
    assert float(stats.nonfinite_count([finite, bad, huge, torch.arange(3)], cpu)) == 3
    assert float(stats.nonfinite_count([finite, huge], cpu)) == 0
    sq = stats.sq_norms([finite, bad], cpu)
    assert float(sq[0]) == pytest.approx(5, rel=1e-7) and math.isnan(float(sq[1]))
    b_simple, trace = stats.noise_scale(torch.tensor(10.0), torch.tensor(4.0), 4, 2.0)
    # |G|^2 = (4*4 - 10)/3 = 2; tr(S) = 2*4*(10-4)/3 = 16; B = 8.
    assert (float(b_simple), float(trace)) == (8.0, 16.0)


def test_nonfinite_count_device_scan_of_mixed_dtypes() -> None:
    """The accelerator path with float64 tensors beside float32 and float16 ones (a float64
    tensor's count may not be narrowed to float32: that raised before), against an element-wise
    count."""
    from trainer_agent.measure import stats

    def at(dtype, **values):
        t = torch.zeros(50, dtype=dtype)
        for i, v in values.items():
            t[int(i[1:])] = v
        return t

    tensors = [at(torch.float64, i3=math.nan), at(torch.float32, i1=math.inf, i2=-math.inf),
               at(torch.float64, i0=-math.inf), at(torch.float16, i9=math.nan), None, at(torch.float64)]
    expected = sum(int((~torch.isfinite(t)).sum()) for t in tensors if t is not None)
    assert expected == 5
    for scan in ("device", "suspects"):
        assert float(stats.nonfinite_count(tensors, torch.device("cpu"), scan=scan)) == expected


def test_nonfinite_count_device_scan_path() -> None:
    """The accelerator path (fused scan of every tensor, in buckets), run on the CPU."""
    from trainer_agent.measure import stats

    cpu = torch.device("cpu")
    tensors = [torch.ones(5), torch.tensor([1.0, math.nan, math.inf, -math.inf]), None,
               torch.full((4,), 1e30), torch.tensor([math.nan], dtype=torch.float16), torch.arange(3)]
    assert float(stats.nonfinite_count(tensors, cpu, scan="device")) == 4
    assert float(stats.nonfinite_count(tensors, cpu, scan="suspects")) == 4
    assert float(stats.nonfinite_count([torch.ones(3)], cpu, scan="device")) == 0
    with pytest.raises(ValueError):
        stats.nonfinite_count(tensors, cpu, scan="sometimes")


def test_nonfinite_count_device_scan_in_small_buckets(monkeypatch) -> None:
    from trainer_agent.measure import stats

    monkeypatch.setattr(stats, "_SCAN_BUCKET_BYTES", 8)  # one tensor per bucket
    tensors = [torch.tensor([math.nan, 1.0]), torch.ones(3), torch.tensor([math.inf, -math.inf, 2.0])]
    assert float(stats.nonfinite_count(tensors, torch.device("cpu"), scan="device")) == 3


def test_bucket_nonfinite_counts_as_nonfinite_count(monkeypatch) -> None:
    """The count over buckets (``ParamIndex.grads()``: each of one device and dtype, as the report
    step reads them) equals an element-wise count, on both scans, through the fused scan of small
    buckets and the staged one of a bucket of many tensors (its plan from the settled layout)."""
    from trainer_agent.measure import staged, stats

    monkeypatch.setattr(staged, "ON_CPU", True)
    cpu = torch.device("cpu")
    g = torch.Generator().manual_seed(6)
    many = [torch.randn(int(n), generator=g) for n in torch.randint(1, 40, (staged.STAGED_MIN_TENSORS,), generator=g)]
    many[7][0], many[90][-1] = math.nan, -math.inf
    small64 = [torch.randn(9, dtype=torch.float64, generator=g) for _ in range(3)]
    small64[1][4] = math.inf
    halves = [torch.tensor([math.nan, 1.0, math.nan], dtype=torch.float16)]
    buckets = [staged.Settled(many, staged.Layout(many)), small64, halves, [torch.arange(3)]]
    expected = sum(int((~torch.isfinite(t)).sum()) for b in buckets for t in b if t.is_floating_point())
    assert expected == 5
    for scan in ("device", "suspects"):
        assert float(stats.bucket_nonfinite(buckets, cpu, scan=scan)) == expected
    assert float(stats.bucket_nonfinite(buckets[:1], cpu, scan="device")) == 2  # the staged count alone
    assert float(stats.bucket_nonfinite([], cpu, scan="device")) == 0
    with pytest.raises(ValueError):
        stats.bucket_nonfinite(buckets, cpu, scan="sometimes")


def test_device_values_for_the_control_plane(model: Net) -> None:
    """grad_norm_device holds the pre-clip norm when optimizer.step() starts; loss_device and
    step_finite_device describe the last end_step; rank_values has this rank's values."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = attach(model, opt, report_every=1)
    seen = []
    opt.register_step_pre_hook(lambda *a: seen.append(float(agent.grad_norm_device)))
    try:
        records = train(agent, model, opt, 1, clip=1e-3)
        assert seen[0] == pytest.approx(reference(records[-1])["trainguard_grad_norm"], rel=RTOL)
        assert agent.grad_norm_device is None  # reset for the next step
        assert float(agent.loss_device) == pytest.approx(records[-1].loss, rel=1e-6)
        assert bool(agent.step_finite_device)
        assert agent.rank_values["loss"] == [pytest.approx(records[-1].loss, rel=1e-6)]
        assert agent.rank_values["grad_norm"] == [pytest.approx(seen[0], rel=1e-9)]
    finally:
        agent.close()


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("refresh", [True, False])
@pytest.mark.parametrize("chunk", [7, 16])
def test_update_sq_norms_against_float64(monkeypatch, chunked: bool, refresh: bool, chunk: int) -> None:
    """Both passes (cache-sized chunks on the CPU, in-place difference on an accelerator), with
    tensors larger than a chunk, several buckets and non-contiguous parameters. With chunks of 7
    elements every chunk is one row (the 20-element tensors span three); with 16 the 4-element
    tensors and the 20-element ones' last rows share chunks of four rows (staged)."""
    from trainer_agent.measure import chunked_updates, stats

    monkeypatch.setattr(chunked_updates, "UPDATE_CHUNK", chunk)
    g = torch.Generator().manual_seed(3)
    after = [[torch.randn(4, 5, generator=g), torch.randn(3, generator=g), torch.randn(5, 4, generator=g).t(),
              torch.randn(4, generator=g), torch.randn(2, 2, generator=g).t(), torch.randn(4, generator=g)],
             [torch.randn(2, 11, generator=g, dtype=torch.float64), torch.randn(4, generator=g, dtype=torch.float64)]]
    before = [[a + 0.01 * torch.randn(a.shape, generator=g, dtype=a.dtype) for a in bucket] for bucket in after]
    ref_delta = [float((b.double() - a.double()).pow(2).sum()) for bb, ab in zip(before, after) for b, a in zip(bb, ab)]
    ref_param = [float(a.double().pow(2).sum()) for ab in after for a in ab]
    ref_before = [float(b.double().pow(2).sum()) for bb in before for b in bb]
    snapshot = [[b.clone(memory_format=torch.contiguous_format) for b in bucket] for bucket in before]
    cache: dict = {}
    for _ in range(2):  # the second call reuses the cached buffer and chunk index
        snap = [[b.clone() for b in bucket] for bucket in snapshot]
        delta, param, before_sq, refreshed = stats.update_sq_norms(
            snap, after, torch.device("cpu"), cache, before_norms=True, refresh=refresh, chunked=chunked)
        assert delta.tolist() == pytest.approx(ref_delta, rel=1e-5)
        assert param.tolist() == pytest.approx(ref_param, rel=1e-6)
        assert before_sq.tolist() == pytest.approx(ref_before, rel=1e-6)
        assert refreshed == (refresh and chunked)
        if chunked:
            rows = [c.rows for c in cache["update_plan"].chunks]
            assert max(rows) == (1 if chunk == 7 else 4), rows
        if refreshed:  # the snapshot now holds W_after, for a measured step that follows
            assert all(torch.equal(s, a) for sb, ab in zip(snap, after) for s, a in zip(sb, ab))
        elif chunked:  # the chunked pass leaves W_before alone
            assert all(torch.equal(s, b) for sb, bb in zip(snap, snapshot) for s, b in zip(sb, bb))


@pytest.mark.parametrize("update_ratio", ["every", "report"])
def test_large_and_mixed_dtype_parameters_match_reference(monkeypatch, update_ratio: str) -> None:
    """Parameters larger than an update chunk and two dtype buckets (their order differs from the
    optimizer's): every metric, per layer included, equals the float64 reference."""
    from trainer_agent.measure import chunked_updates

    monkeypatch.setattr(chunked_updates, "UPDATE_CHUNK", 50)  # emb (512) and head (544) span chunks
    torch.manual_seed(4)
    model = Net()
    model.blocks[0].double()  # a float64 layer between float32 ones: two buckets
    model.blocks[0].forward = lambda x, fc=model.blocks[0].fc: x + torch.tanh(fc(x.double())).float()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    agent = attach(model, opt, report_every=1, update_ratio=update_ratio)
    try:
        for _ in range(3):
            records = train(agent, model, opt, 1)
            assert_close(agent.latest(), reference(records[-1]))
    finally:
        agent.close()


class SkipFirstMicro(Net):
    """The first micro-batch of every step bypasses blocks[1]: its gradient arrives only with the
    second backward pass, into an empty ``.grad``."""

    def __init__(self, accum: int) -> None:
        super().__init__()
        self.accum, self.calls = accum, 0

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        skip = self.calls % self.accum == 0
        self.calls += 1
        x = self.emb(ids[:, :-1])
        for i, block in enumerate(self.blocks):
            if not (skip and i == 1):
                x = block(x)
        logits = self.head(self.frozen(x))
        return F.cross_entropy(logits.reshape(-1, V), ids[:, 1:].reshape(-1))


@pytest.mark.parametrize("held_bytes", [1, None])
def test_noise_scale_with_held_and_immediate_gradient_norms(monkeypatch, held_bytes: int | None) -> None:
    """Incoming gradients of later backward passes are normed in fused batches (held up to a
    byte limit; 1 byte: one at a time) or at once when ``.grad`` is still empty."""
    from trainer_agent.measure import backward_pass as agent_module

    if held_bytes is not None:
        monkeypatch.setattr(agent_module, "HELD_GRAD_BYTES", held_bytes)
    torch.manual_seed(5)
    model = SkipFirstMicro(accum=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    capture = Capture(model)
    agent = attach(model, opt, report_every=1)
    try:
        for _ in range(2):
            records = train(agent, model, opt, 1, accum=3, capture=capture)
            last = records[-1]
            assert "blocks.1.fc.weight" not in last.micro[0] and "blocks.1.fc.weight" in last.micro[1]
            assert_step_and_noise_scale(agent.latest(), last)
    finally:
        agent.close()
