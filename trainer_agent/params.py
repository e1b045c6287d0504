"""The trainable parameters in the agent's order: buckets of one (device, dtype), and layers.

Ordered once, at attach, bucket after bucket, so that every reduction over them is one fused
``torch._foreach_*`` call per bucket and its results line up with the per-layer index without a
scatter. Sharded parameters (FSDP2) would plug in here: the rest of the agent reads parameters only
through :class:`ParamIndex`.
"""

from __future__ import annotations

import torch
from torch import nn

from trainer_agent import stats

__all__ = ["ParamIndex"]

_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


class ParamIndex:
    """The optimizer's trainable parameters, bucketed, with their layer of the model.

    - ``params``: flat list, bucket after bucket; ``buckets``: the same tensors per bucket;
      ``bucket_of[i]``: the bucket of ``params[i]``.
    - ``layers``: layer names (module path cut at ``layer_depth``); ``layer_ids``: device long
      tensor, the layer of each parameter.
    - ``grad_zeros``: a 0-dim zero per bucket, stand-in for a missing gradient (norm 0) that keeps
      its bucket's fused path.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, layer_depth: int) -> None:
        names = {id(p): n for n, p in model.named_parameters()}
        seen: set[int] = set()
        params: list[torch.Tensor] = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        if not params:
            raise ValueError("the optimizer holds no trainable parameter (requires_grad=True)")
        self.params = [params[i] for bucket in stats.buckets(params) for i in bucket]
        self.buckets: list[list[torch.Tensor]] = []
        for p in self.params:
            last = self.buckets[-1][0] if self.buckets else None
            if last is None or (p.device, p.dtype) != (last.device, last.dtype):
                self.buckets.append([])
            self.buckets[-1].append(p)
        self.bucket_of = [k for k, bucket in enumerate(self.buckets) for _ in bucket]
        self.grad_zeros = [torch.zeros((), dtype=b[0].dtype, device=b[0].device) for b in self.buckets]
        self.device = self.params[0].device
        self.numel = sum(p.numel() for p in self.params)
        layers: dict[str, int] = {}
        ids = [layers.setdefault(_layer(names.get(id(p), "unnamed"), layer_depth), len(layers))
               for p in self.params]
        self.layers: list[str] = list(layers)
        self.layer_ids = torch.tensor(ids, dtype=torch.long, device=self.device)

    def grads(self) -> list[list[torch.Tensor]]:
        """The current ``.grad`` per bucket (the bucket's zero where a parameter has none)."""
        return [[p.grad if p.grad is not None else zero for p in bucket]
                for bucket, zero in zip(self.buckets, self.grad_zeros)]

    def versions(self) -> tuple[int, ...]:
        """Autograd's version counters (host ints): they move on every in-place write."""
        return tuple(p._version for p in self.params)

    def sq_norms(self) -> torch.Tensor:
        """Per-parameter ||W||^2 (float64 device vector in this order)."""
        return stats.bucket_norms(self.buckets, self.device).to(torch.float64).square()


def _layer(name: str, depth: int) -> str:
    while name.startswith(_WRAPPER_PREFIXES):  # DDP / DataParallel / torch.compile wrappers
        name = name.split(".", 1)[1]
    module = name.rsplit(".", 1)[0] if "." in name else name
    return ".".join(module.split(".")[:depth])
