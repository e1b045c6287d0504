"""The agent on a CUDA device: metrics against the float64 reference under fp16 autocast with a
GradScaler, accumulation and clipping; and no host-device synchronisation inside the steps
(``torch.cuda.set_sync_debug_mode("error")`` turns every sync into an error, which the agent
would count). Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

import trainer_agent as ta
from tests.agent.test_agent_metrics import Capture, Net, assert_close, batch, mccandlish, reference, train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cuda_amp_accumulation_clipping_matches_reference() -> None:
    torch.manual_seed(0)
    model = Net().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10)
    capture = Capture(model)
    agent = ta.attach(model, opt, job="cuda", run="cuda-1", scaler=scaler,
                      config=ta.AgentConfig(metrics_port=0, report_every=2, per_layer="all"))
    try:
        records = train(agent, model, opt, 4, accum=2, clip=0.05, scaler=scaler, capture=capture,
                        autocast=torch.autocast("cuda", dtype=torch.float16))
        got = agent.latest()
        assert_close(got, reference(records[-1]))
        b_simple, trace = mccandlish(records[-1])
        assert got["trainguard_grad_noise_scale"] == pytest.approx(b_simple, rel=1e-5)
        assert got["trainguard_grad_variance"] == pytest.approx(trace, rel=1e-5)
        assert got["trainguard_loss_scale"] == scaler.get_scale()
        assert 0 < got["trainguard_memory_allocated_bytes"] <= got["trainguard_memory_peak_bytes"] <= torch.cuda.max_memory_allocated()
        assert got["trainguard_agent_errors_total"] == 0
    finally:
        agent.close()


def test_cuda_steps_do_not_sync() -> None:
    torch.manual_seed(0)
    model = Net().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    agent = ta.attach(model, opt, job="cuda", run="cuda-2",
                      config=ta.AgentConfig(metrics_port=None, report_every=2, per_layer="all",
                                            update_ratio="every", vocab_size=32))
    batches = [[batch(s, j).cuda() for j in range(2)] for s in range(6)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for micro in batches:
            for ids in micro:
                agent.observe_batch(ids)
                loss = model.loss(ids) / 2
                loss.backward()
            opt.step()
            opt.zero_grad()
            agent.end_step(loss, tokens=2 * ids.numel())
    finally:
        torch.cuda.set_sync_debug_mode(0)
    try:
        got = agent.latest()
        assert got["trainguard_agent_errors_total"] == 0
        assert got["trainguard_step"] == 6
        assert "trainguard_grad_noise_scale" in got and "trainguard_update_ratio" in got
        assert got["trainguard_data_sequences_total"] == 6 * 2 * 4
    finally:
        agent.close()


def test_cuda_memory_trace_charges_forward_allocations_and_growth() -> None:
    """The allocator branch of the memory trace: a layer caching its CUDA activations is charged
    with them per step, and the allocator's growth per step equals the cache's."""
    from tests.agent.test_memory_trace import Cache

    torch.manual_seed(0)
    width, rows = 256, 64
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), Cache(), torch.nn.Linear(width, 1)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = ta.attach(model, opt, job="m", run="m-1", config=ta.AgentConfig(metrics_port=None))
    agent.trace_memory(steps=3)
    trace = agent.diagnostics.trace
    for _ in range(4):
        loss = model(torch.randn(rows, width, device="cuda")).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        agent.end_step(loss.detach())
    activation = rows * width * 4
    assert agent.memory_report[0].owner == "1" and agent.memory_report[0].bytes_per_step == activation
    assert trace.cuda_growth_per_step == pytest.approx(activation, rel=0.1)
    # the Tanh's forward leaves its output allocated (kept by the cache); the Cache's own forward allocates nothing
    assert trace.cuda_forward["1"] >= activation and abs(trace.cuda_forward["2"]) < activation
    agent.close()


@pytest.mark.parametrize("kind", ["fused", "capturable"])
def test_a_device_step_count_is_reported_as_the_state_age_without_a_sync(kind: str) -> None:
    """Fused and capturable Adam keep ``state[p]["step"]`` on the device: the report copies it
    with its other device values (a read of it would sync, an error here)."""
    torch.manual_seed(0)
    model = Net().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **{kind: True})
    agent = ta.attach(model, opt, job="cuda", run=f"cuda-age-{kind}",
                      config=ta.AgentConfig(metrics_port=None, report_every=2))
    batches = [batch(s, 0).cuda() for s in range(4)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for ids in batches:
            loss = model.loss(ids)
            loss.backward()
            opt.step()
            opt.zero_grad()
            agent.end_step(loss)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    try:
        got = agent.latest()
        assert all(s["step"].device.type == "cuda" for s in opt.state.values())
        assert got["trainguard_agent_errors_total"] == 0
        assert got["trainguard_optimizer_state_steps"] == 4.0
    finally:
        agent.close()


def test_gpu_health_reads_the_gpu_cuda_runs_on() -> None:
    """NVML's handle is the one of the GPU this rank's CUDA device is (found by its UUID, as
    ``torch.cuda.get_device_properties`` formats it: a misread UUID falls back on NVML's index,
    another GPU wherever CUDA_VISIBLE_DEVICES hides some), and its readings reach ``latest()``."""
    pynvml = pytest.importorskip("pynvml")
    model = Net().cuda()
    agent = ta.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), job="cuda", run="cuda-gpu",
                      config=ta.AgentConfig(metrics_port=None, report_every=1))
    try:
        assert agent.gpu is not None
        uuid = pynvml.nvmlDeviceGetUUID(agent.gpu.handle)
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        assert uuid == f"GPU-{torch.cuda.get_device_properties(torch.cuda.current_device()).uuid}"
        loss = model.loss(batch(0, 0).cuda())
        loss.backward()
        agent.end_step(loss)
        assert agent.latest()["trainguard_gpu_memory_total_bytes"] > 0
    finally:
        agent.close()
