"""Device-side statistics of a training step: pure functions of tensors, no host reads.

Everything here returns tensors on the device of its inputs and never calls ``.item()``,
``.tolist()`` or ``float()`` on a device tensor, so the caller decides where the one host read
of a report interval happens. NaN and Inf propagate as values; nothing raises on them.

Norms are computed per tensor in float32 with ``torch._foreach_norm`` (one fused pass per device
and dtype) and combined in float64, so a global norm over millions of elements keeps about seven
significant digits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from trainer_agent.compat import torch_private
from trainer_agent.compat.foreach_results import results_vector
from trainer_agent.measure import staged
from trainer_agent.measure.chunk_plan import norm_dtype
from trainer_agent.measure.chunked_moments import BITS, chunked_moments
from trainer_agent.measure.memory import host_memory, memory  # noqa: F401 - stats.memory: the report's gauges
from trainer_agent.measure.noise_scale import noise_scale
from trainer_agent.measure.nonfinite_scan import dot_sq_norms, nonfinite_elements
from trainer_agent.measure.update_norms import update_sq_norms  # noqa: F401 - stats.update_sq_norms: the step meter's

__all__ = [
    "buckets",
    "bucket_norms",
    "update_sq_norms",
    "sq_norms",
    "sparse_sq_norm",
    "grads_norm",
    "nonfinite_count",
    "bucket_nonfinite",
    "MOMENTS",
    "tensor_moments",
    "sums_and_extremes",
    "noise_scale",
    "host_memory",
]


def buckets(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` grouped by (device, dtype), groups in order of first appearance.

    ``torch._foreach_*`` ops take their fused path (one launch per chunk of tensors) only when
    every tensor of the list shares device and dtype; a mixed list falls back to one kernel per
    tensor. The agent orders its parameters bucket after bucket once, at attach time, so every
    per-step reduction is one fused call per bucket and the results line up without a scatter.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return list(groups.values())


def bucket_norms(tensor_buckets: Sequence[Sequence[torch.Tensor]], device: torch.device, *,
                 wide: bool = False, staged_ok: bool = False) -> torch.Tensor:
    """L2 norm of every tensor, in float32 (float64 if any bucket is float64, or with ``wide``:
    accumulated in float64, where no float32/16 input can overflow the sum of squares), as one
    vector on ``device`` (bucket after bucket): one ``torch._foreach_norm`` per (device, dtype)
    bucket, joined by ``results_vector`` (no ``torch.stack`` where the norms lie in one buffer,
    as CUDA's do). With ``staged_ok`` (a report step, which copies the gradients for its other
    statistics anyway) a bucket of many plain tensors (``staged.plan_for``) is measured by the
    staged pass instead: float64 sums of squares, a fixed number of launches per stage of
    elements, each norm rounded to the dtype the fused norm has."""
    plans = [staged.plan_for(bucket, device) if staged_ok else None for bucket in tensor_buckets]
    if all(plan is None for plan in plans):
        parts = [torch_private.foreach_norm(bucket, 2, dtype=torch.float64 if wide else norm_dtype(bucket[0].dtype))
                 for bucket in tensor_buckets]
        return results_vector(parts, device)
    vectors = []
    for bucket, plan in zip(tensor_buckets, plans):
        dtype = torch.float64 if wide else norm_dtype(bucket[0].dtype)
        sq = None if plan is None else staged.attempt(staged.staged_sq_norms, bucket, plan)
        if sq is None:
            vectors.append(results_vector([torch_private.foreach_norm(bucket, 2, dtype=dtype)], device))
        else:
            vectors.append(sq.sqrt_().to(device, dtype))
    return vectors[0] if len(vectors) == 1 else torch.cat(vectors)


def sq_norms(tensors: Sequence[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """Squared L2 norm of each tensor, as a float64 vector on ``device``: ``||t_i||^2``; 0 for a
    ``None`` entry (a parameter without a gradient)."""
    present = [t for t in tensors if t is not None]
    if not tensors:
        return torch.zeros(0, dtype=torch.float64, device=device)
    if all(t.dtype != torch.float64 for t in present):
        norms = torch_private.foreach_norm(present, 2, dtype=torch.float32) if present else []
    else:
        norms = [torch.linalg.vector_norm(t, dtype=norm_dtype(t.dtype)) for t in present]
    if len(present) == len(tensors) and all(t.device == device for t in present):
        stacked = results_vector([norms]).to(torch.float64)  # the common case, without a Python call per tensor
    else:
        # A parameter without a gradient (0), or parameters spread over several devices
        # (asynchronous device-to-device copies).
        zero = torch.zeros((), dtype=torch.float32, device=device)
        left = iter(norms)
        stacked = torch.stack([zero if t is None else next(left).to(device, non_blocking=True)
                               for t in tensors]).to(torch.float64)
    return stacked * stacked


def sparse_sq_norm(grads: Sequence[torch.Tensor | None], device: torch.device, *,
                   count: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Over sparse COO gradients (``None``: no gradient): the squared norm of all of them together
    and, with ``count``, their number of NaN/Inf elements (else None), float64 scalars on
    ``device``. Each is coalesced first (repeated indices summed, as the dense gradient holds
    them); the elements a sparse tensor does not store are zeros, finite and adding nothing."""
    sq = torch.zeros((), dtype=torch.float64, device=device)
    bad = torch.zeros((), dtype=torch.float64, device=device) if count else None
    for g in grads:
        if g is None:
            continue
        values = g.coalesce().values() if g.is_sparse else g
        sq = sq + torch.linalg.vector_norm(values, dtype=torch.float64).square().to(device)
        if bad is not None:
            bad = bad + (~torch.isfinite(values)).sum().to(device, torch.float64)
    return sq, bad


