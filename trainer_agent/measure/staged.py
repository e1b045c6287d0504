"""Per-tensor statistics of many tensors in a number of kernel launches that does not grow with
the tensor count: the accelerator's passes of a report step over the gradients (their moments,
their non-finite count) and over the update (``stats.tensor_moments``, ``stats.nonfinite_count``,
``stats.update_sq_norms``) for a bucket (one device and dtype) of at least
:data:`STAGED_MIN_TENSORS` tensors.

A ``torch._foreach_*`` pass launches a CUDA kernel per ~110 tensors (ATen's multi-tensor apply),
so the report step's fifteen fused passes over 5,000 gradients were about a thousand launches.
Here the tensors are instead

- laid out once per set of shapes (:class:`StagePlan`): one after the other, in *stages* of at
  most :data:`STAGE_ELEMENTS` elements (a larger tensor is cut), each stage cut into *pieces* of
  at most :data:`PIECE` elements: a tensor, or a part of a larger one;
- copied a stage at a time into one flat buffer (``torch_private.flat_cat``: ``torch._chunk_cat``,
  one CUDA kernel for any number of contiguous tensors of one dtype; FSDP2 packs its
  reduce-scatter input with it);
- widened to float64 in a second buffer, transformed there in place (``clamp_min_``, ``abs_``,
  ``square_``) and reduced per piece with ``torch.segment_reduce`` (CUB's segmented reduction
  on CUDA, one block per segment: no piece is longer than :data:`PIECE`, so that a large tensor
  keeps every multiprocessor busy);
- combined per tensor (``index_add_``, ``scatter_reduce_``) where a tensor has several pieces.

A stage is about a dozen launches whatever its tensors; its temporaries are the stage in the
tensors' dtype and in float64 (192 MiB for float32 at :data:`STAGE_ELEMENTS`, released after the
pass). Every sum is float64 over float64 values: the fused passes' L1 norms accumulate in float64
too, and their float32 L2 norm (squared in float64) is here a float64 sum of squares, as precise
or more. NaN propagates into every statistic of its tensor, as on the fused passes.

Should a staged pass raise (:func:`attempt`: an operator a build lacks, a layout it refuses),
the staged passes are off for the process, a warning says so once, and the fused passes measure
the same values from then on.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from trainer_agent.compat import torch_private

__all__ = ["STAGE_ELEMENTS", "PIECE", "STAGED_MIN_TENSORS", "ON_CPU", "Stage", "StagePlan", "Layout", "Settled",
           "plan_for", "fits_one_stage", "attempt",
           "staged_moments", "staged_sq_norms", "staged_norms", "staged_nonfinite", "staged_update_sq_norms"]

#: Elements per stage (one ``flat_cat``, one float64 buffer): 128 MiB in float64.
STAGE_ELEMENTS = 1 << 24

#: Elements per piece at most: a segment of CUB's segmented reduction is one thread block.
PIECE = 1 << 16

#: Tensors a bucket needs for the staged passes: with fewer, a fused pass is one or two launches.
STAGED_MIN_TENSORS = 128

#: Plain dense tensors only: a DTensor (or another tensor subclass) is measured by the fused
#: passes, which dispatch through it.
PLAIN = (torch.Tensor, torch.nn.Parameter)

#: True: the CPU takes the staged passes too (``bench/agent_overhead.accelerator_paths`` counts
#: the accelerator's operators on the CPU; the tests). The CPU's own passes are chunked
#: (``chunk_plan.py``), by elements not tensors, in cache.
ON_CPU = False


#: Why the staged passes were turned off for this process (their first error), or None.
FAILED: str | None = None

log = logging.getLogger(__name__)

_CONTIGUOUS = torch.Tensor.is_contiguous

#: Plans by (shapes, dtype, device, stage, piece): the same buckets come back every report.
_PLANS: OrderedDict[tuple, StagePlan] = OrderedDict()
_PLANS_KEPT = 64  # (the noise scale's held gradients come in a few fixed subsets per backward pass)


class Stage:
    """Consecutive elements ``[begin, begin + size)`` of the flat layout: ``members`` (per tensor
    or part of one: its index, its first element, -1 for the whole tensor as it is, and its
    length), ``whole`` (when each is a whole tensor of at least one dimension, the members'
    tensors: a slice of them, or their indexes where empty tensors lie between; else None), ``offsets`` (the pieces' bounds in the stage, int64 on the device)."""

    __slots__ = ("begin", "size", "members", "whole", "_bounds", "_device", "_offsets")

    def __init__(self, begin: int, members: list[tuple[int, int, int]], bounds: list[int],
                 device: torch.device, scalars: set[int]) -> None:
        self.begin, self.members = begin, members
        self.size = sum(n for _, _, n in members)
        whole = all(start < 0 and i not in scalars for i, start, _ in members)
        ids = [i for i, _, _ in members]
        # a slice where no empty tensor lies between them (an empty one has no member)
        self.whole = (None if not whole else slice(ids[0], ids[-1] + 1) if ids[-1] - ids[0] == len(ids) - 1
                      else ids)
        self._bounds, self._device = bounds, device
        self._offsets: torch.Tensor | None = None

    @property
    def offsets(self) -> torch.Tensor:
        """The pieces' bounds in the stage (int64 on the device), copied there at first use."""
        if self._offsets is None:
            self._offsets = _on_device(self._bounds, self._device)
        return self._offsets

    def inputs(self, tensors: Sequence[torch.Tensor], *, ordered: bool = True) -> list[torch.Tensor]:
        """The members of ``tensors`` to copy, each in its logical order: whole contiguous tensors
        as they are, parts as flat slices, others (0-dim, non-contiguous: CUDA's kernel would copy
        those in memory order) flattened. Without ``ordered`` (a statistic of each tensor's
        elements whatever their order: norms, moments, counts) whole tensors are taken as they
        are, their contiguity untested: a copy in memory order holds the same elements."""
        if self.whole is not None:
            xs = tensors[self.whole] if type(self.whole) is slice else [tensors[i] for i in self.whole]
            if not ordered or all(map(_CONTIGUOUS, xs)):
                return xs
            return [x if x.is_contiguous() else x.reshape(-1) for x in xs]
        out = []
        for i, start, n in self.members:
            t = tensors[i].reshape(-1)
            out.append(t if start < 0 else t[start:start + n])
        return out

    def reduce(self, values: torch.Tensor, how: str) -> torch.Tensor:
        """``values`` (this stage, flat) reduced per piece: ``"sum"``, ``"max"`` or ``"min"``."""
        return torch.segment_reduce(values, how, offsets=self.offsets, axis=0, unsafe=True)


class StagePlan:
    """The layout of tensors of ``shapes`` (one device and dtype) in stages and pieces (see the
    module docstring). ``owner``: the tensor of each piece, pieces in stage order (int64 on the
    device); ``identity``: every tensor exactly one piece, in order (per-piece results are
    per-tensor results)."""

    def __init__(self, shapes: Sequence[torch.Size], device: torch.device, *,
                 stage: int = STAGE_ELEMENTS, piece: int = PIECE) -> None:
        if stage < 1 or piece < 1:
            raise ValueError(f"stage and piece must be positive, got {stage} and {piece}")
        self.tensors = len(shapes)
        self.stages: list[Stage] = []
        scalars = {i for i, s in enumerate(shapes) if len(s) == 0}
        members: list[tuple[int, int, int]] = []
        bounds, owner = [0], []
        begin = size = 0
        for i, shape in enumerate(shapes):
            n, start = shape.numel(), 0
            if n <= stage and size + n > stage:  # a tensor that fits a stage is not cut
                self.stages.append(Stage(begin, members, bounds, device, scalars))
                begin, size, members, bounds = begin + size, 0, [], [0]
            while start < n:
                if size == stage:
                    self.stages.append(Stage(begin, members, bounds, device, scalars))
                    begin, size, members, bounds = begin + size, 0, [], [0]
                take = min(n - start, stage - size)
                members.append((i, -1 if take == n else start, take))
                for a in range(0, take, piece):
                    owner.append(i)
                    bounds.append(size + min(a + piece, take))
                size += take
                start += take
        if members:
            self.stages.append(Stage(begin, members, bounds, device, scalars))
        self._owner_host, self.device = owner, device
        self._owner: torch.Tensor | None = None
        self.identity = owner == list(range(self.tensors))
        self.elements = begin + size

    @property
    def owner(self) -> torch.Tensor:
        """The tensor of each piece, pieces in stage order (int64 on the device, at first use)."""
        if self._owner is None:
            self._owner = _on_device(self._owner_host, self.device)
        return self._owner

    def per_tensor_sums(self, rows: torch.Tensor) -> torch.Tensor:
        """(k, pieces) per-piece sums summed per tensor: (k, tensors); 0 for an empty tensor."""
        if self.identity:
            return rows
        return torch.zeros(rows.shape[0], self.tensors, dtype=rows.dtype,
                           device=rows.device).index_add_(1, self.owner, rows)

    def per_tensor_extreme(self, values: torch.Tensor, how: str) -> torch.Tensor:
        """Per-piece maxima (``"amax"``) or minima (``"amin"``) combined per tensor."""
        if self.identity:
            return values
        start = -math.inf if how == "amax" else math.inf  # an empty tensor's: no element
        out = torch.full((self.tensors,), start, dtype=values.dtype, device=values.device)
        return out.scatter_reduce_(0, self.owner, values, how)


def _on_device(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``: from pinned memory, without waiting, on CUDA
    (a plan made during a step makes no host-device synchronization)."""
    host = torch.tensor(values, dtype=torch.long)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


class Layout:
    """The shapes and dtype of one bucket of parameters, settled once (at attach): a list of
    tensors tagged with it (:class:`Settled`: the bucket itself, its gradients, its snapshot) is
    planned without reading each tensor's shape and type. A gradient has its parameter's shape,
    dtype and device (autograd refuses any other), so the tag stays true of every step's
    gradients; a bucket cast to another dtype since is planned as an untagged list. (A parameter
    whose ``.data`` is replaced by a tensor of another shape after attach is outside this: the
    optimizer's state would not fit it either.)"""

    __slots__ = ("shapes", "dtype", "plain", "_plans")

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.shapes = tuple(t.shape for t in tensors)
        self.dtype = tensors[0].dtype if tensors else None
        self.plain = bool(tensors) and all(type(t) in PLAIN and t.dtype == self.dtype and t.layout == torch.strided
                                           for t in tensors)
        self._plans: dict[tuple, StagePlan | None] = {}

    def plan(self, device: torch.device) -> StagePlan | None:
        """The plan of this layout at the current stage and piece sizes (made once each)."""
        key = (device, STAGE_ELEMENTS, PIECE)
        if key not in self._plans:
            plan = StagePlan(self.shapes, device, stage=STAGE_ELEMENTS, piece=PIECE)
            self._plans[key] = plan if plan.stages else None
        return self._plans[key]


class Settled(list):
    """A list of tensors whose :class:`Layout` is known (``layout``): see :func:`plan_for`."""

    __slots__ = ("layout",)

    def __init__(self, tensors: Sequence[torch.Tensor], layout: Layout) -> None:
        super().__init__(tensors)
        self.layout = layout


def plan_for(tensors: Sequence[torch.Tensor], device: torch.device) -> StagePlan | None:
    """The plan of ``tensors`` (one bucket) when the staged passes measure them, else None: on an
    accelerator (or on the CPU with :data:`ON_CPU`), for :data:`STAGED_MIN_TENSORS` tensors or
    more, every one a plain dense tensor of one float dtype on ``device``. A :class:`Settled`
    list whose first tensor still has its layout's dtype is planned from the layout: no host
    work per tensor."""
    if len(tensors) < STAGED_MIN_TENSORS or (device.type == "cpu" and not ON_CPU) or FAILED is not None:
        return None
    first = tensors[0]
    if first.device != device or not first.is_floating_point() or first.layout != torch.strided:
        return None
    layout = getattr(tensors, "layout", None)
    if layout is not None and layout.plain and first.dtype == layout.dtype and type(first) in PLAIN:
        return layout.plan(device)
    kinds = {(t.dtype, type(t)) for t in tensors}  # one dtype, plain tensors (callers pass one device)
    if len(kinds) != 1 or type(first) not in PLAIN:
        return None
    key = (tuple([t.shape for t in tensors]), first.dtype, first.device, STAGE_ELEMENTS, PIECE)
    plan = _PLANS.get(key)
    if plan is not None:
        _PLANS.move_to_end(key)
        return plan
    plan = StagePlan(key[0], first.device, stage=STAGE_ELEMENTS, piece=PIECE)
    if not plan.stages:  # every tensor empty: nothing to copy
        return None
    _PLANS[key] = plan
    while len(_PLANS) > _PLANS_KEPT:
        _PLANS.popitem(last=False)
    return plan


def fits_one_stage(buckets: Sequence[Sequence[torch.Tensor]]) -> bool:
    """Whether every bucket holds enough tensors for the staged passes and fits one stage: the
    many small tensors an ordinary step may norm from one copy (``one_copy_norm.OneCopyNorm``).
    Decided once from the parameters (their gradients have their sizes), so that a larger model's
    ordinary steps look up no plan at all."""
    return bool(buckets) and all(len(b) >= STAGED_MIN_TENSORS and sum(t.numel() for t in b) <= STAGE_ELEMENTS
                                 for b in buckets)


def attempt(fn: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` (a staged pass), or None where it raises: the staged passes are then
    turned off for this process (:data:`FAILED`, logged once) and the caller takes the fused
    passes, this time and from then on; out of memory only this time. The staged passes write
    nothing but their own buffers (the update's snapshot aside, whose caller re-raises instead)."""
    global FAILED
    try:
        return fn(*args, **kwargs)
    except torch.OutOfMemoryError:  # this report's temporaries: the fused passes need fewer
        log.warning("trainguard: out of memory for the staged per-tensor statistics of this report; "
                    "measuring it with the fused passes")
        return None
    except (RuntimeError, TypeError, ValueError, IndexError) as e:
        FAILED = f"{type(e).__name__}: {e}"
        _PLANS.clear()
        log.warning("trainguard: the staged per-tensor statistics failed (%s); measuring with the fused passes "
                    "from now on (the same values, more kernel launches)", FAILED)
        return None


@torch.no_grad()
def staged_moments(tensors: Sequence[torch.Tensor], plan: StagePlan) -> torch.Tensor:
    """The :data:`~trainer_agent.measure.stats.MOMENTS` of non-empty ``tensors`` (laid out by
    ``plan``) as a (5, len(tensors)) float64 tensor, a column per tensor: ``||relu(t)||_1``,
    ``||t||_1``, ``||t||^2``, ``max |t|``, ``-min |t|``; NaN in every row of a tensor with one."""
    columns: list[list[torch.Tensor]] = [[] for _ in range(5)]
    for st in plan.stages:
        flat = torch_private.flat_cat(st.inputs(tensors, ordered=False))
        wide = torch.empty(st.size, dtype=torch.float64, device=flat.device)
        wide.copy_(flat).clamp_min_(0.0)  # relu (NaN stays NaN)
        columns[0].append(st.reduce(wide, "sum"))
        wide.copy_(flat).abs_()
        columns[1].append(st.reduce(wide, "sum"))
        columns[3].append(st.reduce(wide, "max"))
        columns[4].append(st.reduce(wide, "min"))
        wide.square_()  # |t|^2 in float64: no float32 value overflows it
        columns[2].append(st.reduce(wide, "sum"))
    pieces = torch.stack([torch.cat(c) if len(c) > 1 else c[0] for c in columns])
    if plan.identity:  # a piece per tensor: ATen's segmented maximum and minimum propagate NaN
        pieces[4].neg_()
        return pieces
    low = plan.per_tensor_extreme(pieces[4], "amin").neg_()
    out = torch.cat([plan.per_tensor_sums(pieces[:3]), plan.per_tensor_extreme(pieces[3], "amax")[None], low[None]])
    # A NaN makes its tensor's L1 norm NaN: every moment of the tensor NaN, whatever the order in
    # which a scattered maximum meets it.
    return out.masked_fill_(out[1].isnan(), math.nan)


@torch.no_grad()
def staged_sq_norms(tensors: Sequence[torch.Tensor], plan: StagePlan) -> torch.Tensor:
    """``||t||^2`` of each of ``tensors`` (laid out by ``plan``), a float64 vector: per stage one
    copy, widened and squared in float64, one segmented sum."""
    parts = []
    for st in plan.stages:
        flat = torch_private.flat_cat(st.inputs(tensors, ordered=False))
        wide = torch.empty(st.size, dtype=torch.float64, device=flat.device)
        parts.append(st.reduce(wide.copy_(flat).square_(), "sum"))
    return plan.per_tensor_sums((torch.cat(parts) if len(parts) > 1 else parts[0]).unsqueeze(0))[0]


@torch.no_grad()
def staged_norms(tensors: Sequence[torch.Tensor], plan: StagePlan, dtype: torch.dtype) -> torch.Tensor:
    """The L2 norm of each stage of ``tensors`` (laid out by ``plan``) accumulated in ``dtype``,
    a vector whose norm is the norm of all of them: per stage one copy and one norm."""
    norms = [torch.linalg.vector_norm(torch_private.flat_cat(st.inputs(tensors, ordered=False)), dtype=dtype)
             for st in plan.stages]
    return norms[0].reshape(1) if len(norms) == 1 else torch.stack(norms)


@torch.no_grad()
def staged_nonfinite(tensors: Sequence[torch.Tensor], plan: StagePlan) -> torch.Tensor:
    """The number of NaN/Inf elements of ``tensors`` (laid out by ``plan``), a float64 scalar:
    per stage its copy times 0 (NaN exactly where an element is not finite), counted by an
    ord-0 norm in float64 (exact)."""
    total = None
    for st in plan.stages:
        flat = torch_private.flat_cat(st.inputs(tensors, ordered=False))  # a new buffer (cat): ours to overwrite
        flat.mul_(0.0)
        count = torch.linalg.vector_norm(flat, 0, dtype=torch.float64)
        total = count if total is None else total.add_(count)
    return total if total is not None else torch.zeros((), dtype=torch.float64, device=plan.device)


@torch.no_grad()
def staged_update_sq_norms(before: Sequence[torch.Tensor], after: Sequence[torch.Tensor], plan: StagePlan, *,
                           before_norms: bool, flat_before: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Per tensor pair (``before[i]`` the agent's snapshot of ``after[i]``, laid out by ``plan``),
    float64 vectors: ``[||before - after||^2, ||after||^2]`` and, with ``before_norms``,
    ``||before||^2``. ``flat_before``: the snapshot as one flat buffer in the plan's layout (the
    difference is then made in it, as the fused pass makes it in the snapshot), else each stage of
    ``before`` is copied. The difference is taken in the tensors' dtype, as the optimizer's
    update was; its square and sum in float64."""
    columns: list[list[torch.Tensor]] = [[], [], []] if before_norms else [[], []]
    for st in plan.stages:
        a = torch_private.flat_cat(st.inputs(after))
        b = (flat_before[st.begin:st.begin + st.size] if flat_before is not None
             else torch_private.flat_cat(st.inputs(before)))
        wide = torch.empty(st.size, dtype=torch.float64, device=a.device)
        if before_norms:
            columns[2].append(st.reduce(wide.copy_(b).square_(), "sum"))
        b.sub_(a)
        columns[0].append(st.reduce(wide.copy_(b).square_(), "sum"))
        columns[1].append(st.reduce(wide.copy_(a).square_(), "sum"))
    pieces = torch.stack([torch.cat(c) if len(c) > 1 else c[0] for c in columns])
    return list(plan.per_tensor_sums(pieces).unbind(0))
