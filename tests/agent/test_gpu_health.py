"""GPU health (``trainer_agent/measure/gpu_health.py``) against a fake NVML module: every reading, the
queries a GPU does not support left out, and no GPU metrics on the CPU."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from torch import nn

import trainer_agent as ta
from trainguard.protocol.catalog import BY_NAME
from trainer_agent.measure.gpu_health import GpuHealth


class NotSupported(Exception):
    pass


class FakeNvml:
    NVML_TEMPERATURE_GPU, NVML_CLOCK_SM = 0, 1
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC = 1, 0

    def __init__(self, ecc: bool = True) -> None:
        self.ecc, self.inits, self.handles = ecc, 0, []

    def nvmlInit(self) -> None:
        self.inits += 1

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:
        self.handles.append(i)
        return f"gpu{i}"

    def nvmlDeviceGetUtilizationRates(self, h: str) -> SimpleNamespace:
        return SimpleNamespace(gpu=87, memory=40)

    def nvmlDeviceGetMemoryInfo(self, h: str) -> SimpleNamespace:
        return SimpleNamespace(used=30 << 30, total=80 << 30, free=50 << 30)

    def nvmlDeviceGetTemperature(self, h: str, sensor: int) -> int:
        assert sensor == self.NVML_TEMPERATURE_GPU
        return 71

    def nvmlDeviceGetClockInfo(self, h: str, clock: int) -> int:
        assert clock == self.NVML_CLOCK_SM
        return 1410

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h: str) -> int:
        return 0x20 | 0x40  # SW thermal + HW thermal slowdown

    def nvmlDeviceGetTotalEccErrors(self, h: str, kind: int, counter: int) -> int:
        if not self.ecc:
            raise NotSupported("ECC not supported")
        assert (kind, counter) == (self.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, self.NVML_VOLATILE_ECC)
        return 2


def test_readings_of_a_fake_nvml() -> None:
    fake = FakeNvml()
    gpu = GpuHealth.open(3, fake)
    assert gpu is not None and fake.handles == [3]
    assert gpu.read() == {
        "trainguard_gpu_utilization_ratio": 0.87,
        "trainguard_gpu_memory_used_bytes": float(30 << 30),
        "trainguard_gpu_memory_total_bytes": float(80 << 30),
        "trainguard_gpu_temperature_celsius": 71.0,
        "trainguard_gpu_sm_clock_hertz": 1.41e9,
        "trainguard_gpu_throttle_reasons": float(0x60),
        "trainguard_gpu_ecc_uncorrected_errors_total": 2.0,
    }
    assert all(k in BY_NAME for k in gpu.read())


class FakeNvmlOfAMachine(FakeNvml):
    """A machine of 8 GPUs as NVML numbers them, each found by its UUID too."""

    def nvmlDeviceGetHandleByUUID(self, uuid: bytes) -> str:
        index = int(uuid.decode().removeprefix("GPU-00000000-0000-0000-0000-00000000000"))
        return self.nvmlDeviceGetHandleByIndex(index)


def test_the_gpu_is_found_by_its_uuid_whatever_cuda_numbers_it(monkeypatch) -> None:
    """A rank that sees only the machine's GPU 5 (CUDA_VISIBLE_DEVICES=5) sees it as CUDA device 0:
    its readings are GPU 5's, found by the UUID CUDA gives, not NVML's GPU 0's."""
    uuids = {0: "00000000-0000-0000-0000-000000000005"}

    def properties(index: int) -> SimpleNamespace:
        return SimpleNamespace(uuid=uuids[index])

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    fake = FakeNvmlOfAMachine()
    gpu = GpuHealth.open(0, fake)
    assert gpu is not None and gpu.handle == "gpu5" and fake.handles == [5]
    # where CUDA cannot name the device (no such ordinal here), NVML's index
    fake = FakeNvmlOfAMachine()
    assert GpuHealth.open(1, fake).handle == "gpu1" and fake.handles == [1]


def test_an_unsupported_query_is_left_out_and_a_missing_nvml_gives_none() -> None:
    gpu = GpuHealth.open(0, FakeNvml(ecc=False))
    assert "trainguard_gpu_ecc_uncorrected_errors_total" not in gpu.read()
    assert "trainguard_gpu_temperature_celsius" in gpu.read()

    class Broken:
        def nvmlInit(self) -> None:
            raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    assert GpuHealth.open(0, Broken()) is None


