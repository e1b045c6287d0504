"""The one collective of a report step: every rank's row, and the controller's desired state.

On a report step with several ranks, every rank enters exactly one all-gather (the *exchange*).
Its row is ``[desired state (STATE_LEN int64 as float64 bits)] + [RANK_FIELDS (float64)] + [sketch
(SKETCH_K int64 as float64 bits)]``: the state part is the leader's proposal (the other ranks send
zeros there and read the leader's), the fields are this rank's values of the report, the sketch is
the bottom-k sketch of the sequences this rank observed since its last report
(``trainer_agent/measure/sketch.py``; the leader turns the sketches into the report's ``data_overlap``).
The state and sketch parts are present only when a control plane agrees on a controller's state
across several ranks (every rank is configured alike, so every row has the same width); a single
rank applies its own proposal.

The per-rank values are declared once, in ``trainguard.protocol.rank_values.RANK_VALUES``:
``RANK_FIELDS`` (the row's columns) and ``WIRE_VECTORS`` (the report's vectors) derive from it, and
``trainer_agent/report/pipeline.py`` fills the row from the same declarations.

After the gather every rank reads the leader's state part (``STATE_LEN`` values: O(1); with a flag
every rank computed from the rows, such as whether the fingerprints' screens differ, in the same
read: :meth:`RankExchange.head`); only the
leader keeps the other ranks' fields and sketches, turned into the report's per-rank vectors and
``data_overlap`` off the training thread (``trainer_agent/report/pipeline.py``, ``RankVectors``).

The row lives where the default process group's backend wants it: on the CUDA device for NCCL (no
sync to build or gather it), on the CPU for gloo (for CUDA parameters under gloo, moving the row to
the CPU is a SYNC, once per report step).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

from trainguard.protocol.commands import LR_RULES, STATE_LEN, decode_state, encode_state
from trainguard.protocol.rank_values import BY_FIELD, BY_WIRE, ROW_VALUES
from trainer_agent.compat.torch_collectives import all_gather_single
from trainer_agent.measure.sketch import EMPTY, SKETCH_K, overlaps

__all__ = ["ABSENT_WITH_METRIC", "RANK_FIELDS", "STATE_LEN", "WIRE_VECTORS", "RankExchange", "absent_vectors",
           "encode_state", "decode_state"]  # the codec: trainguard.protocol.commands

#: Per-rank values gathered at each report step (the ``row`` values of ``RANK_VALUES``, in order);
#: on the leader ``Agent.rank_values[field][r]`` is rank ``r``'s value of that report.
RANK_FIELDS: tuple[str, ...] = tuple(s.field for s in ROW_VALUES)

#: The per-rank vectors of a controller report (``RankValues`` field -> ``Agent.rank_values`` key).
#: The fingerprints and their comparison (``grad_desync``, ``param_desync``) come from
#: ``trainer_agent/measure/fingerprint.py`` under data parallelism and for replicated shards (NaN with one
#: rank, and under plain FSDP); the leader computes ``data_overlap`` from the ranks' sketches.
WIRE_VECTORS: dict[str, str] = {wire: s.field for wire, s in BY_WIRE.items()}

#: Row values that are training values a report may lack: its interval had no step with a loss
#: (``end_step(None)``), its step had no gradient. A row holds floats only, so a rank's row holds NaN
#: there, which a rule would read as a non-finite loss or gradient: where the report lacks the
#: metric, its vector is empty (absent) instead (:func:`absent_vectors`).
ABSENT_WITH_METRIC: dict[str, str] = {field: str(BY_FIELD[field].metric) for field in ("loss", "grad_norm")}


def absent_vectors(values: Mapping[str, float]) -> tuple[str, ...]:
    """The fields of :data:`ABSENT_WITH_METRIC` whose metric the report ``values`` lack."""
    return tuple(field for field, metric in ABSENT_WITH_METRIC.items() if metric not in values)


_EMPTY_SKETCH = [int(EMPTY.view("int64"))] * SKETCH_K


class RankExchange:
    """Packs, gathers and unpacks the report step's rows (see the module docstring).

    ``with_state``: the rows carry the desired-state part. ``rank``: this rank in ``group`` (0:
    the leader). ``group``: the process group (default: the default group)."""

    def __init__(self, world_size: int, *, with_state: bool, rank: int = 0, group: dist.ProcessGroup | None = None,
                 extra_width: int = 0) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.world_size = world_size
        self.rank = rank
        self.with_state = with_state
        self.group = group
        self.offset = STATE_LEN if with_state else 0
        self.extra_width = extra_width
        self.sketch_at = self.offset + len(RANK_FIELDS) + extra_width
        self.width = self.sketch_at + (SKETCH_K if with_state else 0)

    @property
    def leader(self) -> bool:
        """This rank keeps every rank's values (rank 0)."""
        return self.rank == 0

    def pack(self, fields: torch.Tensor, state: Sequence[int] | None, sketch: Sequence[int] | None = None, *,
             extra: torch.Tensor | None = None) -> torch.Tensor:
        """One row: ``state`` (the leader's proposal; None on the other ranks), ``fields``
        (float64 vector of ``len(RANK_FIELDS)`` on any device; the row is on its device),
        ``extra`` (``extra_width`` float64 values, e.g. the fingerprints of
        ``trainer_agent/measure/fingerprint.py``; NaN when None), then ``sketch`` (``SKETCH_K`` int64;
        None: empty)."""
        if fields.shape != (len(RANK_FIELDS),):
            raise ValueError(f"a rank row has {len(RANK_FIELDS)} fields, got shape {tuple(fields.shape)}")
        fields = fields.to(torch.float64)
        if self.extra_width:
            if extra is None:
                extra = torch.full((self.extra_width,), math.nan, dtype=torch.float64, device=fields.device)
            if extra.shape != (self.extra_width,):
                raise ValueError(f"a rank row's extra part has {self.extra_width} values, got {tuple(extra.shape)}")
            fields = torch.cat([fields, extra.to(fields.device, torch.float64)])
        if not self.with_state:
            return fields
        bits = torch.tensor(list(state) if state is not None else [0] * STATE_LEN, dtype=torch.int64)
        sketch_bits = torch.tensor(list(sketch) if sketch is not None and len(sketch) == SKETCH_K else _EMPTY_SKETCH,
                                   dtype=torch.int64)
        # non_blocking: a copy from pageable memory is staged at once; no wait on the device
        return torch.cat([bits.view(torch.float64).to(fields.device, non_blocking=True), fields,
                          sketch_bits.view(torch.float64).to(fields.device, non_blocking=True)])

    def nan_row(self, device: torch.device, state: Sequence[int] | None) -> torch.Tensor:
        """The row of a rank whose report failed: NaN fields, a valid state part, no sketch."""
        return self.pack(torch.full((len(RANK_FIELDS),), math.nan, dtype=torch.float64, device=device), state)

    def gather(self, row: torch.Tensor) -> torch.Tensor:
        """Every rank's row, shape (world_size, width), on the collective's device. One
        ``all_gather_single``; with one rank, the row itself."""
        if self.world_size == 1:
            return row.reshape(1, -1)
        backend = dist.get_backend(self.group)
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        # For gloo with CUDA parameters this .to() is a device-to-host copy: a SYNC, once per report.
        src = row.to(device)
        out = torch.empty(self.world_size * src.numel(), dtype=src.dtype, device=device)
        all_gather_single(out, src, group=self.group)
        return out.view(self.world_size, src.numel())

    def fields(self, gathered: torch.Tensor) -> torch.Tensor:
        """The ``RANK_FIELDS`` columns of the gathered rows (a view, same device)."""
        return gathered[:, self.offset:self.offset + len(RANK_FIELDS)]

    def extra(self, gathered: torch.Tensor) -> torch.Tensor:
        """The extra part of the gathered rows (a view, shape (world_size, extra_width))."""
        return gathered[:, self.offset + len(RANK_FIELDS):self.sketch_at]

    def sketches(self, gathered: torch.Tensor) -> torch.Tensor | None:
        """The sketch part of the gathered rows (a view, (world_size, SKETCH_K) int64 bits as
        float64; None without one)."""
        return gathered[:, self.sketch_at:] if self.with_state else None

    def state(self, gathered: torch.Tensor) -> list[int] | None:
        """The leader's desired-state part as host ints (None without one): ``STATE_LEN`` values,
        whatever the world size. On CUDA rows (NCCL) this reads the device: a SYNC, once per
        report step of a controlled multi-rank run."""
        return self.head(gathered)[0]

    def head(self, gathered: torch.Tensor, flag: torch.Tensor | bool | None = None) -> tuple[list[int] | None, bool]:
        """:meth:`state`, and ``flag`` (a host bool, or a 0-dim tensor on the rows' device, e.g.
        computed from them) as a host bool (False without one), in one read: on CUDA rows one
        SYNC for both."""
        if flag is None or isinstance(flag, bool):
            if not self.with_state:
                return None, bool(flag)
            return gathered[0, :STATE_LEN].cpu().contiguous().view(torch.int64).tolist(), bool(flag)
        if not self.with_state:
            return None, bool(flag)  # SYNC on CUDA rows
        both = torch.cat([gathered[0, :STATE_LEN], flag.to(gathered.dtype).view(1)]).cpu()
        return both[:STATE_LEN].contiguous().view(torch.int64).tolist(), bool(both[STATE_LEN])

    @staticmethod
    def data_overlap(sketch_bits: np.ndarray) -> list[float] | None:
        """Each rank's largest estimated overlap with another rank's data, from the host copy of
        :meth:`sketches` (float64 or int64 bits, (world_size, SKETCH_K)); None when no rank
        observed data. O(W k log(W k)) (``sketch.overlaps``): the leader's, off the training thread."""
        bits = np.ascontiguousarray(sketch_bits).view(np.int64).reshape(len(sketch_bits), SKETCH_K)
        best, _ = overlaps(bits, SKETCH_K)
        return None if np.isnan(best).all() else best.tolist()

    def agreed(self, leader_state: list[int] | None, proposal: Sequence[int] | None) -> list[int] | None:
        """The state every rank applies: the leader's part of the rows (``leader_state``, read by
        :meth:`head`), or, without a state part (one rank, or no controller), this rank's own
        ``proposal``."""
        if self.with_state:
            return leader_state
        return list(proposal) if proposal is not None else None

    @staticmethod
    def unpack_rows(flat: Sequence[float] | np.ndarray, ranks: int, absent: Sequence[str] = ()) -> dict[str, list[float]]:
        """``{field: [rank 0, rank 1, ...]}`` from the host copy of ``fields(gathered)`` (rank-major);
        the fields in ``absent`` (:func:`absent_vectors`) empty."""
        rows = np.asarray(flat, dtype=np.float64).reshape(ranks, len(RANK_FIELDS))
        # a column at a time: each tolist holds the GIL for one column only (the leader's worker
        # thread runs this beside the training thread)
        return {f: [] if f in absent else rows[:, i].tolist() for i, f in enumerate(RANK_FIELDS)}
