"""Parameters held as DTensors (FSDP2's ``fully_shard``, HSDP, tensor parallel): which share of a
global sum each rank contributes, and the one collective that adds the shares up at a report.

A DTensor's global squared norm is the sum of its local shards' squared norms over the mesh
dimensions it is *sharded* on (``Shard`` placements); along a dimension it is *replicated* on
(``Replicate``) every rank holds the same values, which must be counted once. Each rank therefore
keeps, per parameter, its local partial sum times a *share*: 1 on the one replica whose mesh
coordinate is 0 along every replicated dimension, 0 elsewhere. Summing the shares of every rank
(one ``all_reduce`` over the default process group) gives exactly the global value, for every
placement at once: FSDP2 (``Shard(0)`` on a 1-D mesh), HSDP (``Replicate, Shard(0)``), tensor
parallel (``Shard(0)``/``Shard(1)`` and replicated parameters), and their combinations. This is the
sum that ``torch.nn.utils.clip_grad_norm_`` computes for DTensor gradients. A plain tensor among
DTensors is taken as replicated on every rank (e.g. a layer left out of a tensor-parallel plan):
rank 0 contributes it. A mesh smaller than the world (replicated over the remaining ranks by an
outer data-parallel wrapper) is counted in ``world / mesh size`` equal copies, each weighted by
their inverse.

A gradient is assumed to carry its parameter's placements (as under FSDP2 and the row/column-wise
tensor-parallel plans). ``Partial`` placements (pending sums) are refused at attach with a
``ValueError``: a norm of a pending sum cannot be formed from local values. Pipeline stages (each
rank holding different plain tensors) are not supported (refused at attach:
``trainer_agent/report/rank_agreement.py``).

The same placements say which ranks must hold *identical* local tensors (the replicas along the
``Replicate`` dimensions): :func:`replica_units` groups them for the cross-rank fingerprints of
``trainer_agent/measure/fingerprint.py``, read from the mesh's rank layout, with no communication.

Local values are read through ``DTensor.to_local()`` semantics without autograd (the shard itself,
:func:`trainer_agent.compat.torch_private.dtensor_local`): no communication, no copy.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch
import torch.distributed as dist

from trainer_agent.compat import torch_private

__all__ = ["is_dtensor", "local", "Sharding", "replica_classes", "replica_units"]

try:  # torch >= 2.5: the public DTensor package
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - a torch built without distributed support
    DTensor = None  # type: ignore[assignment,misc]


def is_dtensor(t: object) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (no copy, no communication); any other tensor as it is."""
    return torch_private.dtensor_local(t) if is_dtensor(t) else t


class Sharding:
    """The shares of one rank for the parameters ``params`` (the agent's order); see the module
    docstring.

    - ``share``: float64 device vector, this rank's weight of each parameter's local partial sums.
    - ``count_share``: the weight of this rank's non-finite counts.
    - ``kept``: host list, indices of the parameters this rank contributes at all (share > 0);
      ``kept_index``: the same as a device long tensor.
    """

    def __init__(self, params: Sequence[torch.Tensor], device: torch.device) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("parameters are DTensors but torch.distributed is not initialized")
        self.world_size = dist.get_world_size()
        rank = dist.get_rank()
        shares: list[float] = []
        for i, p in enumerate(params):
            if not is_dtensor(p):
                shares.append(1.0 if rank == 0 else 0.0)
                continue
            mesh, placements = p.device_mesh, p.placements  # type: ignore[attr-defined]
            if any(pl.is_partial() for pl in placements):
                raise ValueError(f"parameter {i} has a Partial placement {placements}: its norm cannot be "
                                 "formed from local values")
            coordinate = mesh.get_coordinate()
            if coordinate is None:  # this rank is outside the parameter's mesh: holds nothing of it
                shares.append(0.0)
                continue
            first = all(coordinate[d] == 0 for d, pl in enumerate(placements) if not pl.is_shard())
            shares.append(mesh.size() / self.world_size if first else 0.0)
        self.share = torch.tensor(shares, dtype=torch.float64, device=device)
        self.kept = [i for i, s in enumerate(shares) if s > 0]
        self.kept_index = torch.tensor(self.kept, dtype=torch.long, device=device)
        #: The weight of this rank's non-finite counts (taken over its kept tensors): the share of
        #: its first kept parameter (1 when the mesh spans the world; one mesh assumed).
        self.count_share = shares[self.kept[0]] if self.kept else 0.0
        self.device = device
        backend = dist.get_backend()
        self._collective_device = (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl"
                                   else torch.device("cpu"))

    def shares(self, per_param: torch.Tensor) -> torch.Tensor:
        """``per_param`` (float64, parameter order) weighted by this rank's shares. A masked-out
        entry becomes 0 even when it is NaN/Inf (that replica's value is counted where it is kept)."""
        return torch.where(self.share > 0, per_param * self.share, 0.0)

    def sum_over_ranks(self, vector: torch.Tensor) -> torch.Tensor:
        """Element-wise sum of ``vector`` (float64) over every rank: one ``all_reduce`` on the
        default process group, on the device its backend wants (for CUDA values under gloo the
        copy to the CPU is a SYNC, once per report step). Returns the sum on ``self.device``."""
        src = vector.to(self._collective_device)
        if src is vector:
            src = vector.clone()
        dist.all_reduce(src)
        return src.to(self.device, non_blocking=True)


