"""GPU health via NVML (``nvidia-ml-py``, optional: ``pip install trainguard[gpu]``): utilisation,
memory, temperature, SM clock, throttle reasons and uncorrected ECC errors of this rank's GPU,
read at scrape time on the /metrics thread (NVML queries the driver, never the CUDA stream: no
device sync). Absent on the CPU or without NVML. A query the GPU does not support (e.g. ECC on a
consumer card) leaves its metric out.

Metric keys (``trainguard/protocol/catalog.py``): ``trainguard_gpu_utilization_ratio``,
``trainguard_gpu_memory_used_bytes``, ``trainguard_gpu_memory_total_bytes``,
``trainguard_gpu_temperature_celsius``, ``trainguard_gpu_sm_clock_hertz``,
``trainguard_gpu_throttle_reasons``, ``trainguard_gpu_ecc_uncorrected_errors_total``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["GpuHealth"]


class GpuHealth:
    """NVML readings of GPU ``index`` (the CUDA ordinal). ``nvml``: the ``pynvml`` module (injected
    in tests). ``GpuHealth.open`` returns None where NVML is missing or fails to start."""

    def __init__(self, index: int, nvml: Any) -> None:
        self.nvml = nvml
        nvml.nvmlInit()
        self.handle = nvml.nvmlDeviceGetHandleByIndex(index)

    @classmethod
    def open(cls, index: int, nvml: Any = None) -> GpuHealth | None:
        try:
            return cls(index, nvml if nvml is not None else importlib.import_module("pynvml"))
        except Exception:  # noqa: BLE001 - no NVML (CPU machine, no driver, not installed): no GPU metrics
            return None

    def read(self) -> dict[str, float]:
        """The metrics this GPU supports (host floats)."""
        n, h = self.nvml, self.handle
        out: dict[str, float] = {}

        def put(key: str, query: Callable[[], float]) -> None:
            try:
                out[key] = float(query())
            except Exception:  # noqa: BLE001 - NVMLError_NotSupported and the like: leave it out
                pass

        put("trainguard_gpu_utilization_ratio", lambda: n.nvmlDeviceGetUtilizationRates(h).gpu / 100.0)
        mem = None
        try:
            mem = n.nvmlDeviceGetMemoryInfo(h)
        except Exception:  # noqa: BLE001
            pass
        if mem is not None:
            out["trainguard_gpu_memory_used_bytes"] = float(mem.used)
            out["trainguard_gpu_memory_total_bytes"] = float(mem.total)
        put("trainguard_gpu_temperature_celsius", lambda: n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU))
        put("trainguard_gpu_sm_clock_hertz", lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM) * 1e6)
        put("trainguard_gpu_throttle_reasons", lambda: n.nvmlDeviceGetCurrentClocksThrottleReasons(h))
        put("trainguard_gpu_ecc_uncorrected_errors_total",
            lambda: n.nvmlDeviceGetTotalEccErrors(h, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC))
        return out
