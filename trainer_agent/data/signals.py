"""The numeric kernels of the data monitor: sequence hashing and MinHash, batch flattening,
the two-sample Kolmogorov-Smirnov test (numpy only)."""

from __future__ import annotations

import math
import sys
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
import torch


# Hashing (numpy uint64 arithmetic wraps modulo 2**64 on arrays, which is what we want).

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_U32_MASK = np.uint64(0xFFFFFFFF)
_SENTINEL = np.uint64(1 << 32)  # larger than any 32-bit MinHash value: "empty bin"


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, element-wise on a uint64 array (returns a new array)."""
    z = x ^ (x >> np.uint64(30))
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z


def _keys(salt: int, start: int, stop: int) -> np.ndarray:
    """Deterministic pseudo-random 64-bit keys number ``start..stop-1`` of stream ``salt``."""
    offset = np.uint64((salt * _GOLDEN) & _MASK64)
    return _mix64(np.arange(start, stop, dtype=np.uint64) + offset)


_SALT_TOKEN, _SALT_POSITION, _SALT_SHINGLE, _SALT_BAND, _SALT_FILL, _SALT_LENGTH = range(1, 7)
_MINHASH_MULT = np.uint64(0xD6E8FEB86659FD93)


class _Hasher:
    """Per-token keys, position keys (grown on demand) and the sequence / MinHash computations."""

    __slots__ = ("vocab_size", "token_keys", "position_keys", "shingle", "bands", "rows",
                 "shingle_keys", "band_keys", "length_key")

    def __init__(self, vocab_size: int | None, shingle: int, bands: int, rows: int) -> None:
        self.vocab_size = vocab_size
        # A table for a token vocabulary; raw text (code points) hashes on the fly instead.
        self.token_keys = _keys(_SALT_TOKEN, 0, vocab_size) if vocab_size is not None else None
        self.position_keys = _keys(_SALT_POSITION, 0, 4096) | np.uint64(1)
        self.shingle, self.bands, self.rows = shingle, bands, rows
        self.shingle_keys = _keys(_SALT_SHINGLE, 0, shingle) | np.uint64(1)
        self.band_keys = (_keys(_SALT_BAND, 0, bands * rows) | np.uint64(1)).reshape(bands, rows)
        self.length_key = np.uint64((_SALT_LENGTH * _GOLDEN) & _MASK64 | 1)

    def token_hashes(self, flat: np.ndarray) -> np.ndarray:
        if self.token_keys is not None:
            return self.token_keys[flat]
        return _mix64(flat.astype(np.uint64) + np.uint64(_GOLDEN))

    def positions(self, n: int) -> np.ndarray:
        if n > self.position_keys.size:
            size = 1 << (n - 1).bit_length()
            grown = _keys(_SALT_POSITION, self.position_keys.size, size) | np.uint64(1)
            self.position_keys = np.concatenate([self.position_keys, grown])
        return self.position_keys

    def digest(self, batch: _Batch, near: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """(exact hash per sequence [B], LSH band keys per sequence [B, bands] or None)."""
        flat, lengths, starts = batch.flat, batch.lengths, batch.starts
        n, nseq = flat.size, lengths.size
        hv = self.token_hashes(flat)
        seq_of_token = np.repeat(np.arange(nseq), lengths)
        pos = np.arange(n) - starts[seq_of_token]
        contrib = hv * self.positions(int(lengths.max()))[pos]
        sums = np.zeros(nseq, dtype=np.uint64)
        nonempty = lengths > 0
        sums[nonempty] = np.add.reduceat(contrib, starts[nonempty])
        exact = _mix64(sums ^ (lengths.astype(np.uint64) * self.length_key))
        if not near:
            return exact, None
        k, w = self.bands * self.rows, self.shingle
        sig = np.full(nseq * k, _SENTINEL, dtype=np.uint64)
        if n >= w:
            m = n - w + 1
            sh = hv[:m] * self.shingle_keys[0]
            for j in range(1, w):
                sh += hv[j:j + m] * self.shingle_keys[j]
            sh *= _MINHASH_MULT
            sh ^= sh >> np.uint64(29)
            bins = ((sh >> np.uint64(32)) * np.uint64(k)) >> np.uint64(32)
            vals = sh & _U32_MASK
            # A shingle is valid when its w tokens lie in one sequence: positions are consecutive.
            valid = (pos[w - 1:] - pos[:m]) == (w - 1)
            vals[~valid] = _SENTINEL
            np.minimum.at(sig, (seq_of_token[:m] * k + bins.astype(np.intp)), vals)
        sig = sig.reshape(nseq, k)
        # Empty bins (sequences shorter than a few shingles) take a value private to the exact
        # content, so two different short sequences never match on empty bins.
        empty = sig == _SENTINEL
        if empty.any():
            fill = _mix64(exact[:, None] + _keys(_SALT_FILL, 0, k)[None, :])
            sig[empty] = fill[empty]
        bands = (sig.reshape(nseq, self.bands, self.rows) * self.band_keys).sum(axis=2, dtype=np.uint64)
        return exact, _mix64(bands + np.arange(self.bands, dtype=np.uint64))


# ---------------------------------------------------------------------------------------------
# Input normalisation.


@dataclass(slots=True)
class _Batch:
    flat: np.ndarray
    """Non-padding ids of all sequences, concatenated in sequence order."""
    lengths: np.ndarray
    """int64 [B]: non-padding tokens per sequence."""
    starts: np.ndarray
    """int64 [B]: offset of each sequence in ``flat``."""


def _as_numpy(x: Any, what: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        if x.dtype.is_floating_point or x.dtype.is_complex:
            raise ValueError(f"{what} must hold integers, got a {x.dtype} tensor")
        if x.is_meta or x.layout != torch.strided:
            raise ValueError(f"{what} must be a dense tensor with data, got a {x.layout} tensor on {x.device}")
        # Host-device sync point when x is on an accelerator: the standalone monitor reads the
        # batch now. Inside a training loop, hand the batch to DataFeed instead (no sync).
        return x.detach().cpu().numpy()
    if isinstance(x, Mapping):  # a whole batch: {"input_ids": ..., "attention_mask": ...}
        raise ValueError(f"{what} must be a tensor or array, got a {type(x).__name__}; pass its "
                         f"'input_ids' and 'attention_mask'")
    try:
        arr = np.asarray(x)
    except ValueError:  # ragged rows
        arr = np.empty(0, dtype=object)
    if arr.dtype == object:
        raise ValueError(f"{what} must be a rectangular integer array (rows of one length)")
    return arr


_NO_TOKENS = _Batch(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))


def _flatten(input_ids: Any, attention_mask: Any, pad_id: int | None, vocab_size: int | None,
             *, allow_empty: bool = False) -> _Batch:
    """The batch's non-padding tokens; a batch without any is a ``ValueError`` (with
    ``allow_empty``: a batch of no sequence)."""
    ids = _as_numpy(input_ids, "input_ids")
    if ids.dtype == np.bool_ or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"input_ids must hold integers, got dtype {ids.dtype}")
    if ids.ndim == 1:
        ids = ids[None, :]
    elif ids.ndim != 2:
        raise ValueError(f"input_ids must be 1-D (one sequence) or 2-D (batch), got shape {ids.shape}")
    if ids.size == 0:
        if allow_empty:
            return _NO_TOKENS
        raise ValueError(f"empty batch: input_ids has shape {ids.shape}")
    mask = _token_mask(ids, attention_mask, pad_id)
    nseq, width = ids.shape
    if mask is None:
        flat = ids.reshape(-1)
        lengths = np.full(nseq, width, dtype=np.int64)
    else:
        flat = ids[mask]
        lengths = np.count_nonzero(mask, axis=1).astype(np.int64)
        # A row that is all padding (a quarantined sample, a batch padded to its size) holds no
        # sequence: it is left out, not counted as an empty sequence duplicating the others.
        lengths = lengths[lengths > 0]
    if flat.size == 0:
        if allow_empty:
            return _NO_TOKENS
        raise ValueError("batch holds no non-padding tokens")
    if vocab_size is not None:
        lo, hi = int(flat.min()), int(flat.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"token id {bad} outside the vocabulary [0, {vocab_size})")
        if flat.dtype != np.int64:
            flat = flat.astype(np.int64)
    starts = np.zeros(lengths.size, dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return _Batch(flat, lengths, starts)


def _token_mask(ids: np.ndarray, attention_mask: Any, pad_id: int | None) -> np.ndarray | None:
    """True on the tokens of ``ids`` [B, L], from the attention mask or else ``pad_id``; None: all."""
    if attention_mask is None:
        return None if pad_id is None else ids != pad_id
    m = _as_numpy(attention_mask, "attention_mask")
    if m.dtype != np.bool_ and not np.issubdtype(m.dtype, np.integer):
        raise ValueError(f"attention_mask must be bool or integer (1 = token, 0 = padding), got {m.dtype}")
    if m.ndim == 1:
        m = m[None, :]
    if m.shape != ids.shape:
        raise ValueError(f"attention_mask shape {m.shape} differs from input_ids shape {ids.shape}")
    return m if m.dtype == np.bool_ else m != 0


# Ordinary whitespace is not counted as a control character in raw text.
_TEXT_WHITESPACE = frozenset("\t\n\r")


@cache
def _control_table() -> np.ndarray:
    """Boolean table over all code points: True for Unicode categories Cc and Cf, except \\t \\n \\r."""
    table = np.zeros(sys.maxunicode + 1, dtype=np.bool_)
    for cp in range(sys.maxunicode + 1):
        if unicodedata.category(chr(cp)) in ("Cc", "Cf"):
            table[cp] = True
    for ch in _TEXT_WHITESPACE:
        table[ord(ch)] = False
    return table


def _text_batch(texts: Iterable[str]) -> tuple[_Batch, np.ndarray]:
    """Code points of the texts as a flat batch, and control/format characters per text."""
    if isinstance(texts, str):
        texts = [texts]
    arrays = []
    for t in texts:
        if not isinstance(t, str):
            raise ValueError(f"observe_text takes strings, got {type(t).__name__}")
        arrays.append(np.frombuffer(t.encode("utf-32-le", "surrogatepass"), dtype=np.uint32))
    if not arrays:
        raise ValueError("empty batch: no texts")
    lengths = np.array([a.size for a in arrays], dtype=np.int64)
    flat = np.concatenate(arrays).astype(np.int64)
    if flat.size == 0:
        raise ValueError("batch holds no characters")
    starts = np.zeros(lengths.size, dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    controls = _control_table()[flat]
    per_text = np.zeros(lengths.size, dtype=np.int64)
    nonempty = lengths > 0
    per_text[nonempty] = np.add.reduceat(controls.astype(np.int64), starts[nonempty])
    return _Batch(flat, lengths, starts), per_text


# ---------------------------------------------------------------------------------------------
# Kolmogorov-Smirnov.


def _kolmogorov_sf(lam: float) -> float:
    """P(K > lam) for the Kolmogorov distribution (two series, each fast where the other is slow)."""
    if lam <= 0.0:
        return 1.0
    if lam < 1.18:
        y = math.exp(-(math.pi ** 2) / (8.0 * lam * lam))
        cdf = math.sqrt(2.0 * math.pi) / lam * sum(y ** ((2 * k - 1) ** 2) for k in range(1, 6))
        return min(1.0, max(0.0, 1.0 - cdf))
    total = sum((-1) ** (k - 1) * math.exp(-2.0 * k * k * lam * lam) for k in range(1, 101))
    return min(1.0, max(0.0, 2.0 * total))


def _ks_exact_pvalue(n1: int, n2: int, d_int: int) -> float:
    """P(D >= d) under H0 by counting the monotone lattice paths from (0,0) to (n1,n2) that stay
    strictly inside |i*n2 - j*n1| < d_int (Hodges 1958). Rows are rescaled to stay in float range."""
    row = np.zeros(n2 + 1)
    j = np.arange(n2 + 1)
    inside0 = np.abs(j * n1) < d_int
    row[inside0 & (np.cumsum(~inside0) == 0)] = 1.0  # row 0: reachable until the first exit
    log_scale = 0.0
    for i in range(1, n1 + 1):
        inside = np.abs(i * n2 - j * n1) < d_int
        lo, hi = int(np.argmax(inside)), n2 + 1 - int(np.argmax(inside[::-1]))
        new = np.zeros(n2 + 1)
        if inside.any():
            new[lo:hi] = np.cumsum(row[lo:hi])
        peak = new.max()
        if peak == 0.0:
            return 1.0
        row = new / peak
        log_scale += math.log(peak)
    if row[n2] == 0.0:
        return 1.0
    log_total = math.lgamma(n1 + n2 + 1) - math.lgamma(n1 + 1) - math.lgamma(n2 + 1)
    return min(1.0, max(0.0, 1.0 - math.exp(math.log(row[n2]) + log_scale - log_total)))


#: Above this n1 * n2 the p-value comes from the asymptotic distribution.
KS_EXACT_MAX_PRODUCT = 1_000_000


def ks_2samp(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Two-sided two-sample Kolmogorov-Smirnov test: (statistic D, p-value).

    D = max over all observed values v of |F_x(v) - F_y(v)| with right-continuous empirical CDFs,
    which is correct with ties (integer lengths tie a lot). The p-value is exact (path counting,
    the null distribution for continuous data, like scipy's ``method="exact"``) when
    ``len(x) * len(y) <= KS_EXACT_MAX_PRODUCT``, else the Kolmogorov limit with Stephens'
    correction ``lam = (sqrt(en) + 0.12 + 0.11 / sqrt(en)) * D``, ``en = n1 n2 / (n1 + n2)``, which is
    within 0.005 of scipy's p-value there. With ties both are conservative (p too large), as scipy's.
    """
    x, y = np.sort(np.asarray(x)), np.sort(np.asarray(y))
    n1, n2 = x.size, y.size
    if n1 == 0 or n2 == 0:
        raise ValueError("ks_2samp needs two non-empty samples")
    both = np.concatenate([x, y])
    c1 = np.searchsorted(x, both, side="right").astype(np.int64)
    c2 = np.searchsorted(y, both, side="right").astype(np.int64)
    d_int = int(np.max(np.abs(c1 * n2 - c2 * n1)))  # D * n1 * n2, exactly
    d = d_int / (n1 * n2)
    if d_int == 0:
        return 0.0, 1.0
    if n1 * n2 <= KS_EXACT_MAX_PRODUCT:
        return d, _ks_exact_pvalue(n1, n2, d_int)
    en = math.sqrt(n1 * n2 / (n1 + n2))
    return d, _kolmogorov_sf((en + 0.12 + 0.11 / en) * d)