def grads_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all of ``grads`` together, dense and sparse COO (coalesced) alike
    (``torch.nn.utils.get_total_norm`` takes dense tensors only, whose result it is without a
    sparse one; with one, a float64 scalar on the first gradient's device)."""
    dense = [g for g in grads if not g.is_sparse]
    if len(dense) == len(grads):  # (DTensors stay DTensors: only dense tensors are sharded)
        return torch.nn.utils.get_total_norm(dense, norm_type=2.0)
    device = grads[0].device
    sq, _ = sparse_sq_norm([g for g in grads if g.is_sparse], device)
    if dense:
        sq = sq + torch.nn.utils.get_total_norm(dense, norm_type=2.0).to(device, torch.float64).square()
    return sq.sqrt()


#: Bytes of temporaries one bucket of the on-device non-finite count may allocate.
_SCAN_BUCKET_BYTES = 64 << 20


def _suspects_nonfinite(tensors: Sequence[torch.Tensor | None], device: torch.device,
                        sq: torch.Tensor | None) -> torch.Tensor:
    """``nonfinite_count``'s CPU scan: only the tensors whose norm (or sum of squares) is not
    finite, a CPU one chunk by chunk; without ``sq`` large tensors are read by a dot each
    (``nonfinite_scan.py``)."""
    if sq is None:
        dotted, dot_sq, rest = dot_sq_norms([t for t in tensors if t is not None and t.is_floating_point()])
        tensors, sq = dotted + rest, sq_norms(rest, device)
        sq = sq if dot_sq is None else torch.cat([dot_sq.to(device), sq])
    # sq lives on the CPU here: .tolist() reads host memory, no operator, no device involved.
    flagged = [t for t, v in zip(tensors, sq.tolist()) if not math.isfinite(v)]
    total = torch.zeros((), dtype=torch.float64, device=device)
    for t in flagged:
        if t is not None and t.is_floating_point():
            total += nonfinite_elements(t) if t.is_cpu else (~torch.isfinite(t)).sum().to(device, non_blocking=True)
    return total


def _device_nonfinite(groups: Sequence[Sequence[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """``nonfinite_count``'s device scan of ``groups`` (each of one device and dtype): two fused
    launches per bucket of at most ``_SCAN_BUCKET_BYTES``, one count per tensor (float32; float64
    for float64 tensors, which a norm may not narrow: joining them promotes the mixed list), one
    list per bucket; a group of many plain tensors (``staged.plan_for``) three launches per stage
    of elements and one float64 count (``staged.staged_nonfinite``)."""
    counts: list[list[torch.Tensor]] = []
    for members in groups:
        plan = staged.plan_for(members, members[0].device)
        count = None if plan is None else staged.attempt(staged.staged_nonfinite, members, plan)
        if count is not None:
            counts.append([count])
            continue
        dtype = norm_dtype(members[0].dtype)
        bucket: list[torch.Tensor] = []
        size = 0
        for t in [*members, None]:
            if t is not None:
                bucket.append(t)
                size += t.numel() * t.element_size()
            if bucket and (t is None or size >= _SCAN_BUCKET_BYTES):
                nan_where_bad = torch_private.foreach_mul(bucket, 0.0)
                counts.append(torch_private.foreach_norm(nan_where_bad, 0, dtype=dtype))
                bucket, size = [], 0
    return counts


def nonfinite_count(tensors: Sequence[torch.Tensor | None], device: torch.device,
                    sq: torch.Tensor | None = None, *, scan: str = "auto") -> torch.Tensor:
    """Number of NaN/Inf elements over the floating-point ``tensors`` (float64 scalar on
    ``device``; ``None`` entries count 0). ``sq``: their squared norms from ``sq_norms``, if
    already computed (CPU only).

    ``scan="suspects"`` (the default on the CPU, where reading a tensor is no device sync): a
    tensor holds a non-finite element exactly when its norm is non-finite (a norm can also
    overflow to inf; the count then finds 0 there), so only tensors with a non-finite norm are
    scanned and the common case costs one read of each tensor (``sq``, or a dot of each large
    one: ``nonfinite_scan.py``). ``scan="device"`` (the default on an
    accelerator, where choosing would need a host read): every tensor is scanned on the device
    with two fused launches per bucket of at most 64 MiB — ``t * 0`` is NaN exactly where ``t``
    is not finite, and its ord-0 norm counts those. Tensors on the CPU (e.g. AdamW's ``step``
    scalars) are counted on the host and added as a number: no copy to the device.
    """
    if _scan(scan, device) == "suspects":
        return _suspects_nonfinite(tensors, device, sq)
    present = [t for t in tensors if t is not None and t.is_floating_point()]
    return _count_groups([[present[i] for i in group] for group in buckets(present)], device)


def bucket_nonfinite(tensor_buckets: Sequence[Sequence[torch.Tensor]], device: torch.device,
                     sq: torch.Tensor | None = None, *, scan: str = "auto") -> torch.Tensor:
    """:func:`nonfinite_count` of the tensors of ``tensor_buckets``, each bucket of one device and
    dtype (``ParamIndex.grads()``): the device scan does no host work per tensor."""
    if _scan(scan, device) == "suspects":
        return _suspects_nonfinite([t for bucket in tensor_buckets for t in bucket], device, sq)
    return _count_groups([b for b in tensor_buckets if b and b[0].is_floating_point()], device)


def _scan(scan: str, device: torch.device) -> str:
    if scan == "auto":
        return "suspects" if device.type == "cpu" else "device"
    if scan not in ("suspects", "device"):
        raise ValueError(f"scan must be 'auto', 'suspects' or 'device', got {scan!r}")
    return scan


def _count_groups(groups: list[Sequence[torch.Tensor]], device: torch.device) -> torch.Tensor:
    """The device scan's count over ``groups`` (floating-point tensors, each group of one device
    and dtype): the groups on ``device`` scanned there; on another accelerator an asynchronous
    device-to-device copy of each tensor's count; on the CPU counted on the host (AdamW's step
    counters, offloaded state: a read there is no device sync) and added as a number."""
    on_device = [g for g in groups if g[0].device == device]
    on_host = [t for g in groups if g[0].device.type == "cpu" and g[0].device != device for t in g]
    others = [t for g in groups if g[0].device != device and g[0].device.type != "cpu" for t in g]
    elsewhere = [(~torch.isfinite(t)).sum().to(device, torch.float32, non_blocking=True) for t in others]
    counts = [part for part in (*_device_nonfinite(on_device), elsewhere) if part]
    if len(counts) == 1 and len(counts[0]) == 1 and counts[0][0].dtype == torch.float64:
        total = counts[0][0]  # one staged count (a float64 scalar): nothing to join
    elif counts:
        total = results_vector(counts).to(torch.float64).sum()
    else:
        total = torch.zeros((), dtype=torch.float64, device=device)
    if not on_host:
        return total
    host_count = float(nonfinite_count(on_host, torch.device("cpu"), scan="suspects"))
    return total + host_count if host_count else total


#: Bytes of tensors one fused pass of :func:`tensor_moments` reads at a time (its temporary,
#: ``|g|``, has that size); a larger tensor is a pass of its own.
_STATS_CHUNK_BYTES = 256 << 20

#: The blocks of :func:`tensor_moments`' result, in order: ||relu(t)||_1 and ||t||_1 (float64
#: accumulation), ||t||^2 (on the CPU a float64 sum of squares; on an accelerator a float32 norm,
#: float64 for float64 tensors, squared in float64), max |t| and -min |t|.
MOMENTS: tuple[str, ...] = ("pos_l1", "l1", "sq", "max_abs", "neg_min_abs")


def _moment_chunks(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` per fused pass of :func:`tensor_moments`: one (device, dtype) each,
    at most ``_STATS_CHUNK_BYTES`` (a larger tensor alone: temporaries of its size only)."""
    out: list[list[int]] = []
    for bucket in buckets(tensors):
        chunk: list[int] = []
        size = 0
        for i in bucket:
            nbytes = tensors[i].numel() * tensors[i].element_size()
            if chunk and (nbytes >= _STATS_CHUNK_BYTES or size + nbytes > _STATS_CHUNK_BYTES):
                out.append(chunk)
                chunk, size = [], 0
            chunk.append(i)
            size += nbytes
        if chunk:
            out.append(chunk)
    return out


def tensor_moments(tensors: Sequence[torch.Tensor], device: torch.device, *, chunked: bool | None = None,
                   cache: dict | None = None) -> tuple[torch.Tensor, list[int]]:
    """``(values, order)``: the :data:`MOMENTS` of every tensor (none may be empty) as *one* flat
    float64 vector on ``device``, ``len(MOMENTS)`` blocks of ``len(tensors)`` values, the tensors
    in ``order`` (indices into ``tensors``; the identity when they share device and dtype, or
    all lie on the CPU). NaN propagates into every block of its tensor.

    Eight fused ``torch._foreach_*`` passes per (device, dtype) chunk of at most
    ``_STATS_CHUNK_BYTES`` — ``A = |t|``, ``max(A)``; ``A = -A``, ``max(A) = -min|t|``;
    ``A = relu(t)`` (no doubling, so no overflow), ``||A||_1``; ``||t||_1``, ``||t||_2`` — and
    every 0-dim result joined at once (``results_vector``: one ``torch.stack`` of the per-block
    lists concatenated on the host, one operator whatever the tensor and block count; on CUDA the
    norms' own buffers, the maxima stacked, one ``cat``; either promotes the float32 results to
    float64 exactly). The sum of a tensor's elements is ``2 ||relu(t)||_1 - ||t||_1``. A bucket
    of many plain tensors (``staged.plan_for``) is measured by the staged passes instead
    (``trainer_agent/measure/staged.py``: one copy of the bucket, segmented reductions, a fixed
    number of launches per stage of elements whatever the tensor count), its tensors after the
    others in ``order``.

    On the CPU (``chunked``, default: when ``device`` is the CPU) every CPU tensor of a float
    dtype is measured chunk by chunk instead (``trainer_agent/measure/chunked_moments.py``: one
    read, float64 sums, a fixed number of operators per chunk of elements rather than per
    tensor), before the fused passes over the others; ``cache``: a dict the caller keeps for its
    buffers."""
    packed: list[int] = []
    rest = list(range(len(tensors)))
    if device.type == "cpu" if chunked is None else chunked:
        chunkable = [t.is_cpu and t.dtype in BITS for t in tensors]
        packed = [i for i, ok in enumerate(chunkable) if ok]
        rest = [i for i, ok in enumerate(chunkable) if not ok]
    parts: list[torch.Tensor] = []
    if packed:
        done = chunked_moments(tensors if not rest else [tensors[i] for i in packed], cache)
        parts.append(done if device.type == "cpu" else done.to(device, non_blocking=True))
    order = list(packed)
    if rest:
        values, measured = _accelerator_moments(tensors, rest, device)
        order += measured
        if not parts:
            return values.reshape(-1), order
        parts.append(values)
    if not order:
        return torch.zeros(0, dtype=torch.float64, device=device), order
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)).reshape(-1), order


def _accelerator_moments(tensors: Sequence[torch.Tensor], rest: list[int], device: torch.device
                         ) -> tuple[torch.Tensor, list[int]]:
    """``tensor_moments`` of ``tensors[rest]`` off the CPU's chunked pass: ``(values, order)``,
    values (len(MOMENTS), len(rest)) on ``device``, a column per tensor in ``order``. A bucket
    the staged passes take (``staged.plan_for``: many plain tensors) costs a fixed number of
    launches per stage of elements; the others fused passes per chunk of at most
    ``_STATS_CHUNK_BYTES``."""
    staged_parts: list[torch.Tensor] = []
    staged_order: list[int] = []
    fused_rest: list[int] = []
    for bucket in buckets([tensors[i] for i in rest]):
        members = [tensors[rest[i]] for i in bucket]
        plan = staged.plan_for(members, device)
        values = None if plan is None else staged.attempt(staged.staged_moments, members, plan)
        if values is None:
            fused_rest += [rest[i] for i in bucket]
        else:
            staged_parts.append(values)
            staged_order += [rest[i] for i in bucket]
    order: list[int] = []
    if fused_rest:
        blocks: list[list[list[torch.Tensor]]] = [[] for _ in MOMENTS]
        for chunk in _moment_chunks([tensors[i] for i in fused_rest]):
            for block, values in zip(blocks, _fused_moments([tensors[fused_rest[i]] for i in chunk])):
                block.append(values)
            order += [fused_rest[i] for i in chunk]
        # float64 (blocks 0 and 1 are: joining promotes the others), never one call's own buffer
        fused = results_vector([part for block in blocks for part in block], device)
        n = len(fused_rest)
        fused[2 * n:3 * n].square_()  # the norms, squared in float64
        staged_parts.insert(0, fused.view(len(MOMENTS), n))
    return (staged_parts[0] if len(staged_parts) == 1 else torch.cat(staged_parts, dim=1)), order + staged_order


def _fused_moments(ts: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The :data:`MOMENTS` of tensors of one device and dtype, one list per moment: eight fused
    passes (see :func:`tensor_moments`)."""
    a = torch_private.foreach_abs(ts)
    top = torch_private.foreach_max(a)
    torch_private.foreach_neg_(a)
    neg_low = torch_private.foreach_max(a)
    torch_private.foreach_copy_(a, ts)
    torch_private.foreach_clamp_min_(a, 0.0)  # relu(t), in the same temporary
    pos = torch_private.foreach_norm(a, 1, dtype=torch.float64)
    del a
    return [pos, torch_private.foreach_norm(ts, 1, dtype=torch.float64),
            torch_private.foreach_norm(ts, 2, dtype=norm_dtype(ts[0].dtype)), top, neg_low]


def sums_and_extremes(tensors: Sequence[torch.Tensor], device: torch.device
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per tensor: the sum of its elements, and the largest and smallest absolute value, as three
    float64 vectors on ``device`` in the order of ``tensors`` (an empty tensor: sum 0, max -inf,
    min inf; NaN propagates into all three), from :func:`tensor_moments`."""
    n = len(tensors)
    todo = [i for i, t in enumerate(tensors) if t.numel()]
    values, order = tensor_moments([tensors[i] for i in todo], device)
    m = len(order)
    pos, l1, _, top, neg_low = values.view(len(MOMENTS), m).unbind(0) if m else (values,) * 5
    out = torch.empty(3, n, dtype=torch.float64, device=device)
    out[0].fill_(0.0)
    out[1].fill_(-math.inf)
    out[2].fill_(math.inf)
    if m:
        at = torch.tensor([todo[i] for i in order], dtype=torch.long, device=device)
        out[:, at] = torch.stack([2 * pos - l1, top, -neg_low])
    return out[0], out[1], out[2]
