"""The memory gauges of a device: the CUDA allocator's statistics (kept on the host: no device sync),
or this process's resident set size on the CPU. ``trainer_agent.measure.stats`` re-exports them."""

from __future__ import annotations

import os
import resource
import sys

import torch

__all__ = ["host_memory", "memory"]


def host_memory() -> tuple[float, float]:
    """(current resident set size, peak resident set size) of this process in bytes."""
    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/statm", "rb") as f:
        rss = int(f.read().split()[1]) * page
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is in KiB on Linux and in bytes on macOS.
    peak_bytes = peak if sys.platform == "darwin" else peak * 1024
    return float(rss), float(max(peak_bytes, rss))


def memory(device: torch.device) -> dict[str, float]:
    """The memory gauges of ``device`` (host values only: no device sync)."""
    if device.type == "cuda":
        # Allocator statistics kept on the host: no device sync.
        allocated = float(torch.cuda.memory_allocated(device))
        reserved = float(torch.cuda.memory_reserved(device))
        peak = float(torch.cuda.max_memory_allocated(device))
    else:
        allocated, peak = host_memory()
        reserved = allocated
    return {
        "trainguard_memory_allocated_bytes": allocated,
        "trainguard_memory_reserved_bytes": reserved,
        "trainguard_memory_peak_bytes": peak,
    }
