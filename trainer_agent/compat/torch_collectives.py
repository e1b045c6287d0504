"""Collectives whose public name differs between the torch releases the agent supports (2.6 on):
``torch.distributed.all_gather_single`` is torch 2.13's name for ``all_gather_into_tensor``, which
older releases have alone and 2.13 deprecates (a warning on every call)."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_gather_single"]


def all_gather_single(out: torch.Tensor, src: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Every rank's ``src`` into ``out``, rank after rank: ``all_gather_single`` where this torch has
    it, else ``all_gather_into_tensor`` (torch 2.12 and older)."""
    gather = getattr(dist, "all_gather_single", None)
    if gather is None:
        gather = dist.all_gather_into_tensor
    gather(out, src, group=group)
