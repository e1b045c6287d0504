"""The trainable parameters in the agent's order: buckets of one (device, dtype), and layers.

Ordered once, at attach, bucket after bucket, so that every reduction over them is one fused
``torch._foreach_*`` call per bucket and its results line up with the per-layer index without a
scatter. The rest of the agent reads parameters only through :class:`ParamIndex`.

Parameters held as DTensors (FSDP2, HSDP, tensor parallel) are measured on their local shards:
``buckets``, ``grads()`` and ``versions()`` are local tensors, and ``sharding`` (a
:class:`~trainer_agent.measure.sharding.Sharding`) says which share of each per-parameter sum this rank
contributes to the global value formed at a report. Without any DTensor ``sharding`` is None and
every value is this rank's own (one process, or DDP's replicated gradients).
"""

from __future__ import annotations

import functools
import operator
from itertools import chain, compress, repeat
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from trainer_agent.measure import staged, stats
from trainer_agent.compat import torch_private
from trainer_agent.measure.one_copy_norm import OneCopyNorm
from trainer_agent.measure.sharding import Sharding, is_dtensor, local

if TYPE_CHECKING:
    from trainer_agent.measure.bucket_views import BucketViews
    from trainer_agent.measure.fsdp_grad_buffers import FsdpGradBuffers

__all__ = ["ParamIndex", "layer_names", "sparse_gradient_params", "unwrapped_name"]

_GRAD = operator.attrgetter("grad")
_IS_NONE = functools.partial(operator.is_, None)
_REQUIRES_GRAD = operator.attrgetter("requires_grad")

_WRAPPER_PREFIXES = ("module.", "_orig_mod.")
#: The attribute under which a wrapper module holds the module it wraps, anywhere in a path:
#: ``torch.compile``'s ``OptimizedModule`` (``_orig_mod``), ``checkpoint_wrapper``'s
#: ``CheckpointWrapper`` (``_checkpoint_wrapped_module``), FSDP1 (``_fsdp_wrapped_module``).
_WRAPPED = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})

try:  # FSDP2's fully_shard swaps a module's class for FSDP<Class>(FSDPModule, Class)
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - a torch built without distributed support
    FSDPModule = None  # type: ignore[assignment,misc]


