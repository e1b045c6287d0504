"""GPU health via NVML (``nvidia-ml-py``, optional: ``pip install trainguard[gpu]``): utilisation,
memory, temperature, SM clock, throttle reasons and uncorrected ECC errors of this rank's GPU,
read at scrape time on the /metrics thread (NVML queries the driver, never the CUDA stream: no
device sync). Absent on the CPU or without NVML. A query the GPU does not support (e.g. ECC on a
consumer card) leaves its metric out.

Metric keys (``trainguard/protocol/catalog.py``): ``trainguard_gpu_utilization_ratio``,
``trainguard_gpu_memory_used_bytes``, ``trainguard_gpu_memory_total_bytes``,
``trainguard_gpu_temperature_celsius``, ``trainguard_gpu_sm_clock_hertz``,
``trainguard_gpu_throttle_reasons``, ``trainguard_gpu_ecc_uncorrected_errors_total``,
``trainguard_gpu_xid_errors_total``, ``trainguard_gpu_last_xid``.

**XID errors.** At open, an NVML event set is registered for this GPU's critical XID errors
(``nvmlEventTypeXidCriticalError``). :meth:`GpuHealth.poll_xid` drains it without blocking
(``nvmlEventSetWait`` with a timeout of 0 ms until NVML answers "timeout": no event left); it runs
at every scrape and at every report step (``Agent``), under a lock, so each event is counted once.
The codes go to ``trainguard_gpu_xid_errors_total`` / ``trainguard_gpu_last_xid`` and, through
:meth:`GpuHealth.take_xid`, into the report's per-rank ``gpu_xid`` vector, which the controller's
``gpu_xid`` rule reads (naming the rank and explaining the code: :data:`XID_MEANINGS`). A driver
that cannot register events (e.g. no permission in a container) leaves XIDs out.
"""

from __future__ import annotations

import importlib
import math
import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["GpuHealth", "XID_MEANINGS", "MAX_EVENTS_PER_POLL"]

#: The XID codes worth a sentence (NVIDIA's XID catalogue, shortened).
XID_MEANINGS: dict[int, str] = {
    13: "graphics engine exception: usually a fault of the application's kernels (out-of-range access)",
    31: "GPU memory page fault: usually an illegal address in the application's kernels",
    43: "the GPU stopped processing: a fault in the application's kernels",
    48: "double-bit ECC error: GPU memory returned corrupted data",
    63: "ECC page retirement or row remapping recorded: a failing memory row was replaced",
    64: "ECC page retirement or row remapping failed: the memory is degrading",
    74: "NVLink error: a link between GPUs failed",
    79: "the GPU has fallen off the bus: it no longer answers the host",
    92: "high single-bit ECC error rate",
    94: "contained ECC error: the corrupted memory was confined to one application",
    95: "uncontained ECC error: corrupted memory may have reached other applications",
}
#: Events read per poll at most (bounded work on the scrape thread and in end_step).
MAX_EVENTS_PER_POLL = 64


def _handle(nvml: Any, index: int) -> Any:
    """NVML's handle of CUDA device ``index``, found by the device's UUID: NVML numbers every GPU
    of the machine in PCI order, CUDA only those ``CUDA_VISIBLE_DEVICES`` shows, in its own order
    (a rank that sees only its GPU 5 sees it as CUDA device 0). By NVML's index where the UUID is
    not to be had (no CUDA, a torch without it, a driver that refuses it)."""
    try:
        uuid = f"GPU-{torch.cuda.get_device_properties(index).uuid}"
        return nvml.nvmlDeviceGetHandleByUUID(uuid.encode())
    except Exception:  # noqa: BLE001 - no CUDA device (CPU tests with a fake NVML), MIG, an old driver
        return nvml.nvmlDeviceGetHandleByIndex(index)


class GpuHealth:
    """NVML readings of GPU ``index`` (the CUDA ordinal). ``nvml``: the ``pynvml`` module (injected
    in tests). ``GpuHealth.open`` returns None where NVML is missing or fails to start."""

    def __init__(self, index: int, nvml: Any) -> None:
        self.nvml = nvml
        nvml.nvmlInit()
        self.handle = _handle(nvml, index)
        self._xid_lock = threading.Lock()
        self.xid_total = 0
        self.poll_errors = 0
        self.last_xid: int | None = None
        self._xid_pending: int | None = None  # last code since the last take_xid()
        self._events: Any = None
        try:
            events = nvml.nvmlEventSetCreate()
            nvml.nvmlDeviceRegisterEvents(self.handle, nvml.nvmlEventTypeXidCriticalError, events)
            self._events = events
        except Exception:  # noqa: BLE001 - no event support (old driver, no permission): no XIDs
            self._events = None

    @classmethod
    def open(cls, index: int, nvml: Any = None) -> GpuHealth | None:
        try:
            return cls(index, nvml if nvml is not None else importlib.import_module("pynvml"))
        except Exception:  # noqa: BLE001 - no NVML (CPU machine, no driver, not installed): no GPU metrics
            return None

    @property
    def watches_xid(self) -> bool:
        return self._events is not None

    def poll_xid(self) -> None:
        """Count the critical XID events NVML queued for this GPU; never blocks (timeout 0)."""
        if self._events is None:
            return
        n = self.nvml
        with self._xid_lock:
            for _ in range(MAX_EVENTS_PER_POLL):
                try:
                    data = n.nvmlEventSetWait(self._events, 0)
                except Exception as exc:  # noqa: BLE001 - NVML_ERROR_TIMEOUT: nothing queued
                    if getattr(exc, "value", None) != getattr(n, "NVML_ERROR_TIMEOUT", 10):
                        self.poll_errors += 1  # e.g. the GPU is lost: its XID was counted already
                    return
                if data.eventType != n.nvmlEventTypeXidCriticalError:
                    continue
                code = int(data.eventData)
                self.xid_total += 1
                self.last_xid = self._xid_pending = code

    def take_xid(self) -> float:
        """The last XID code seen since the previous call after a poll: 0 when none, NaN when this
        GPU's XID events cannot be watched (so the controller's rule resolves on a quiet report)."""
        if self._events is None:
            return math.nan
        self.poll_xid()
        with self._xid_lock:
            code, self._xid_pending = self._xid_pending, None
        return 0.0 if code is None else float(code)

    def close(self) -> None:
        if self._events is not None:
            try:
                self.nvml.nvmlEventSetFree(self._events)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
            self._events = None

    def read(self) -> dict[str, float]:
        """The metrics this GPU supports (host floats)."""
        n, h = self.nvml, self.handle
        out: dict[str, float] = {}
        if self._events is not None:
            self.poll_xid()
            out["trainguard_gpu_xid_errors_total"] = float(self.xid_total)
            if self.last_xid is not None:
                out["trainguard_gpu_last_xid"] = float(self.last_xid)

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
