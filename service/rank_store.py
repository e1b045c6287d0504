"""A stored report's per-rank vectors, compact: what the rules read of older reports, per vector,
in a few hundred bytes whatever the world size.

Reports were stored with every vector at full width (float64 rows: 394 KB per report at 4,096
ranks, ~3.4 GB a day per run at one report every 10 s). The rules read full vectors only of the
newest report, which the controller holds in memory (:class:`service.window.RunWindow`); of older
reports (``cross_rank``'s ``for_reports``, reloaded at start-up) each check needs a few order
statistics of each row. Since schema version 12 (``reports.ranks_format`` = 1) a vector is stored
as one record:

* the background value: the median of its finite values, as the rules compute it (NaN when none
  is finite);
* every non-finite rank exactly (its rank and whether NaN, +Inf or -Inf; as a 2-bit map past
  :data:`LISTED_NONFINITE` of them), except NaN where the background is NaN;
* the finite ranks that differ from the background: all of them when at most :data:`EXACT_FINITE`
  do (the record is then exact: a constant vector, a few stragglers), else the :data:`TOP` largest
  above it and the :data:`TOP` smallest below it (ties: lowest rank first), with their values;
* the count of finite values and their 5th, 25th, 75th and 95th percentiles (for people).

Decoded (:func:`decode`), a record gives back a vector with the background at the ranks not
listed. It has the same finite median, minimum, maximum, largest rank (``argmax``), non-finite
ranks, and (exact records) every value: every verdict of ``cross_rank`` (``spread``, ``mismatch``,
``above``), ``nonfinite`` and ``desync`` on it is that on the original row (the middle of the sorted
values lies among the background copies, of which at least ``2 * TOP + 2`` remain;
``tests/service/test_service_rank_store.py`` checks the verdicts on random rows). ``spread`` judges a
rank against the median of the other ranks, which a lossy record gives as the background (in the
original it lies within the two middle values next to the median: a verdict can differ only for a
rank that far from the limit). The details of a lossy record beyond those (how many ranks are above
a limit, the 17th slowest: a group of more than ``TOP`` slow ranks is read back as its ``TOP``
slowest) are not kept.

Worlds of up to :data:`EXACT_UP_TO_RANKS` ranks store every vector exactly (float32 when that holds
every value, else float64: a few KB). Each blob starts with the world size and a digest of the full
vectors, which tells a report sent again after a restart from a new one
(:func:`service.runstate.resent`).
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import numpy as np

__all__ = ["FORMAT_ROWS", "FORMAT_RECORDS", "TOP", "EXACT_FINITE", "EXACT_UP_TO_RANKS", "LISTED_NONFINITE",
           "StoredRanks", "encode", "decode", "ranks_digest"]

#: ``reports.ranks_format``: the float64 rows of the present vectors, in bit order (before schema 12).
FORMAT_ROWS = 0
#: One record per present vector, in bit order (this module).
FORMAT_RECORDS = 1
#: Largest and smallest finite values kept of a lossy record, each side of the median.
TOP = 16
#: A record lists every finite rank that differs from the background when at most this many do.
EXACT_FINITE = 4 * TOP + 2
#: Non-finite ranks listed one by one; more are kept as a 2-bit map of every rank.
LISTED_NONFINITE = 64
#: Worlds up to this many ranks store every vector at full width, exactly.
EXACT_UP_TO_RANKS = 256

_KIND_F8, _KIND_F4, _KIND_RECORD = 0, 1, 2
_HEAD = struct.Struct("<I16s")  # world size, digest
_RECORD = struct.Struct("<dI4dHHB")  # background, finite count, p5 p25 p75 p95, above, below, flags
_NONFINITE_MAP, _EXACT = 1, 2  # flags: the non-finite ranks as a 2-bit map (else listed); every value kept
_CLASS = np.array([0.0, np.nan, np.inf, -np.inf])  # 2-bit classes: finite, NaN, +Inf, -Inf
_U64 = np.dtype("<u8")
_NO_NONFINITE = struct.pack("<H", 0)  # a record's count of listed non-finite ranks, none


class StoredRanks(dict[str, np.ndarray]):
    """A stored report's vectors (as :func:`decode` rebuilt them), with ``digest``, that of the full
    vectors as received, and ``exact``, the names of the vectors rebuilt exactly."""

    digest: bytes = b""
    exact: frozenset[str] = frozenset()
    percentiles: dict[str, tuple[int, float, float, float, float]]


def ranks_digest(ranks: dict[str, np.ndarray]) -> bytes:
    """16 bytes that differ, but for a collision, between two reports' per-rank vectors (every NaN
    the same; the names in the order given, which is the layout's)."""
    h = hashlib.blake2b(digest_size=16)
    for name, vec in ranks.items():
        v = np.ascontiguousarray(vec, dtype="<f8")
        nan = np.isnan(v)
        if nan.any():
            v = np.where(nan, np.nan, v)
        h.update(name.encode() + b"\0" + struct.pack("<I", len(v)))
        h.update(v.tobytes())
    return h.digest()


