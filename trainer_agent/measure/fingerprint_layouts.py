"""Parameters whose values differ across ranks by design, left out of the cross-rank fingerprint
comparison (``trainer_agent/measure/fingerprint.py``), so that a healthy job is not reported
desynchronised (and a controller does not take it for a faulty device):

- FSDP1 (``FullyShardedDataParallel`` of any sharding strategy but ``NO_SHARD``): each rank holds
  its own shard of the wrapped modules' parameters (a ``FlatParameter`` with
  ``use_orig_params=False``, views of it otherwise). They are left out; with ``HYBRID_SHARD`` too
  (its replica groups are not compared). FSDP2 and HSDP as DTensors keep their replica comparison
  (``trainer_agent/measure/sharding.py``).
- post-local SGD (DDP's ``post_localSGD_hook``, with ``PostLocalSGDOptimizer``'s periodic
  averaging): after its warm-up each rank steps on its own gradients, and the parameters agree
  only right after an averaging step. Nothing is compared: the fingerprints are off for the whole
  model (before the warm-up ends too: what is compared must not change with the step).
- layers the user declares rank-local (``AgentConfig.rank_local_params``: parameter-name prefixes,
  e.g. expert-parallel experts held as plain tensors): those parameters are left out.

:func:`rank_local` says which parameters (by index) and why, the same on every rank (it reads the
model's structure and the configuration only); the agent logs the reasons once at attach.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from trainer_agent.compat import torch_ddp
from trainer_agent.measure.params import unwrapped_name

__all__ = ["LOCAL_SGD", "RankLocal", "local_sgd", "rank_local"]

#: The reason given when post-local SGD turns the comparison off.
LOCAL_SGD = ("post-local SGD: each rank steps on its own gradients between averaging steps, so the ranks' "
             "gradients and parameters differ by design; the cross-rank fingerprints are off")


class RankLocal:
    """What :func:`rank_local` found: ``left_out``, the indices (the agent's parameter order) of
    the parameters not compared; ``everything``, whether nothing at all is compared; ``reasons``,
    one sentence per layout found."""

    def __init__(self, left_out: frozenset[int], everything: bool, reasons: list[str]) -> None:
        self.left_out, self.everything, self.reasons = left_out, everything, reasons


def local_sgd(model: nn.Module) -> bool:
    """Whether the job trains with post-local SGD: ``model`` is a DDP whose communication hook's
    state is a ``PostLocalSGDState`` (``post_localSGD_hook``, the hook ``PostLocalSGDOptimizer``
    is documented with; ``attach`` takes its inner optimizer). A model averaged without that hook
    is not recognised: set ``AgentConfig(fingerprint=False)``."""
    try:
        from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState
    except ImportError:  # pragma: no cover - a torch built without distributed support
        return False
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return any(isinstance(state, PostLocalSGDState) for state in torch_ddp.comm_hook_states(model))
    return False


def _fsdp1_sharded(model: nn.Module) -> set[int]:
    """``id`` of every parameter an FSDP1 wrapper that shards holds (each rank its own shard)."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    except ImportError:  # pragma: no cover - a torch built without distributed support
        return set()
    return {id(p) for m in model.modules() if isinstance(m, FullyShardedDataParallel)
            and m.sharding_strategy != ShardingStrategy.NO_SHARD for p in m.parameters()}


def rank_local(model: nn.Module, params: Sequence[torch.Tensor],
               prefixes: Sequence[str]) -> RankLocal:
    """Which of ``params`` (the agent's parameter order) hold different values on each rank by
    design (see the module docstring). ``prefixes``: ``AgentConfig.rank_local_params``;
    ``ValueError`` when one names no parameter of ``model`` (a typo would compare them)."""
    names = {id(p): unwrapped_name(n) for n, p in model.named_parameters()}
    declared: set[int] = set()
    for prefix in prefixes:
        found = {i for i, n in names.items() if n == prefix or n.startswith(prefix + ".")}
        if not found:
            raise ValueError(f"AgentConfig.rank_local_params: {prefix!r} names no parameter of the model "
                             f"(parameter names such as {sorted(names.values())[:3]})")
        declared |= found
    if local_sgd(model):
        return RankLocal(frozenset(range(len(params))), True, [LOCAL_SGD])
    reasons = []
    sharded = _fsdp1_sharded(model)
    if sharded:
        reasons.append("FSDP1 (FullyShardedDataParallel): each rank holds its own shard of the wrapped parameters; "
                       "they are not compared across ranks")
    if declared:
        reasons.append(f"parameters declared rank-local ({', '.join(prefixes)}) are not compared across ranks")
    left_out = frozenset(i for i, p in enumerate(params) if id(p) in sharded or id(p) in declared)
    return RankLocal(left_out, len(left_out) == len(params), reasons)
