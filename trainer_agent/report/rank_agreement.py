"""What every rank must hold alike, checked once at ``attach``.

The report step's collectives pair every rank's row with every other's, at the steps the schedule
names: they line up only when every rank measures the same parameters (the replicas of one model
under data parallelism, or the DTensor shards of one model under FSDP2, HSDP or tensor
parallelism: the same layers, global shapes and dtypes) and runs the agent configured alike (the
report schedule, the controller or not, the skip guards, the fingerprints, the snapshots). A rank
that differs would enter a collective of another width or at another step: garbage values (gloo),
or a hang of the whole job (NCCL).

:func:`require_alike` digests both on each rank and compares the digests in one all-reduce (MAX
of each digest and of its negation: equal everywhere exactly when max == -max(-d)), and raises
``ValueError`` on every rank when they differ, naming which part. Settings that only shape what a
rank exports or how it talks to the controller (``metrics_port``, ``per_layer``, timeouts, the
token, the controller's address) may differ.

Pipeline-parallel stages hold different layers on different ranks: they are refused here, with a
message that says so.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch
import torch.distributed as dist

from trainer_agent.config import AgentConfig
from trainer_agent.measure.params import ParamIndex

__all__ = ["RANK_LOCAL_SETTINGS", "config_digest", "layout_digest", "require_alike"]

#: ``AgentConfig`` fields that may differ between the ranks of one job.
RANK_LOCAL_SETTINGS = frozenset({
    "metrics_port", "metrics_host", "per_layer", "job_metrics", "token", "request_timeout_s",
    "max_buffered_reports", "close_timeout_s", "flops_per_token", "peak_flops", "memory_trace_steps",
    "desync_rel_tol", "verify_rel_tol", "vocab_size", "special_ids",
})


def _digest(text: str) -> int:
    # 62 bits: the negation of any digest is an int64 too
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2


def layout_digest(params: ParamIndex) -> int:
    """Each measured parameter's layer, global shape and dtype, in the agent's order, and the
    count of sparse-gradient parameters."""
    ids = params.layer_ids.tolist()
    return _digest(repr(([(params.layers[i], tuple(p.shape), str(p.dtype)) for i, p in zip(ids, params.params)],
                         len(params.sparse))))


def config_digest(config: AgentConfig) -> int:
    """The settings that shape the report step's collectives (every field but
    :data:`RANK_LOCAL_SETTINGS`; of ``controller``, whether there is one)."""
    shared = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name not in RANK_LOCAL_SETTINGS}
    shared["controller"] = shared["controller"] is not None
    return _digest(repr(sorted(shared.items())))


def require_alike(params: ParamIndex, config: AgentConfig, world_size: int,
                  group: dist.ProcessGroup | None = None) -> None:
    """``ValueError`` on every rank when the ranks' layouts or shared settings differ (one
    all-reduce of four int64; nothing with one rank)."""
    if world_size < 2:
        return
    layout, shared = layout_digest(params), config_digest(config)
    device = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl"
              else torch.device("cpu"))
    digests = torch.tensor([layout, -layout, shared, -shared], dtype=torch.int64, device=device)
    dist.all_reduce(digests, op=dist.ReduceOp.MAX, group=group)
    high_layout, low_layout, high_shared, low_shared = digests.tolist()
    if high_layout != -low_layout:
        raise ValueError(
            f"the ranks of this job measure different parameters (this rank: {len(params.params)} tensors in "
            f"{len(params.layers)} layers, from {params.layers[0]!r} to {params.layers[-1]!r}). The agent measures "
            "one model on every rank: its replicas (DDP, or the same model on every rank) or its DTensor shards "
            "(FSDP2, HSDP, tensor parallel). Pipeline-parallel stages, or ranks training different models, are "
            "not supported.")
    if high_shared != -low_shared:
        differing = sorted(f.name for f in dataclasses.fields(config) if f.name not in RANK_LOCAL_SETTINGS)
        raise ValueError(
            "the ranks of this job attached with different AgentConfig settings; every rank must pass the same "
            f"values of {', '.join(differing)} (and a controller on every rank or on none), or the ranks' report "
            "steps would not line up. Settings that may differ per rank: "
            f"{', '.join(sorted(RANK_LOCAL_SETTINGS))}.")
