"""The pre-flight checks past the one real batch (``trainer_agent/diagnostics/preflight_probes.py``): for each,
a case that trips it and a healthy one, through ``Agent.preflight``; the run's state bit for bit
untouched by all of them."""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import trainer_agent as ta
from tests.agent.test_preflight import _same, _snapshot

VOCAB, SEQ = 32, 12


class TinyLM(nn.Module):
    """A token model with a configurable loss: ``naive`` takes log(softmax) (overflows to -inf for
    a large logit), ``mean_over_tokens`` divides by the unmasked tokens (0/0 on all padding)."""

    def __init__(self, *, naive: bool = False, init_std: float | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 16)
        self.hidden = nn.Linear(16, 16)
        self.head = nn.Linear(16, VOCAB)
        self.naive = naive
        if init_std is not None:
            nn.init.normal_(self.hidden.weight, std=init_std)

    def forward(self, batch: dict) -> torch.Tensor:
        ids, mask = batch["input_ids"], batch["attention_mask"].float()
        logits = self.head(torch.tanh(self.hidden(self.emb(ids))))
        if self.naive:
            logp = torch.log(torch.softmax(logits.float(), -1))
        else:
            logp = torch.log_softmax(logits.float(), -1)
        nll = -logp[..., :-1, :].gather(-1, ids[..., 1:, None]).squeeze(-1)
        m = mask[..., 1:]
        return (nll * m).sum() / m.sum()


def _batch(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _agent(model: nn.Module, **cfg) -> ta.Agent:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    return ta.attach(model, opt, job="pf", run="pf-probe", config=ta.AgentConfig(metrics_port=None, **cfg))


def _by(report) -> dict:
    return {c.name: c for c in report.checks}


def _init_std(std: float, fan_in: int) -> float:
    return std * math.sqrt(fan_in)


def test_init_distribution_passes_torch_defaults_and_warns_for_a_badly_scaled_or_constant_matrix() -> None:
    healthy = _agent(TinyLM())
    check = _by(healthy.preflight(_batch(), loss_fn=lambda m, b: m(b), clip_grad_norm=1.0))["init_distribution"]
    assert check.status == "pass"
    rows = check.values["layers"]
    assert set(rows) == {"hidden.weight", "head.weight"}  # the embedding is not a fan-in layer
    w = healthy.model.hidden.weight.detach().double()
    assert rows["hidden.weight"]["std_x_sqrt_fan_in"] == pytest.approx(_init_std(float(w.std()), 16), rel=1e-12)

    big = _agent(TinyLM(init_std=3.0))  # std 3 on fan-in 16: x12 per layer
    check = _by(big.preflight(_batch(), loss_fn=lambda m, b: m(b), clip_grad_norm=1.0))["init_distribution"]
    assert check.status == "warn" and "hidden.weight" in check.detail and "grow" in check.detail
    model = TinyLM()
    nn.init.zeros_(model.head.weight)
    check = _by(_agent(model).preflight(_batch(), loss_fn=lambda m, b: m(b), clip_grad_norm=1.0))["init_distribution"]
    assert check.status == "warn" and "head.weight is constant" in check.detail
    model = TinyLM()
    with torch.no_grad():
        model.hidden.weight[0, 0] = float("nan")
    check = _by(_agent(model).preflight(_batch(), loss_fn=lambda m, b: m(b), clip_grad_norm=1.0))["init_distribution"]
    assert check.status == "fail" and "hidden.weight" in check.detail


def test_loss_boundary_passes_a_stable_loss_and_names_each_input_that_breaks_one() -> None:
    agent = _agent(TinyLM())
    check = _by(agent.preflight(_batch(), loss_fn=lambda m, b: m(b), clip_grad_norm=1.0, pad_id=0,
                                max_length=40))["loss_boundary"]
    # The stable loss is finite everywhere but on an all-padding batch, where it divides 0 by 0:
    # avoidable in the pipeline, so a warning that names it.
    assert check.status == "warn" and check.detail.startswith("non-finite loss or gradients on all padding")
    inputs = check.values["inputs"]
    assert set(inputs) == {"a single repeated token", "all padding", "the maximum length (40)", "the largest logits"}
    assert math.isnan(inputs["all padding"]["loss"])
    assert all(inputs[k]["finite"] for k in inputs if k != "all padding")
    # The largest logit of float32 the loss can hold: sqrt(max) on token 0 at every position, so
    # each position whose target is not token 0 costs about sqrt(max), the others about 0.
    big = math.sqrt(torch.finfo(torch.float32).max)
    targets = _batch()["input_ids"][:, 1:]
    share = float((targets != 0).double().mean())
    assert inputs["the largest logits"]["loss"] == pytest.approx(big * share, rel=1e-6)

    naive = _agent(TinyLM(naive=True))
    check = _by(naive.preflight(_batch(), loss_fn=lambda m, b: m(b), clip_grad_norm=1.0))["loss_boundary"]
    assert check.status == "fail" and "the largest logits" in check.detail
    assert check.values["not_tried"] == ["the maximum length (pass max_length=)"]

    float_batch = _agent(nn.Linear(3, 1))
    check = _by(float_batch.preflight(torch.randn(4, 3), loss_fn=lambda m, b: m(b).sum(), clip_grad_norm=1.0))["loss_boundary"]
    assert check.status == "skip"


class Overflowing(nn.Module):
    """Activations of about 1e5 in ``big``: finite in float32 and bfloat16, inf in float16."""

    def __init__(self, gain: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 8)
        self.big = nn.Linear(8, 8)
        self.gain = gain
        with torch.no_grad():
            self.big.weight.fill_(gain / 8)
            self.big.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.big(torch.ones_like(self.inp(x))) / self.gain).square().mean()


