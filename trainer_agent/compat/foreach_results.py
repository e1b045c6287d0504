"""The 0-dim results of fused ``torch._foreach_*`` reductions as one vector, without a
``torch.stack`` where the results already lie in one.

On CUDA, ``torch._foreach_norm`` writes the norms of its tensors into one contiguous buffer and
returns a 0-dim view of it per tensor (``ret_per_tensor[i]`` in ATen's ``ForeachReduceOp.cu``).
Stacking those views copies them back into a vector: on a GPU a batched ``cat`` (a launch per ~128
inputs) and host work per input, at 5,000 tensors more than the norm's own launches. Taken as the
buffer they are views, no operator but ``as_strided`` (a view: no kernel). On the CPU, and where a
reduction returns separate tensors (``torch._foreach_max``; a norm's empty tensors, which get zeros
of their own), they are stacked as before: the same operator, the same values.

The check is O(1) whatever the tensor count: the first, middle and last results must be views of
one storage of exactly as many elements, at its first, middle and last place. No implementation
returns one storage's elements out of order, and a storage of exactly ``n`` elements holding ``n``
results at the first, middle and last place holds no other values.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["one_buffer", "results_vector"]


def one_buffer(results: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``results`` (0-dim tensors, one fused call's) as the vector they are views of, or ``None``
    where they do not lie in one buffer of their own, in order."""
    n = len(results)
    if n < 2:
        return None
    first, mid, last = results[0], results[n // 2], results[-1]
    if first.dim() or mid.dim() or last.dim() or not (first.dtype == mid.dtype == last.dtype):
        return None
    storage = first.untyped_storage()
    ptr, size = storage.data_ptr(), first.element_size()
    if (storage.nbytes() != n * size or mid.untyped_storage().data_ptr() != ptr
            or last.untyped_storage().data_ptr() != ptr):
        return None
    if (first.storage_offset(), mid.storage_offset(), last.storage_offset()) != (0, n // 2, n - 1):
        return None
    return first.as_strided((n,), (1,), 0)


def results_vector(parts: Sequence[Sequence[torch.Tensor] | torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """The results of several fused calls (``parts``, one list per call, or a 1-D tensor of
    results already joined; none empty in all), in order, as one vector on ``device`` (default: where they are), in the dtype ``torch.stack``
    would give them. A part lying in one buffer (:func:`one_buffer`) is taken as that buffer (one
    copy to ``device`` where it lies elsewhere); the others are stacked, consecutive ones in one
    ``torch.stack``; several pieces are joined by one ``torch.cat``. All parts stacked (the CPU):
    one ``torch.stack`` of every result, as before."""
    pieces: list[torch.Tensor] = []
    loose: list[torch.Tensor] = []
    for part in parts:
        vector = part if isinstance(part, torch.Tensor) else one_buffer(part)
        if vector is None:
            loose += part if device is None else [v if v.device == device else v.to(device, non_blocking=True)
                                                  for v in part]
            continue
        if loose:
            pieces.append(torch.stack(loose))
            loose = []
        pieces.append(vector if device is None or vector.device == device else vector.to(device, non_blocking=True))
    if loose:
        pieces.append(torch.stack(loose))
    if not pieces:
        raise ValueError("results_vector needs at least one result")
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