def test_no_gpu_metrics_on_the_cpu() -> None:
    model = nn.Linear(3, 1)
    agent = ta.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), job="g", run="g-1",
                      config=ta.AgentConfig(metrics_port=None, report_every=1))
    model(torch.ones(2, 3)).sum().backward()
    agent.end_step(1.0)
    assert agent.gpu is None and not any(k.startswith("trainguard_gpu_") for k in agent.latest())
    agent.close()


class NvmlError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


class FakeNvmlEvents(FakeNvml):
    """NVML with an XID event queue: ``nvmlEventSetWait`` answers queued events, then the
    timeout error (10) as the real library does when nothing is queued within the timeout."""

    NVML_ERROR_TIMEOUT = 10
    nvmlEventTypeXidCriticalError = 0x8
    nvmlEventTypeSingleBitEccError = 0x1

    def __init__(self, registers: bool = True) -> None:
        super().__init__()
        self.registers = registers
        self.queue: list[SimpleNamespace] = []
        self.waits: list[int] = []
        self.registered: list[tuple[str, int]] = []
        self.freed = 0

    def xid(self, code: int) -> None:
        self.queue.append(SimpleNamespace(eventType=self.nvmlEventTypeXidCriticalError, eventData=code, device="gpu0"))

    def nvmlEventSetCreate(self) -> str:
        return "set"

    def nvmlDeviceRegisterEvents(self, h: str, types: int, events: str) -> None:
        if not self.registers:
            raise NvmlError(3)  # NVML_ERROR_NOT_SUPPORTED
        self.registered.append((h, types))

    def nvmlEventSetWait(self, events: str, timeout_ms: int) -> SimpleNamespace:
        self.waits.append(timeout_ms)
        if not self.queue:
            raise NvmlError(self.NVML_ERROR_TIMEOUT)
        return self.queue.pop(0)

    def nvmlEventSetFree(self, events: str) -> None:
        self.freed += 1


def test_xid_events_are_counted_without_blocking() -> None:
    fake = FakeNvmlEvents()
    gpu = GpuHealth.open(0, fake)
    assert gpu.watches_xid and fake.registered == [("gpu0", fake.nvmlEventTypeXidCriticalError)]
    first = gpu.read()
    assert first["trainguard_gpu_xid_errors_total"] == 0.0 and "trainguard_gpu_last_xid" not in first
    fake.xid(48)
    fake.queue.append(SimpleNamespace(eventType=fake.nvmlEventTypeSingleBitEccError, eventData=0, device="gpu0"))
    fake.xid(79)
    got = gpu.read()
    assert got["trainguard_gpu_xid_errors_total"] == 2.0 and got["trainguard_gpu_last_xid"] == 79.0
    assert set(fake.waits) == {0}  # never waits
    assert gpu.take_xid() == 79.0 and gpu.take_xid() == 0.0  # once per report interval; 0: none since
    assert all(k in BY_NAME for k in got)
    gpu.close()
    assert fake.freed == 1


def test_a_driver_without_events_leaves_xid_out() -> None:
    gpu = GpuHealth.open(0, FakeNvmlEvents(registers=False))
    assert gpu is not None and not gpu.watches_xid
    assert "trainguard_gpu_xid_errors_total" not in gpu.read() and math.isnan(gpu.take_xid())


def test_an_xid_reaches_the_report_vector_of_its_rank() -> None:
    model = nn.Linear(3, 1)
    agent = ta.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), job="g", run="g-1",
                      config=ta.AgentConfig(metrics_port=None, report_every=1))
    fake = FakeNvmlEvents()
    agent.gpu = GpuHealth.open(0, fake)  # a CPU run with a GPU's NVML, as on a GPU node
    seen = []
    for step in range(3):
        if step == 1:
            fake.xid(79)
        model(torch.ones(2, 3)).sum().backward()
        agent.end_step(1.0)
        values = agent.latest()
        seen.append(agent.rank_values["gpu_xid"][0])
    assert seen == [0.0, 79.0, 0.0]
    assert values["trainguard_gpu_xid_errors_total"] == 1.0 and values["trainguard_gpu_last_xid"] == 79.0
    agent.close()