def replica_classes(p: torch.Tensor, world: int) -> tuple[int, ...]:
    """For every global rank, the class of ranks that hold the same local tensor of ``p`` (-1: a
    rank outside the parameter's mesh, which holds none of it). Ranks whose mesh coordinates agree
    on every ``Shard`` dimension hold the same shard: along the ``Replicate`` dimensions they are
    replicas (HSDP's replicate dimension, a tensor-parallel norm, TP inside data parallelism). A
    plain tensor among DTensors is replicated on every rank: one class. Read from the mesh's rank
    layout: no communication."""
    if not is_dtensor(p):
        return (0,) * world
    mesh, placements = p.device_mesh, p.placements  # type: ignore[attr-defined]
    layout = mesh.mesh  # the global rank at each mesh coordinate
    key = torch.zeros(layout.shape, dtype=torch.long)
    for d, pl in enumerate(placements):
        if pl.is_shard():  # the coordinate along d tells the shards apart
            shape = [1] * layout.dim()
            shape[d] = layout.shape[d]
            key = key * layout.shape[d] + torch.arange(layout.shape[d]).view(shape)
    classes = [-1] * world
    for r, k in zip(layout.reshape(-1).tolist(), key.reshape(-1).tolist()):
        if 0 <= r < world:
            classes[r] = k
    return tuple(classes)


def replica_units(params: Sequence[torch.Tensor], layer_of: Sequence[int], layer_names: Sequence[str],
                  world: int, device: torch.device
                  ) -> tuple[list[int], list[str], list[tuple[torch.Tensor, torch.Tensor]]] | None:
    """What the replicas of sharded parameters can compare (``trainer_agent/measure/fingerprint.py``): the
    parameters of one layer with the same :func:`replica_classes` form a *unit*, compared within
    each class of two or more ranks. Returns ``(unit of each parameter (-1: no replica to compare
    with), unit names, groups for fingerprint.desync)``, or None when no parameter has a replica
    (plain FSDP: every rank holds a different shard of everything). The same on every rank: the
    placements and the mesh are."""
    units: dict[tuple[int, tuple[int, ...]], int] = {}
    unit_of: list[int] = []
    layouts: dict[tuple[int, tuple[object, ...]], tuple[int, ...]] = {}  # one per (mesh, placements)
    for p, layer in zip(params, layer_of):
        spec = (id(p.device_mesh), tuple(p.placements)) if is_dtensor(p) else (0, ())  # type: ignore[attr-defined]
        classes = layouts.get(spec)
        if classes is None:
            classes = layouts[spec] = replica_classes(p, world)
        counts = [classes.count(c) for c in set(classes) if c >= 0]
        unit_of.append(units.setdefault((layer, classes), len(units)) if max(counts, default=0) >= 2 else -1)
    if not units:
        return None
    names = [layer_names[layer] for layer, _ in units]
    by_layout: dict[tuple[tuple[int, ...], int], list[int]] = {}  # (classes, class size) -> units
    for (_, classes), u in units.items():
        for size in {classes.count(c) for c in set(classes) if c >= 0 and classes.count(c) >= 2}:
            by_layout.setdefault((classes, size), []).append(u)
    groups = []
    for (classes, size), us in by_layout.items():
        members = [[r for r in range(world) if classes[r] == c] for c in sorted(set(classes))
                   if c >= 0 and classes.count(c) == size]
        groups.append((torch.tensor(us, dtype=torch.long, device=device),
                       torch.tensor(members, dtype=torch.long, device=device)))
    seen = Counter(names)  # one layer, two layouts (TP inside DP: a sharded weight, a replicated bias)
    names = [n if seen[n] == 1 else f"{n} ({_kind(params, unit_of, u)})" for u, n in enumerate(names)]
    return unit_of, names, groups


def _kind(params: Sequence[torch.Tensor], unit_of: Sequence[int], unit: int) -> str:
    """A short description of a unit's placements, to tell apart two units of one layer."""
    p = params[unit_of.index(unit)]
    return "replicated" if not is_dtensor(p) else ",".join(str(pl) for pl in p.placements)  # type: ignore[attr-defined]