def test_amp_overflow_fails_a_float16_overflow_per_module_and_passes_bfloat16() -> None:
    x = torch.randn(4, 8)
    agent = _agent(Overflowing(gain=1e5))
    check = _by(agent.preflight(x, loss_fn=lambda m, b: m(b), clip_grad_norm=1.0, amp_dtype=torch.float16))["amp_overflow"]
    assert check.status == "fail" and check.values["forward_overflow"] == {"big": 4 * 8}
    assert "float16 overflows in the forward pass of big" == check.detail
    check = _by(_agent(Overflowing(gain=1e5)).preflight(x, loss_fn=lambda m, b: m(b), clip_grad_norm=1.0,
                                                        amp_dtype=torch.bfloat16))["amp_overflow"]
    assert check.status == "pass" and check.values["forward_overflow"] == {}
    # 1e4 fits float16 (largest 65504) with less than 8x headroom: a warning naming the module.
    check = _by(_agent(Overflowing(gain=1e4)).preflight(x, loss_fn=lambda m, b: m(b), clip_grad_norm=1.0,
                                                        amp_dtype=torch.float16))["amp_overflow"]
    assert check.status == "warn" and check.values["near_limit"] == ["big"]
    check = _by(_agent(Overflowing(gain=10.0)).preflight(x, loss_fn=lambda m, b: m(b), clip_grad_norm=1.0))["amp_overflow"]
    assert check.status == "skip"


class Tokens(Dataset):
    def __init__(self, n: int, delay_s: float = 0.0) -> None:
        self.n, self.delay_s = n, delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if self.delay_s:
            import time
            time.sleep(self.delay_s)
        ids = torch.full((SEQ,), i % VOCAB)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


class FakeClock:
    """Advances by ``per_call`` at every reading: a loader's rate is then known exactly."""

    def __init__(self, per_call: float) -> None:
        self.t, self.per_call = 0.0, per_call

    def __call__(self) -> float:
        self.t += self.per_call
        return self.t


