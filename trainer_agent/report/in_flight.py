"""A report on its way from the device to the host (``trainer_agent/report/pipeline.py`` builds it): every
device value of the report in one float64 vector with the gathered rows, copied with a
non-blocking copy into pinned memory on CUDA (read once the copy's event has completed) or used as
it is on the CPU; :meth:`InFlight.read` turns it into the report's host values and per-rank vectors
(a :class:`RankVectors` on the leader of several ranks, resolved later, off the training thread;
the vectors of a loss or gradient norm the report lacks empty, ``exchange.absent_vectors``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from trainer_agent.report.cross_rank import Decode, RankVectors
from trainer_agent.report.exchange import RANK_FIELDS, RankExchange, absent_vectors
from trainer_agent.report.host_derived import HostDerived

__all__ = ["InFlight", "pack"]


class InFlight:
    """One report on its way from the device to the host. ``ranks``: the rows in the buffer
    (every rank's on the leader, this rank's own elsewhere); ``sketch_len``: the leader's sketch
    part after them (0 without one); ``desync_len``: the fingerprint comparison before them.
    ``rows`` / ``sketches``: the same parts as host tensors kept apart (rows the collective left
    on the host: not copied into the buffer); ``compare``: makes the fingerprint comparison later
    (instead of ``desync_len`` values in the buffer); ``derived``: the host-derived values'
    inputs, right after the keyed values (``trainer_agent/report/host_derived.py``)."""

    __slots__ = ("step", "keys", "buffer", "event", "host", "ranks", "desync_len", "decode", "sketch_len", "leader",
                 "rows", "sketches", "compare", "derived")

    def __init__(self, step: int, keys: list[str], buffer: torch.Tensor, event: Any,
                 host: dict[str, float], ranks: int, desync_len: int = 0, decode: Decode | None = None,
                 sketch_len: int = 0, leader: bool = True, rows: torch.Tensor | None = None,
                 sketches: torch.Tensor | None = None, compare: Callable[[], torch.Tensor] | None = None,
                 derived: HostDerived | None = None) -> None:
        self.step, self.keys, self.buffer, self.event, self.host, self.ranks = step, keys, buffer, event, host, ranks
        self.derived = derived
        self.compare = compare
        self.desync_len, self.decode, self.sketch_len, self.leader = desync_len, decode, sketch_len, leader
        self.rows, self.sketches = rows, sketches

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def read(self) -> tuple[dict[str, float], dict[str, list[float]] | RankVectors]:
        """(values, rank values) on the host: O(values) here; on the leader of several ranks the
        rank values are a :class:`RankVectors` (views of the buffer, resolved later)."""
        if self.event is not None:
            self.event.synchronize()  # SYNC: waits for the report's copy only (no-op when done)
        n = len(self.keys)
        d = n + (self.derived.length if self.derived is not None else 0)
        at = d + self.desync_len
        flat = self.buffer.numpy()  # a view (pinned buffer or CPU tensor): no device read
        values = dict(zip(self.keys, flat[:n].tolist()))
        if not self.leader or (self.ranks == 1 and self.decode is None and not self.sketch_len):
            # one rank's values (this rank's own); lists of one
            own = self.rows.numpy()[:1] if self.rows is not None else flat[at:at + len(RANK_FIELDS)].reshape(1, -1)
            self._derive(values, flat[n:d], own)
            return values, RankExchange.unpack_rows(own[:1], 1, absent_vectors(values))
        if self.rows is not None:
            rows = self.rows.numpy()
            sketches = self.sketches.numpy() if self.sketches is not None else None
        else:
            rows = flat[at:at + self.ranks * len(RANK_FIELDS)].reshape(self.ranks, len(RANK_FIELDS))
            sketches = flat[flat.size - self.sketch_len:].reshape(self.ranks, -1) if self.sketch_len else None
        self._derive(values, flat[n:d], rows)
        return values, RankVectors(rows, sketches=sketches, decode=self.decode, compare=self.compare,
                                   compared=flat[d:at] if self.decode is not None and self.compare is None else None,
                                   absent=absent_vectors(values))

    def _derive(self, values: dict[str, float], flat: np.ndarray, rows: np.ndarray) -> None:
        if self.derived is not None:
            self.derived.apply(values, flat, rows)
        values.update(self.host)


def pack(step: int, dev: dict[str, torch.Tensor], rows: torch.Tensor, host: dict[str, float], *, leader: bool,
         device: torch.device, decode: Decode | None = None, compared: torch.Tensor | None = None,
         sketches: torch.Tensor | None = None, compare: Callable[[], torch.Tensor] | None = None,
         derived: HostDerived | None = None) -> InFlight:
    """The report of ``step`` on its way to the host: its device values ``dev`` (and ``derived``'s)
    in one float64 vector with ``rows`` (every rank's on the leader, this rank's own elsewhere) and
    ``sketches``, copied without a wait (CUDA: into pinned memory, with an event); rows the
    collective left on the host (gloo) are kept, not copied. ``compared``: the fingerprint
    comparison, copied with the report; ``compare``: the same made later, off the training thread
    (host rows); ``decode``: what turns either into per-rank vectors and findings
    (``trainer_agent/report/fingerprint_rounds.py``). ``derived``: its scalars join the keyed
    values' one ``stack``, its vectors follow them (``torch.cat`` promotes them to float64: no
    operator of their own)."""
    scalars = {**dev, **(derived.scalars if derived is not None else {})}
    keys = list(scalars)
    pieces = [torch.stack([v if v.dim() == 0 and v.dtype == torch.float64 else v.reshape(()).to(torch.float64)
                           for v in scalars.values()])]
    if derived is not None:
        pieces += derived.vectors
    desync_len = 0
    if compared is not None:
        pieces.append(compared)
        desync_len = compared.numel()
    if leader and rows.device.type == "cpu":  # rows the collective left on the host (gloo): kept, not copied
        rows_kept, sketches_kept = rows, sketches
    else:
        rows_kept = sketches_kept = None
        pieces.append(rows.to(device).reshape(-1))
        if sketches is not None:  # int64 bits as float64: cat copies bits
            pieces.append(sketches.to(device).reshape(-1))
    vec = torch.cat(pieces)
    event = None
    if vec.device.type == "cuda":
        buffer = torch.empty(vec.shape, dtype=vec.dtype, pin_memory=True)
        buffer.copy_(vec, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        vec = buffer
    return InFlight(step, keys, vec, event, host, rows.shape[0], desync_len=desync_len, decode=decode,
                    sketch_len=sketches.numel() if sketches is not None else 0, leader=leader,
                    rows=rows_kept, sketches=sketches_kept, compare=compare, derived=derived)
