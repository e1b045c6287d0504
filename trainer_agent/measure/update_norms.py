"""The update's squared norms per parameter, ``||W_before - W_after||^2``, ``||W_after||^2`` and
``||W_before||^2``, from the agent's snapshot of ``W_before`` (``update_snapshot.py``); read as
``stats.update_sq_norms``. Three passes, by where the parameters are: chunk by chunk in cache on
the CPU (``chunked_updates.py``); on an accelerator fused norms per bucket, or for a bucket of many
plain tensors the staged passes (``staged.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trainer_agent.compat import torch_private
from trainer_agent.compat.foreach_results import results_vector
from trainer_agent.measure import staged
from trainer_agent.measure.chunk_plan import norm_dtype
from trainer_agent.measure.chunked_updates import chunked_update_sq_norms

__all__ = ["update_sq_norms"]


def update_sq_norms(before: Sequence[Sequence[torch.Tensor]], after: Sequence[Sequence[torch.Tensor]],
                    device: torch.device, cache: dict | None = None, *, before_norms: bool = False,
                    refresh: bool = False, chunked: bool | None = None,
                    flat_before: Sequence[torch.Tensor | None] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, bool]:
    """Squared norms for the update ratio, per tensor pair, as float64 vectors on ``device``
    (bucket after bucket): ``(||before_i - after_i||^2, ||after_i||^2, ||before_i||^2 or None,
    refreshed)``. ``before`` is the agent's snapshot: it may be overwritten. ``cache``: a dict the
    caller keeps between calls (the reusable buffer and the chunk index).

    On an accelerator (bandwidth to spare, launches costly): per bucket ``before -= after`` in
    place and fused norms, a handful of launches per bucket; for a bucket of many plain tensors
    the staged passes (``trainer_agent/measure/staged.py``; ``flat_before``: per bucket the
    snapshot as one flat buffer in their layout, or None); ``refreshed`` is False. On the CPU
    (bandwidth-bound, a cost per tensor in every ``_foreach`` loop): chunk by chunk through
    buffers that stay in cache (``trainer_agent/measure/chunked_updates.py``); with ``refresh``
    it also copies ``after`` into ``before`` from the cache (``refreshed`` True), so a measured
    step that follows needs no snapshot copy. ``chunked`` chooses the pass (default: chunked on
    the CPU).
    """
    cache = {} if cache is None else cache
    if not (device.type == "cpu" if chunked is None else chunked):
        delta, param, *rest = _accelerator_update(before, after, device, before_norms, flat_before)
        return delta, param, rest[0] if before_norms else None, False
    flat_b = [t for bucket in before for t in bucket]
    delta, param, *rest = chunked_update_sq_norms(flat_b, [t for bucket in after for t in bucket], cache,
                                                  before_norms=before_norms, refresh=refresh)
    if flat_b and flat_b[0].device != device:
        delta, param, *rest = (v.to(device, non_blocking=True) for v in (delta, param, *rest))
    return delta, param, rest[0] if before_norms else None, refresh


def _accelerator_update(before: Sequence[Sequence[torch.Tensor]], after: Sequence[Sequence[torch.Tensor]],
                        device: torch.device, before_norms: bool,
                        flat_before: Sequence[torch.Tensor | None] | None) -> list[torch.Tensor]:
    """``update_sq_norms`` off the CPU's chunked pass, its float64 columns (bucket after bucket):
    per bucket ``before -= after`` in place and fused norms, or for a bucket of many plain
    tensors the staged passes (``staged.staged_update_sq_norms``; ``flat_before[k]``: bucket
    ``k``'s snapshot as one flat buffer, or None)."""
    k = 3 if before_norms else 2
    columns: list[list[list[torch.Tensor]]] = [[] for _ in range(k)]
    kinds: list[int | list[torch.Tensor]] = []  # per bucket: its fused tensor count, or its staged columns
    for b, (bucket_b, bucket_a) in enumerate(zip(before, after)):
        plan = staged.plan_for(bucket_a, device)
        if plan is not None:
            flat = None if flat_before is None else flat_before[b]
            done = staged.attempt(staged.staged_update_sq_norms, bucket_b, bucket_a, plan,
                                  before_norms=before_norms, flat_before=flat)
            if done is None:  # the snapshot may be half-compared: this report's update is lost
                raise RuntimeError(f"the staged update norms failed ({staged.FAILED}); the fused passes from the next report on")
            kinds.append(done)
            continue
        dtype = norm_dtype(bucket_a[0].dtype)
        if before_norms:
            columns[2].append(torch_private.foreach_norm(bucket_b, 2, dtype=dtype))
        torch_private.foreach_sub_(bucket_b, bucket_a)  # W_before - W_after, in place in the snapshot
        columns[0].append(torch_private.foreach_norm(bucket_b, 2, dtype=dtype))
        columns[1].append(torch_private.foreach_norm(bucket_a, 2, dtype=dtype))
        kinds.append(len(bucket_a))
    fused = _squared_columns(columns, device) if columns[0] else []
    if all(isinstance(kind, int) for kind in kinds):
        return fused
    joined: list[list[torch.Tensor]] = [[] for _ in range(k)]
    at = 0
    for kind in kinds:
        for c in range(k):
            joined[c].append(fused[c][at:at + kind] if isinstance(kind, int) else kind[c].to(device))
        at += kind if isinstance(kind, int) else 0
    return [torch.cat(c) if len(c) > 1 else c[0] for c in joined]


def _squared_columns(columns: list[list[list[torch.Tensor]]], device: torch.device) -> list[torch.Tensor]:
    """The squares of the float norms in ``columns`` (each a list of fused calls' results, the
    columns of one length), as one float64 vector per column on ``device``: every column joined
    at once (``results_vector``: one ``stack``, or the buffers CUDA's norms lie in), one cast, one
    in-place square, one ``unbind``."""
    k = len(columns)
    flat = results_vector([part for column in columns for part in column], device).to(torch.float64)
    flat.square_()
    return list(flat.view(k, -1).unbind(0))