def test_input_pipeline_compares_the_loaders_rate_with_the_steps_demand_and_restores_every_generator() -> None:
    from trainer_agent.diagnostics.preflight_probes import PIPELINE_BATCHES, input_pipeline_check

    gen = torch.Generator().manual_seed(7)
    loader = DataLoader(Tokens(64), batch_size=4, shuffle=True, generator=gen)
    state, rng, py = gen.get_state(), torch.get_rng_state(), random.getstate()
    # The clock moves 0.01 s at every reading: after the first batch it is read at the start, once
    # before each batch (the time budget) and at the end: the batches span N + 1 readings.
    name, status, detail, values = input_pipeline_check(loader, step_tokens=4 * SEQ, step_seconds=1.0,
                                                        clock=FakeClock(0.01))
    assert torch.equal(gen.get_state(), state) and torch.equal(torch.get_rng_state(), rng) and random.getstate() == py
    assert values["batches"] == PIPELINE_BATCHES
    assert values["tokens_per_second"] == pytest.approx(PIPELINE_BATCHES * 4 * SEQ / (0.01 * (PIPELINE_BATCHES + 1)))
    assert values["step_tokens_per_second"] == pytest.approx(4 * SEQ)
    # num_workers=0: nothing is prefetched while the step runs.
    assert status == "warn" and "0 batch(es) prefetched" in detail and values["prefetch_batches"] == 0
    # A step that consumes more than the loader gives: input-bound.
    _, status, detail, _ = input_pipeline_check(loader, step_tokens=10**9, step_seconds=1.0, clock=FakeClock(0.01))
    assert status == "fail" and "training will wait for input" in detail
    assert input_pipeline_check(iter(loader), 48, 1.0)[1] == "skip"


def test_input_pipeline_passes_a_prefetching_token_loader_and_keeps_its_position(tmp_path) -> None:
    import numpy as np

    from trainer_agent.dataset import TokenBatches, TokenLoader, write_shards
    from trainer_agent.diagnostics.preflight_probes import input_pipeline_check

    rng = np.random.default_rng(0)
    infos = write_shards(tmp_path / "ds", [rng.integers(0, VOCAB, 40) for _ in range(64)], vocab_size=VOCAB,
                         tokens_per_shard=10**6)
    batches = TokenBatches(infos, seq_len=SEQ, batch_size=4, rank=0, world_size=1, seed=3)
    loader = TokenLoader(batches, num_workers=0, prefetch=8)
    it = iter(loader)
    first = next(it)["input_ids"].clone()
    it.close()
    position = loader.state_dict()
    name, status, detail, values = input_pipeline_check(loader, step_tokens=4 * SEQ, step_seconds=10.0)
    assert status == "pass" and values["prefetch_batches"] == 8, detail
    assert loader.state_dict() == position
    assert not torch.equal(next(iter(loader))["input_ids"], first)  # the next batch, not the one before


def test_the_probes_leave_the_run_bit_for_bit_untouched() -> None:
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    model(_batch(9)).backward()
    opt.step()
    agent = ta.attach(model, opt, job="pf", run="pf-probe2", config=ta.AgentConfig(metrics_port=None))
    gen = torch.Generator().manual_seed(1)
    loader = DataLoader(Tokens(32), batch_size=4, shuffle=True, generator=gen, num_workers=0)
    before, gen_state = _snapshot(model, opt), gen.get_state()
    report = agent.preflight(_batch(), loss_fn=lambda m, b: m(b), clip_grad_norm=1.0, pad_id=0, max_length=24,
                             amp_dtype=torch.bfloat16, loader=loader)
    assert _same(_snapshot(model, opt), before) and torch.equal(gen.get_state(), gen_state)
    assert agent.step == 0
    assert {c.name for c in report.checks} >= {"init_distribution", "loss_boundary", "amp_overflow", "input_pipeline"}


@pytest.mark.parametrize("kwargs, message", [
    ({"amp_dtype": torch.float32}, "amp_dtype must be torch.float16 or torch.bfloat16"),
    ({"pad_id": -1}, "pad_id must be an integer >= 0"),
    ({"max_length": 0}, "max_length must be a positive integer"),
    ({"loader": 3}, "loader must be iterable"),
])
def test_bad_probe_options_are_refused(kwargs, message) -> None:
    agent = _agent(TinyLM())
    with pytest.raises(ValueError, match=message):
        agent.preflight(_batch(), loss_fn=lambda m, b: m(b), **kwargs)