class ParamIndex:
    """The optimizer's trainable parameters, bucketed, with their layer of the model.

    - ``params``: flat list, bucket after bucket; ``buckets``: the same tensors per bucket;
      ``bucket_of[i]``: the bucket of ``params[i]``.
    - ``layers``: layer names (:func:`layer_names`: the repeated block a parameter belongs to, or
      the module path cut at ``layer_depth`` when one is given); ``layer_ids``: device long
      tensor, the layer of each parameter.
    - ``grad_zeros``: a 0-dim zero per bucket, stand-in for a missing gradient (norm 0) that keeps
      its bucket's fused path.
    - ``sharding``: the shares of this rank when parameters are DTensors, else None.

    ``params`` are the optimizer's parameters (DTensors or not); ``buckets`` hold their local
    tensors (the same tensors for plain parameters).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, layer_depth: int | None = None) -> None:
        names = layer_names(model, layer_depth)
        seen: set[int] = set()
        params: list[torch.Tensor] = []
        sparse_ids = sparse_gradient_params(model)
        #: Parameters whose gradients are sparse (``nn.Embedding(sparse=True)``): their gradients
        #: count in the step's gradient norm and non-finite count (``stats.sparse_sq_norm``), and
        #: are left out of everything per parameter.
        self.sparse: list[torch.Tensor] = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    (self.sparse if id(p) in sparse_ids else params).append(p)
        #: Their names (without a wrapper's prefix), for the warning at attach.
        self.sparse_names = [sparse_ids[id(p)] for p in self.sparse]
        self._attached = frozenset(seen)
        # What can make a parameter trainable later: one frozen at attach, or a group added.
        self._frozen = [p for g in optimizer.param_groups for p in g["params"] if not p.requires_grad]
        self._held = sum(len(g["params"]) for g in optimizer.param_groups)
        #: Whether :meth:`unmeasured` found parameters added since attach (then it is not read again).
        self.grown = False
        if not params:
            raise ValueError("the optimizer holds no trainable parameter with a dense gradient "
                             f"(requires_grad=True; {len(self.sparse)} with sparse gradients)")
        self.params, self.buckets = _bucketed(params)
        #: The (local) tensors of ``buckets``, bucket after bucket.
        self.locals = [p for bucket in self.buckets for p in bucket]
        self.bucket_of = [k for k, bucket in enumerate(self.buckets) for _ in bucket]
        self.grad_zeros = [torch.zeros((), dtype=b[0].dtype, device=b[0].device) for b in self.buckets]
        self.device = self.buckets[0][0].device
        self._numels = [p.numel() for p in self.params]  # a DTensor's numel is the global one
        self.numel = sum(self._numels)
        #: The flat buffers the gradients are views of, set by the agent: DDP's gradient buckets
        #: (``gradient_as_bucket_view``; ``trainer_agent/measure/bucket_views.py``) or FSDP2's
        #: reduce-scatter outputs (``trainer_agent/measure/fsdp_grad_buffers.py``).
        self.bucket_views: BucketViews | FsdpGradBuffers | None = None
        self.sharding = (Sharding(self.params, self.device) if any(is_dtensor(p) for p in self.params)
                         else None)
        self.one_copy = OneCopyNorm.for_buckets(self.buckets) if self.sharding is None else None  #: ordinary steps
        layers: dict[str, int] = {}
        ids = [layers.setdefault(names.get(id(p), "unnamed"), len(layers)) for p in self.params]
        self.layers: list[str] = list(layers)
        self.layer_ids = torch.tensor(ids, dtype=torch.long, device=self.device)

    def trainable_elements(self) -> int:
        """Elements of the measured parameters that require a gradient now: a change is the run's
        own (freezing or unfreezing part of the model), which the spike guard and the controller's
        spike rules take as a new baseline, not as a spike. One attribute read per tensor: read on
        report steps and on a spike only."""
        return sum(compress(self._numels, map(_REQUIRES_GRAD, self.params)))

    def flat_grads(self) -> list[torch.Tensor | None]:
        """The current ``.grad`` of every parameter, in order: one attribute read per tensor
        (``map`` of an ``attrgetter``: half the Python of a comprehension)."""
        return list(map(_GRAD, self.params))

    def has_grad(self) -> bool:
        """Whether any parameter, or any of :attr:`sparse`, holds a ``.grad`` (stops at the first;
        the reads in C, as :meth:`flat_grads`)."""
        return not all(map(_IS_NONE, map(_GRAD, self.params))) or not all(map(_IS_NONE, map(_GRAD, self.sparse)))

    def ungraded(self, grads: list[list[torch.Tensor]] | None = None) -> np.ndarray | None:
        """The indices of the parameters without a ``.grad`` (host array), None when every one has
        one. ``grads``: what :meth:`grads` returned for the gradients now (no attribute read: a
        missing one is its bucket's zero, a :class:`~trainer_agent.measure.staged.Settled` bucket
        misses none); without it one attribute read per tensor, in C (as :meth:`flat_grads`)."""
        if grads is None:
            missing = list(map(_IS_NONE, map(_GRAD, self.params)))
        elif all(isinstance(bucket, staged.Settled) for bucket in grads):
            return None
        else:
            missing = list(chain.from_iterable(
                repeat(False, len(bucket)) if isinstance(bucket, staged.Settled)
                else map(operator.is_, bucket, repeat(zero)) for bucket, zero in zip(grads, self.grad_zeros)))
        return np.flatnonzero(missing) if any(missing) else None

    def grads(self) -> list[list[torch.Tensor]]:
        """The current ``.grad`` per bucket (the bucket's zero where a parameter has none): one
        attribute read per tensor, the DTensors' local shards taken in the same pass
        (``torch_private.dtensor_locals``); the parameters lie bucket after bucket, so each
        bucket is a slice."""
        flat = self.flat_grads()
        if self.sharding is not None:
            flat = torch_private.dtensor_locals(flat)
        out, start = [], 0
        for bucket, zero in zip(self.buckets, self.grad_zeros):
            gs = flat[start:start + len(bucket)]
            start += len(bucket)
            if any(map(_IS_NONE, gs)):  # (not ``None in gs``: that calls Tensor.__eq__ per tensor)
                gs = [zero if g is None else g for g in gs]
            elif self.sharding is None:  # a gradient has its parameter's shape and dtype
                gs = staged.Settled(gs, bucket.layout)
            out.append(gs)
        return out

    def unmeasured(self, optimizer: torch.optim.Optimizer) -> int:
        """How many trainable parameters ``optimizer`` holds that it did not hold at attach (one
        unfrozen since, or added with ``add_param_group``): no measurement reads them. Host work
        per param group and per parameter frozen at attach while there are none (then per
        parameter); sets :attr:`grown` when there are any."""
        groups = optimizer.param_groups
        if sum(len(g["params"]) for g in groups) == self._held and not any(p.requires_grad for p in self._frozen):
            return 0
        attached = self._attached
        count = sum(1 for g in groups for p in g["params"] if p.requires_grad and id(p) not in attached)
        self.grown = count > 0
        return count

    def pending_grads(self) -> set[int]:
        """Indices of the DTensor gradients whose placements are not their parameter's (e.g. the
        ``Partial`` gradient of a sequence-parallel norm, summed over the ranks only inside the
        optimizer's update): their local values are pending sums, not the parameter's layout.
        Empty without sharding (no loop)."""
        if self.sharding is None:
            return set()
        return {i for i, p in enumerate(self.params)
                if is_dtensor(p.grad) and p.grad.placements != p.placements}  # type: ignore[union-attr]

    def versions(self) -> tuple[object, ...]:
        """Autograd's version counters of the (local) tensors (host ints): they move on every
        in-place write."""
        return torch_private.version_counters(self.locals)

    def sq_norms(self) -> torch.Tensor:
        """Per-parameter ||W||^2 (float64 device vector in this order)."""
        return stats.bucket_norms(self.buckets, self.device).to(torch.float64).square()


def _bucketed(params: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[staged.Settled]]:
    """``params`` ordered bucket after bucket (``stats.buckets`` of their local tensors), and the
    local tensors per bucket, each bucket's shapes settled (``staged.Layout``: its gradients are
    planned without reading a shape per tensor)."""
    locals_ = [local(p) for p in params]
    groups = stats.buckets(locals_)
    ordered = [params[i] for group in groups for i in group]
    buckets = []
    for group in groups:
        members = [locals_[i] for i in group]
        buckets.append(staged.Settled(members, staged.Layout(members)))
    return ordered, buckets


def sparse_gradient_params(model: nn.Module) -> dict[int, str]:
    """The parameters of ``model`` whose gradients are sparse tensors: the weights of
    ``nn.Embedding`` and ``nn.EmbeddingBag`` modules built with ``sparse=True``; id -> name
    (without DDP's ``module.`` or ``torch.compile``'s ``_orig_mod.``)."""
    return {id(m.weight): unwrapped_name(f"{name}.weight" if name else "weight") for name, m in model.named_modules()
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse}


def layer_names(model: nn.Module, layer_depth: int | None = None) -> dict[int, str]:
    """The layer of each parameter of ``model`` (by ``id``), as the per-layer metrics, the
    fingerprints and the desync findings name it.

    By default a layer is a repeated block: a child of an ``nn.ModuleList`` or ``nn.Sequential``
    that has a sibling of its own class (a transformer's blocks: ``transformer.h.3`` in GPT-2,
    ``model.layers.3`` in Llama), the outermost one on the parameter's path (a block's experts
    stay in their block). A parameter outside every repeated block belongs to the module that
    holds it (``transformer.wte``, ``model.norm``, ``lm_head``). With ``layer_depth`` the
    module path is cut at that many components instead (``blocks.3.attn.qkv.weight`` is in
    ``blocks.3`` at depth 2; shallower modules keep their full path). Wrappers are not part of a
    name, nor of a depth: DDP's ``module.`` prefix, and anywhere in a path the module a
    ``torch.compile``, ``checkpoint_wrapper`` or FSDP1 wrapper holds (``blocks.3._orig_mod.attn``
    is ``blocks.3.attn``); a block is told from its siblings by the class it wraps (per-layer
    activation checkpointing of every other block leaves them one kind of block)."""
    blocks = set() if layer_depth is not None else _repeated_blocks(model)
    out: dict[int, str] = {}
    for name, p in model.named_parameters():
        if layer_depth is not None:
            module = _module_of(unwrapped_name(name))
            out[id(p)] = ".".join(module[:layer_depth])
        else:  # blocks are paths in the wrapped model: unwrapped once found
            module = _module_of(name)
            layer = next((module[:i] for i in range(1, len(module) + 1) if ".".join(module[:i]) in blocks), module)
            out[id(p)] = unwrapped_name(".".join(layer))
    return out


def _module_of(name: str) -> list[str]:
    """The path components of the module holding parameter ``name`` (a parameter of the root
    module: its own name)."""
    parts = name.split(".")
    return parts[:-1] or parts


def _repeated_blocks(model: nn.Module) -> set[str]:
    """Module paths of the children of ModuleLists and Sequentials that have a sibling of their
    class (:func:`_wrapped_class`: a wrapped block is one of its kind)."""
    out: set[str] = set()
    for path, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            children = list(module.named_children())
            classes = [_wrapped_class(child) for _, child in children]
            out.update(f"{path}.{name}" if path else name for (name, _), cls in zip(children, classes)
                       if classes.count(cls) > 1)
    return out


def _wrapped_class(module: nn.Module) -> type:
    """The class of the module that ``module`` stands for: through the wrappers of :data:`_WRAPPED`,
    and FSDP2's class swap undone (``FSDPBlock`` is ``Block``)."""
    inner: nn.Module | None = module
    while inner is not None:
        module = inner
        inner = next((child for name, child in module.named_children() if name in _WRAPPED), None)
    cls = type(module)
    if FSDPModule is not None and issubclass(cls, FSDPModule):
        cls = next((base for base in cls.__bases__ if base is not FSDPModule), cls)
    return cls


def unwrapped_name(name: str) -> str:
    """``name`` without the wrappers' path components: DDP's and ``torch.compile``'s leading
    ``module.``/``_orig_mod.``, and :data:`_WRAPPED` anywhere (``layers.1._orig_mod.mlp`` is
    ``layers.1.mlp``): the names layer metrics carry."""
    while name.startswith(_WRAPPER_PREFIXES):  # DDP / DataParallel / torch.compile wrappers
        name = name.split(".", 1)[1]
    parts = name.split(".")
    return ".".join(part for part in parts if part not in _WRAPPED) if _WRAPPED.intersection(parts) else name