def _order_stats(finite: np.ndarray) -> tuple[float, tuple[float, float, float, float]]:
    """The median, as ``service.numerics.median`` (the rules' median) has it, and the 5th, 25th,
    75th and 95th percentiles (linear interpolation) of ``finite``, from one partition."""
    n = len(finite)
    mid = (n // 2,) if n % 2 else (n // 2 - 1, n // 2)
    pos = [q * (n - 1) for q in (0.05, 0.25, 0.75, 0.95)]
    around = [(int(p), min(int(p) + 1, n - 1), p - int(p)) for p in pos]
    s = np.partition(finite, sorted({*mid, *(k for lo, hi, _ in around for k in (lo, hi))}))
    median = float(s[mid[0]]) if n % 2 else 0.5 * (float(s[mid[0]]) + float(s[mid[1]]))
    pct = tuple(float(s[lo]) + (float(s[hi]) - float(s[lo])) * t if t else float(s[lo]) for lo, hi, t in around)
    return median, pct  # type: ignore[return-value]


def _side(x: np.ndarray, idx: np.ndarray, largest: bool) -> np.ndarray:
    """The ``TOP`` ranks of ``idx`` (ascending) with the largest (smallest) values, ties lowest
    rank first, in that order."""
    if len(idx) > TOP:
        key = x[idx] if largest else -x[idx]
        cut = np.partition(key, len(key) - TOP)[len(key) - TOP]  # the TOP-th largest key
        over = idx[key > cut]
        idx = np.concatenate([over, idx[key == cut][:TOP - len(over)]])
    key = x[idx] if largest else -x[idx]
    return idx[np.lexsort((idx, -key))]


def _record(x: np.ndarray) -> bytes | None:
    """The record of ``x``; ``None`` where its guarantee cannot hold (a median beyond 1e300)."""
    u = x.view(_U64)
    finite = np.isfinite(x)
    if (u == u[0]).all():  # every rank the same, bit for bit (fingerprints in sync, no check): no order to find
        nf = len(x) if finite[0] else 0
        background = float(x[0]) if nf else float("nan")
        p5 = p25 = p75 = p95 = background
    else:
        xf = x if finite.all() else x[finite]
        nf = len(xf)
        if nf:
            background, (p5, p25, p75, p95) = _order_stats(xf)
        else:
            background = p5 = p25 = p75 = p95 = float("nan")
    if nf and not abs(background) < 1e300:
        return None  # (0.5 * (m + m) would overflow in the rules' median)
    bits = np.float64(background).view(_U64)
    differ = np.flatnonzero(finite & (u != bits))
    exact = len(differ) <= EXACT_FINITE
    if exact:
        above, below = differ, np.empty(0, dtype=np.intp)
    else:
        dv = x[differ]
        above = _side(x, differ[dv > background], True)
        below = _side(x, differ[dv < background], False)
    nonfinite = ~finite
    if nf == 0 or np.isnan(background):
        nonfinite &= ~np.isnan(x)  # NaN is the background
    bad = np.flatnonzero(nonfinite)
    cls = np.where(np.isnan(x[bad]), 1, np.where(x[bad] > 0, 2, 3)).astype(np.uint8)
    flags = (_NONFINITE_MAP if len(bad) > LISTED_NONFINITE else 0) | (_EXACT if exact else 0)
    out = [_RECORD.pack(background, nf, p5, p25, p75, p95, len(above), len(below), flags),
           above.astype("<u4").tobytes(), x[above].astype("<f8").tobytes(),
           below.astype("<u4").tobytes(), x[below].astype("<f8").tobytes()]
    if not flags & _NONFINITE_MAP:
        out += [struct.pack("<H", len(bad)), bad.astype("<u4").tobytes(), cls.tobytes()]
    else:
        codes = np.zeros(-(-len(x) // 4) * 4, dtype=np.uint8)
        codes[bad] = cls
        packed = codes[0::4] | codes[1::4] << 2 | codes[2::4] << 4 | codes[3::4] << 6
        out.append(packed.astype(np.uint8).tobytes())
    return b"".join(out)


def _exact(x: np.ndarray) -> bytes:
    with np.errstate(over="ignore"):  # a value beyond float32's range: stored as float64
        f = x.astype(np.float32)
    if np.array_equal(f.astype(np.float64).view(_U64), x.view(_U64)):
        return bytes([_KIND_F4]) + f.astype("<f4").tobytes()
    return bytes([_KIND_F8]) + x.astype("<f8").tobytes()


def encode(ranks: dict[str, np.ndarray], vector_names: tuple[str, ...]) -> tuple[int, bytes | None]:
    """``ranks`` (every vector of one world size) as ``(ranks_mask, blob)`` of format
    :data:`FORMAT_RECORDS`: bit ``i`` of the mask is ``vector_names[i]``, the blob the world size,
    the digest and each present vector's record in bit order."""
    if not ranks:
        return 0, None
    present = [i for i, name in enumerate(vector_names) if name in ranks]
    world = len(ranks[vector_names[present[0]]])
    if world <= EXACT_UP_TO_RANKS:
        return sum(1 << i for i in present), _encode_small(ranks, [vector_names[i] for i in present], world)
    parts = [_HEAD.pack(world, ranks_digest({vector_names[i]: ranks[vector_names[i]] for i in present}))]
    for i in present:
        x = np.ascontiguousarray(ranks[vector_names[i]], dtype=np.float64)
        record = _record(x)
        parts.append(_exact(x) if record is None else bytes([_KIND_RECORD]) + record)
    return sum(1 << i for i in present), b"".join(parts)


def _encode_small(ranks: dict[str, np.ndarray], names: list[str], world: int) -> bytes:
    """A small world's blob: each vector exactly, as its full row (float32 when that holds every
    value) or, where shorter, as an exact record. The checks run on every vector at once (one
    array of ``len(names)`` rows); a record is built only for a row that could be shorter than its
    full form: one listing each finite value that differs from the background (12 bytes each)
    after a header, so a row with ``d`` distinct finite values lists at least ``d - 1``."""
    x = np.empty((len(names), world))
    for row, name in zip(x, names):
        row[:] = ranks[name]
    u = x.view(_U64)
    nan = np.isnan(x)
    canonical = np.where(nan, np.nan, x) if nan.any() else x  # the digest's: every NaN the same
    h = hashlib.blake2b(digest_size=16)
    size = struct.pack("<I", world)
    for name, row in zip(names, canonical):
        h.update(name.encode() + b"\0" + size)
        h.update(row.tobytes())
    with np.errstate(over="ignore"):  # a value beyond float32's range: stored as float64
        f = x.astype(np.float32)
    as_f4 = (f.astype(np.float64).view(_U64) == u).all(axis=1)
    s = np.sort(x, axis=1)  # -inf, the finite values ascending, +inf, NaN
    finite = np.isfinite(s)
    both = finite[:, 1:] & finite[:, :-1]
    distinct = np.count_nonzero(both & (s[:, 1:] != s[:, :-1]), axis=1) + finite.any(axis=1)
    constant = (u == u[:, :1]).all(axis=1) & finite[:, 0]
    parts = [_HEAD.pack(world, h.digest())]
    for k in range(len(names)):
        full = bytes([_KIND_F4]) + f[k].astype("<f4").tobytes() if as_f4[k] else bytes([_KIND_F8]) + x[k].astype("<f8").tobytes()
        listed = max(int(distinct[k]) - 1, 0)
        if listed > EXACT_FINITE or 1 + _RECORD.size + 12 * listed >= len(full):
            parts.append(full)  # a record could not be both exact and shorter
            continue
        if constant[k] and abs(x[k, 0]) < 1e300:  # one finite value at every rank, bit for bit
            c = float(x[k, 0])
            parts.append(bytes([_KIND_RECORD]) + _RECORD.pack(c, world, c, c, c, c, 0, 0, _EXACT) + _NO_NONFINITE)
            continue
        record = _record(np.ascontiguousarray(x[k]))
        if record is None or not record[_RECORD.size - 1] & _EXACT or len(record) + 1 >= len(full):
            parts.append(full)
        else:
            parts.append(bytes([_KIND_RECORD]) + record)
    return b"".join(parts)


def _read_record(buf: memoryview, at: int, world: int) -> tuple[np.ndarray, int, bool, tuple[int, float, float, float, float]]:
    """One record from ``buf[at:]``: (vector, offset after it, exact, (finite count, p5, p25, p75, p95))."""
    background, nf, p5, p25, p75, p95, n_above, n_below, flags = _RECORD.unpack_from(buf, at)
    at += _RECORD.size
    vec = np.full(world, background)
    for n in (n_above, n_below):
        ranks = np.frombuffer(buf, dtype="<u4", count=n, offset=at)
        vals = np.frombuffer(buf, dtype="<f8", count=n, offset=at + 4 * n)
        if n and int(ranks.max()) >= world:
            raise ValueError("a stored rank beyond the world size")
        vec[ranks] = vals
        at += 12 * n
    if not flags & _NONFINITE_MAP:
        (n,) = struct.unpack_from("<H", buf, at)
        ranks = np.frombuffer(buf, dtype="<u4", count=n, offset=at + 2)
        cls = np.frombuffer(buf, dtype=np.uint8, count=n, offset=at + 2 + 4 * n)
        if n and (int(ranks.max()) >= world or int(cls.max()) > 3):
            raise ValueError("a stored non-finite rank beyond the world size")
        vec[ranks] = _CLASS[cls]
        at += 2 + 5 * n
    else:
        size = -(-world // 4)
        packed = np.frombuffer(buf, dtype=np.uint8, count=size, offset=at)
        codes = np.empty(size * 4, dtype=np.uint8)
        for k in range(4):
            codes[k::4] = packed >> (2 * k) & 3
        codes = codes[:world]
        hit = codes != 0
        vec[hit] = _CLASS[codes[hit]]
        at += size
    return vec, at, bool(flags & _EXACT), (nf, p5, p25, p75, p95)


def decode(mask: int, blob: bytes | None, fmt: int, world_size: int, vector_names: tuple[str, ...]) -> StoredRanks:
    """A stored report's per-rank vectors. Bit ``i`` of the mask is ``vector_names[i]`` under every
    layout version (``trainguard.protocol.rank_values``); bits beyond ``vector_names`` (a newer
    controller's row) are vectors unknown here and skipped. A row of another world size (the run
    registered again since) or of a format unknown here gives no vectors."""
    out = StoredRanks()
    out.percentiles = {}
    if not mask or blob is None:
        return out
    bits = [i for i in range(mask.bit_length()) if mask >> i & 1]
    if fmt == FORMAT_ROWS:
        arr = np.frombuffer(blob, dtype=np.float64)
        if arr.size != len(bits) * world_size:
            return out  # recorded under another world size
        arr = arr.reshape(len(bits), world_size)
        out.update({vector_names[i]: arr[k].copy() for k, i in enumerate(bits) if i < len(vector_names)})
        out.exact = frozenset(out)  # (no digest: the vectors themselves tell a report sent again)
        return out
    if fmt != FORMAT_RECORDS:
        return out
    buf = memoryview(blob)
    world, digest = _HEAD.unpack_from(buf, 0)
    if world != world_size:
        return out
    at, exact = _HEAD.size, set()
    for i in bits:
        kind = buf[at]
        at += 1
        if kind == _KIND_RECORD:
            vec, at, whole, pct = _read_record(buf, at, world)
            if i < len(vector_names):
                out.percentiles[vector_names[i]] = pct
        else:
            dtype = "<f4" if kind == _KIND_F4 else "<f8"
            vec = np.frombuffer(buf, dtype=dtype, count=world, offset=at).astype(np.float64)
            at += world * np.dtype(dtype).itemsize
            whole = True
        if i < len(vector_names):
            out[vector_names[i]] = vec
            if whole:
                exact.add(vector_names[i])
    out.digest, out.exact = digest, frozenset(exact)
    return out

