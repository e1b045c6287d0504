"""Device-side statistics of a training step: pure functions of tensors, no host reads.

Everything here returns tensors on the device of its inputs and never calls ``.item()``,
``.tolist()`` or ``float()`` on a device tensor, so the caller decides where the one host read
of a report interval happens. NaN and Inf propagate as values; nothing raises on them.

Norms are computed per tensor in float32 with ``torch._foreach_norm`` (one fused pass per device
and dtype) and combined in float64, so a global norm over millions of elements keeps about seven
significant digits.
"""

from __future__ import annotations

import os
import resource
import sys
from collections.abc import Sequence

import torch

__all__ = [
    "sq_norms",
    "nonfinite_count",
    "segment_sum",
    "noise_scale",
    "host_memory",
]


def sq_norms(tensors: Sequence[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """Squared L2 norm of each tensor, as a float64 vector on ``device``: ``||t_i||^2``; 0 for a
    ``None`` entry (a parameter without a gradient)."""
    present = [t for t in tensors if t is not None]
    norms = iter(torch._foreach_norm(present, 2, dtype=torch.float32) if present else ())
    zero = torch.zeros((), dtype=torch.float32, device=device) if len(present) < len(tensors) else None
    if zero is None and all(t.device == device for t in present):
        column = list(norms)  # the common case, without a Python call per tensor
    else:
        # For parameters spread over several devices: asynchronous device-to-device copies.
        column = [zero if t is None else next(norms).to(device, non_blocking=True) for t in tensors]
    if not column:
        return torch.zeros(0, dtype=torch.float64, device=device)
    stacked = torch.stack(column).to(torch.float64)
    return stacked * stacked


#: Bytes of temporaries one bucket of the on-device non-finite count may allocate.
_SCAN_BUCKET_BYTES = 64 << 20


def nonfinite_count(tensors: Sequence[torch.Tensor | None], device: torch.device,
                    sq: torch.Tensor | None = None, *, scan: str = "auto") -> torch.Tensor:
    """Number of NaN/Inf elements over the floating-point ``tensors`` (float64 scalar on
    ``device``; ``None`` entries count 0). ``sq``: their squared norms from ``sq_norms``, if
    already computed (CPU only).

    ``scan="suspects"`` (the default on the CPU, where reading a tensor is no device sync): a
    tensor holds a non-finite element exactly when its norm is non-finite (a norm can also
    overflow to inf; the count then finds 0 there), so only tensors with a non-finite norm are
    scanned and the common case costs one fused norm pass. ``scan="device"`` (the default on an
    accelerator, where choosing would need a host read): every tensor is scanned on the device
    with two fused launches per bucket of at most 64 MiB — ``t * 0`` is NaN exactly where ``t``
    is not finite, and its ord-0 norm counts those. Tensors on the CPU (e.g. AdamW's ``step``
    scalars) are counted on the host and added as a number: no copy to the device.
    """
    if scan == "auto":
        scan = "suspects" if device.type == "cpu" else "device"
    if scan not in ("suspects", "device"):
        raise ValueError(f"scan must be 'auto', 'suspects' or 'device', got {scan!r}")
    if scan == "suspects":
        if sq is None:
            tensors = [t for t in tensors if t is not None and t.is_floating_point()]
            sq = sq_norms(tensors, device)
        # sq lives on the CPU here: .tolist() reads host memory, no device involved.
        flagged = [t for t, ok in zip(tensors, torch.isfinite(sq).tolist()) if not ok]
        total = torch.zeros((), dtype=torch.float64, device=device)
        for t in flagged:
            if t is not None and t.is_floating_point():
                total += (~torch.isfinite(t)).sum().to(device, non_blocking=True)
        return total
    on_device = [t for t in tensors if t is not None and t.is_floating_point() and t.device == device]
    on_host = [t for t in tensors if t is not None and t.is_floating_point() and t.device.type == "cpu"
               and t.device != device]
    others = [t for t in tensors if t is not None and t.is_floating_point()
              and t.device != device and t.device.type != "cpu"]
    counts = [torch.zeros((), dtype=torch.float32, device=device)]
    bucket: list[torch.Tensor] = []
    size = 0
    for t in [*on_device, None]:
        if t is not None:
            bucket.append(t)
            size += t.numel() * t.element_size()
        if bucket and (t is None or size >= _SCAN_BUCKET_BYTES):
            nan_where_bad = torch._foreach_mul(bucket, 0.0)
            counts.extend(torch._foreach_norm(nan_where_bad, 0, dtype=torch.float32))
            bucket, size = [], 0
    for t in others:  # parameters on another accelerator: an asynchronous device-to-device copy
        counts.append((~torch.isfinite(t)).sum().to(device, torch.float32, non_blocking=True))
    total = torch.stack(counts).to(torch.float64).sum()
    if not on_host:
        return total
    # CPU tensors (e.g. AdamW's step counters, offloaded state): counted on the host, where a
    # read is no device sync, and added as a number.
    host_count = float(nonfinite_count(on_host, torch.device("cpu"), scan="suspects"))
    return total + host_count if host_count else total


def segment_sum(values: torch.Tensor, index: torch.Tensor, segments: int) -> torch.Tensor:
    """``out[s] = sum(values[i] for i with index[i] == s)``: per-layer sums of per-tensor values."""
    out = torch.zeros(segments, dtype=values.dtype, device=values.device)
    return out.index_add_(0, index, values)


def noise_scale(
    small_sq: torch.Tensor, big_sq: torch.Tensor, count: int, micro_size: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Simple gradient noise scale from ``count`` >= 2 small-batch gradients (McCandlish et al.
    2018, appendix A.1): returns ``(B_simple, tr(Sigma))`` as scalars on the input's device.

    ``small_sq`` is |G_small|^2, the mean squared norm of the ``count`` small-batch gradient
    estimates, each of ``b = micro_size`` samples; ``big_sq`` is |G_big|^2, the squared norm of
    their mean (the gradient of the big batch of ``count * b`` samples). Unbiased estimates:

        |G|^2     = (n |G_big|^2 - |G_small|^2) / (n - 1)
        tr(Sigma) = b n (|G_small|^2 - |G_big|^2) / (n - 1)
        B_simple  = tr(Sigma) / |G|^2                       (n = count)

    B_simple is in the unit of ``b`` and does not change when both inputs are multiplied by the
    same factor (a loss scale, a loss divided by the accumulation count). Estimates from a single
    step are noisy: tr(Sigma) and B_simple can come out negative; they are reported as they are.
    """
    assert count >= 2, "the noise scale needs at least two small-batch gradients"
    grad_sq = (count * big_sq - small_sq) / (count - 1)
    trace = micro_size * count * (small_sq - big_sq) / (count - 1)
    return trace / grad_sq, trace


def host_memory() -> tuple[float, float]:
    """(current resident set size, peak resident set size) of this process in bytes."""
    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/statm", "rb") as f:
        rss = int(f.read().split()[1]) * page
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is in KiB on Linux and in bytes on macOS.
    peak_bytes = peak if sys.platform == "darwin" else peak * 1024
    return float(rss), float(max(peak_bytes, rss))
