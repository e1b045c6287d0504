"""Data-quality monitoring inside the training rank (seed section 3.1) and dynamic data cleaning
(seed section 3.2).

``DataMonitor`` watches a stream of token batches (or raw texts) and keeps, over a sliding window
of the last ``window`` sequences, the signals below. ``values()`` returns them as
``{metric name: float}``; a signal that has no value yet is absent, not zero.

========================================  ====================================================
metric                                    definition
========================================  ====================================================
``trainguard_data_duplicate_ratio``       (sequences in the window - distinct contents in the
                                          window) / sequences in the window: the share of
                                          window sequences whose exact content occurred earlier
                                          in the window. Seed threshold 0.05.
``trainguard_data_near_duplicate_ratio``  share of window sequences sharing at least one MinHash
                                          LSH band with an earlier window sequence.
``trainguard_data_token_kl_divergence``   KL(window || reference) of unigram distributions,
                                          nats (smoothing: see ``DataMonitorConfig.kl_epsilon``).
                                          Seed threshold 0.1.
``trainguard_data_special_token_ratio``   special ids / tokens in the window (raw text: control
                                          and format characters / characters). Seed 1e-4.
``trainguard_data_length_shift_pvalue``   two-sample Kolmogorov-Smirnov p-value, reference
                                          lengths vs window lengths. Seed threshold p < 0.05.
``trainguard_data_tokens_total``          non-padding tokens observed (token batches only).
``trainguard_data_sequences_total``       sequences (or texts) observed.
========================================  ====================================================

Design, and what it costs
-------------------------
* A batch is flattened once into its non-padding tokens (row-major, so sequence order is kept) plus
  per-sequence lengths; all signals are vectorised numpy over that flat array.
* Sequences are never stored for duplicate detection: each sequence is reduced to a 64-bit hash
  ``mix64(sum_i T[t_i] * Q[i] XOR length)`` (``T``: a random 64-bit key per token id, ``Q``: a random
  odd key per position, both derived deterministically from splitmix64), kept in a ring of
  ``window`` slots. Near-duplicates use one-permutation MinHash (64 bins) over 5-token shingles,
  grouped into 8 LSH bands of 8 rows; only the 8 band keys per sequence are kept. Memory of both:
  ``window * 9 * 8`` bytes.
* The token window (KL and special ids) needs exact eviction of the tokens of the sequences that
  leave the window, so the window's tokens are kept, compacted to uint16/uint32:
  ``window * mean length * 2`` bytes for vocabularies up to 65,536 ids (40 MB for 10,000
  sequences of 2,048 tokens). Counts are kept incrementally with ``np.bincount``.
* Per batch only O(tokens) work is done; the O(vocab) KL, the O(window log window) duplicate counts
  and the KS test run in ``values()``, cached until the next batch. ``values()`` costs a few
  milliseconds with the defaults (call it at the report interval, not every step).
* ``DataFeed`` moves all of it off the training step: see its docstring.

Exact duplicates and near-duplicates are measured on the content of the non-padding tokens, so the
same sequence padded left, right or not at all is the same content.
"""

from __future__ import annotations

import hashlib
import logging
import math
import numbers
import queue
import sys
import threading
import time
import unicodedata
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
import torch
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from trainguard.protocol.catalog import BASE_LABELS, DATA_METRICS, spec
from trainer_agent.sketch import SKETCH_K, BottomK

__all__ = [
    "DataMonitorConfig",
    "DataMonitor",
    "DataFeed",
    "DefaultQualityScore",
    "QualityFilter",
    "dynamic_threshold",
    "ks_2samp",
    "sample_identity",
]

_LOG = logging.getLogger(__name__)

DUPLICATE_RATIO = "trainguard_data_duplicate_ratio"
NEAR_DUPLICATE_RATIO = "trainguard_data_near_duplicate_ratio"
TOKEN_KL = "trainguard_data_token_kl_divergence"
SPECIAL_RATIO = "trainguard_data_special_token_ratio"
LENGTH_PVALUE = "trainguard_data_length_shift_pvalue"
TOKENS_TOTAL = "trainguard_data_tokens_total"
SEQUENCES_TOTAL = "trainguard_data_sequences_total"
FILTERED_TOTAL = "trainguard_data_filtered_total"
assert {m.name for m in DATA_METRICS} == {
    DUPLICATE_RATIO, NEAR_DUPLICATE_RATIO, TOKEN_KL, SPECIAL_RATIO, LENGTH_PVALUE,
    TOKENS_TOTAL, SEQUENCES_TOTAL, FILTERED_TOTAL,
}, "trainer_agent.data is out of step with the catalogue"

# ---------------------------------------------------------------------------------------------
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
        # Host-device sync point when x is on an accelerator: the standalone monitor reads the
        # batch now. Inside a training loop, hand the batch to DataFeed instead (no sync).
        return x.detach().cpu().numpy()
    arr = np.asarray(x)
    if arr.dtype == object:
        raise ValueError(f"{what} must be a rectangular integer array")
    return arr


def _flatten(input_ids: Any, attention_mask: Any, pad_id: int | None, vocab_size: int | None) -> _Batch:
    ids = _as_numpy(input_ids, "input_ids")
    if ids.dtype == np.bool_ or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"input_ids must hold integers, got dtype {ids.dtype}")
    if ids.ndim == 1:
        ids = ids[None, :]
    elif ids.ndim != 2:
        raise ValueError(f"input_ids must be 1-D (one sequence) or 2-D (batch), got shape {ids.shape}")
    if ids.size == 0:
        raise ValueError(f"empty batch: input_ids has shape {ids.shape}")
    mask = None
    if attention_mask is not None:
        m = _as_numpy(attention_mask, "attention_mask")
        if m.dtype != np.bool_ and not np.issubdtype(m.dtype, np.integer):
            raise ValueError(f"attention_mask must be bool or integer (1 = token, 0 = padding), got {m.dtype}")
        if m.ndim == 1:
            m = m[None, :]
        if m.shape != ids.shape:
            raise ValueError(f"attention_mask shape {m.shape} differs from input_ids shape {ids.shape}")
        mask = m if m.dtype == np.bool_ else m != 0
    elif pad_id is not None:
        mask = ids != pad_id
    nseq, width = ids.shape
    if mask is None:
        flat = ids.reshape(-1)
        lengths = np.full(nseq, width, dtype=np.int64)
    else:
        flat = ids[mask]
        lengths = np.count_nonzero(mask, axis=1).astype(np.int64)
    if flat.size == 0:
        raise ValueError("batch holds no non-padding tokens")
    if vocab_size is not None:
        lo, hi = int(flat.min()), int(flat.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"token id {bad} outside the vocabulary [0, {vocab_size})")
        if flat.dtype != np.int64:
            flat = flat.astype(np.int64)
    starts = np.zeros(nseq, dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return _Batch(flat, lengths, starts)


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


# ---------------------------------------------------------------------------------------------
# The monitor.


@dataclass(kw_only=True, slots=True)
class DataMonitorConfig:
    """Configuration of a ``DataMonitor`` (validated when built)."""

    vocab_size: int
    """Number of token ids; ids must lie in [0, vocab_size)."""
    special_ids: tuple[int, ...] = ()
    """Ids counted by the special-token ratio (control, special, unknown tokens). Empty: the
    ratio is absent for token batches."""
    window: int = 10_000
    """Sliding window, in sequences, of every windowed signal."""
    reference_tokens: int = 1_000_000
    """Without an explicit reference, the unigram reference is frozen from the first this many
    non-padding tokens observed; the KL divergence is absent until then."""
    kl_epsilon: float = 1e-6
    """Additive smoothing of the KL divergence: both distributions are normalised, then
    p~ = (p + eps) / (1 + V eps) and r~ likewise, KL = sum p~ log(p~ / r~)."""
    pad_id: int | None = None
    """Without an attention mask, tokens equal to this id are padding. Ignored when a mask is given."""
    near_duplicates: bool = True
    """Compute the MinHash near-duplicate ratio."""
    shingle: int = 5
    """Tokens per shingle of the MinHash."""
    bands: int = 8
    """LSH bands; a near-duplicate shares one whole band with an earlier sequence."""
    rows: int = 8
    """MinHash values per band (signature length = bands * rows). With 8 x 8, pairs of Jaccard
    similarity 0.9 / 0.8 / 0.5 are flagged with probability 0.99 / 0.77 / 0.03."""
    length_reference: int | None = None
    """Sequences frozen (the first ones observed) as the length reference of the KS test; None: the
    window. Ignored when ``reference_lengths`` are given to the monitor."""
    min_length_samples: int = 50
    """No length p-value until the reference and the current window each hold this many
    sequences (the current window counts only sequences observed after the reference)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "window", "reference_tokens", "shingle", "bands", "rows", "min_length_samples",
                     "length_reference"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {self.vocab_size}")
        self.special_ids = tuple(int(i) for i in self.special_ids)
        for i in self.special_ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"special id {i} outside the vocabulary [0, {self.vocab_size})")
        for name in ("window", "reference_tokens", "shingle", "bands", "rows", "min_length_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.length_reference is not None and self.length_reference < 1:
            raise ValueError(f"length_reference must be >= 1, got {self.length_reference}")
        if not (math.isfinite(self.kl_epsilon) and self.kl_epsilon > 0):
            raise ValueError(f"kl_epsilon must be finite and > 0, got {self.kl_epsilon}")
        if self.bands * self.rows > 4096:
            raise ValueError("bands * rows must be <= 4096")


def _validated_reference(reference: Any, vocab_size: int) -> np.ndarray:
    ref = np.asarray(reference.detach().cpu() if isinstance(reference, torch.Tensor) else reference,
                     dtype=np.float64)
    if ref.shape != (vocab_size,):
        raise ValueError(f"reference must have shape ({vocab_size},), got {ref.shape}")
    if not np.isfinite(ref).all():
        raise ValueError("reference holds non-finite values")
    if (ref < 0).any():
        raise ValueError("reference holds negative values")
    total = ref.sum()
    if total <= 0:
        raise ValueError("reference sums to zero")
    return ref / total


class _TokenWindow:
    """Exact unigram counts of the tokens of the last ``window`` sequences."""

    __slots__ = ("counts", "records", "sequences", "tokens", "dtype")

    def __init__(self, vocab_size: int) -> None:
        self.counts = np.zeros(vocab_size, dtype=np.int64)
        self.records: deque[list[Any]] = deque()  # [tokens, offsets, first live sequence]
        self.sequences = 0
        self.tokens = 0
        self.dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32

    def push(self, flat: np.ndarray, lengths: np.ndarray, window: int) -> None:
        offsets = np.zeros(lengths.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        self.counts += np.bincount(flat, minlength=self.counts.size)
        self.records.append([flat.astype(self.dtype), offsets, 0])
        self.sequences += lengths.size
        self.tokens += int(offsets[-1])
        self._evict(self.sequences - window)

    def _evict(self, n: int) -> None:
        while n > 0:
            rec = self.records[0]
            tokens, offsets, head = rec
            live = offsets.size - 1 - head
            take = min(n, live)
            gone = tokens[offsets[head]:offsets[head + take]]
            if gone.size:
                self.counts -= np.bincount(gone, minlength=self.counts.size)
            self.tokens -= gone.size
            self.sequences -= take
            n -= take
            if take == live:
                self.records.popleft()
            else:
                rec[2] = head + take


class DataMonitor:
    """Data-quality signals over a sliding window of token sequences (module docstring: metrics,
    definitions and costs).

        monitor = DataMonitor(vocab_size=50_257, special_ids=(50_256,), registry=registry,
                              labels={"job": "llm", "run": "llm-0001", "rank": "0"})
        monitor.observe_batch(input_ids, attention_mask)
        monitor.values()  # {"trainguard_data_duplicate_ratio": 0.0, ...}

    ``reference``: the unigram reference of the KL divergence, counts or probabilities of shape
    (vocab_size,), finite and non-negative; None freezes it from the first ``reference_tokens``.
    ``reference_lengths``: the reference sample of sequence lengths of the KS test; None freezes it
    from the first ``length_reference`` sequences (default: ``window``).
    ``registry``: when given, the values are exported there through a custom collector, with the
    labels ``job``, ``run``, ``rank`` from ``labels`` (defaults "", "", "0").

    A monitor observes token batches or raw texts (``observe_text``), not both. It is thread-safe.
    A batch that raises ``ValueError`` leaves the monitor unchanged.
    """

    def __init__(
        self,
        vocab_size: int,
        special_ids: Iterable[int] = (),
        window: int = 10_000,
        reference: Any = None,
        reference_tokens: int = 1_000_000,
        registry: CollectorRegistry | None = None,
        *,
        labels: Mapping[str, str] | None = None,
        reference_lengths: Any = None,
        **options: Any,
    ) -> None:
        self.config = DataMonitorConfig(vocab_size=vocab_size, special_ids=tuple(special_ids),
                                        window=window, reference_tokens=reference_tokens, **options)
        cfg = self.config
        self.labels = _base_labels(labels)
        self._lock = threading.Lock()
        self._hasher = _Hasher(cfg.vocab_size, cfg.shingle, cfg.bands, cfg.rows)
        self._text_hasher: _Hasher | None = None
        self._mode: str | None = None  # "tokens" or "text", fixed by the first observation
        n = cfg.window
        self._hashes = np.zeros(n, dtype=np.uint64)
        self._bandkeys = np.zeros((n, cfg.bands), dtype=np.uint64) if cfg.near_duplicates else None
        self._lengths = np.zeros(n, dtype=np.int64)
        self._specials = np.zeros(n, dtype=np.int64)  # raw text only: control chars per text
        self._pos = 0  # next ring slot
        self._filled = 0
        self._tokens = _TokenWindow(cfg.vocab_size)
        self._special_idx = np.array(sorted(set(cfg.special_ids)), dtype=np.int64)
        self._ref_log: np.ndarray | None = None
        self._ref_counts: np.ndarray | None = None
        if reference is not None:
            self._ref_log = self._smoothed_log(_validated_reference(reference, cfg.vocab_size))
        else:
            self._ref_counts = np.zeros(cfg.vocab_size, dtype=np.int64)
        self._ref_seen = 0
        self._len_ref: np.ndarray | None = None
        self._len_ref_target = cfg.length_reference or cfg.window
        self._len_ref_parts: list[np.ndarray] = []
        self._len_ref_count = 0
        if reference_lengths is not None:
            lens = _as_numpy(reference_lengths, "reference_lengths")
            if lens.ndim != 1 or lens.size == 0 or not np.issubdtype(lens.dtype, np.integer) or (lens < 0).any():
                raise ValueError("reference_lengths must be a non-empty 1-D array of non-negative integers")
            self._len_ref = np.sort(lens.astype(np.int64))
        self._after_ref = 0  # sequences observed after the length reference was complete
        self.tokens_total = 0
        self.sequences_total = 0
        self._version = 0
        self._cache: tuple[int, dict[str, float]] = (-1, {})
        # Bottom-k sketch of the exact hashes since the last take_sketch() (cross-rank overlap).
        self._sketch = BottomK(SKETCH_K)
        if registry is not None:
            registry.register(_MonitorCollector(self))

    # -- observation ------------------------------------------------------------------------

    def observe_batch(self, input_ids: Any, attention_mask: Any = None) -> None:
        """Observe a batch of token ids: [B, L] or one sequence [L], any integer dtype, CPU or
        accelerator (read with a host sync; see ``DataFeed`` for the training loop). Padding is
        where ``attention_mask`` is 0 (or, without a mask, ids equal to ``pad_id``).
        ``ValueError`` for an empty batch, non-integer ids, or ids outside the vocabulary."""
        batch = _flatten(input_ids, attention_mask, self.config.pad_id, self.config.vocab_size)
        with self._lock:
            self._claim("tokens")
            exact, bands = self._hasher.digest(batch, self.config.near_duplicates)
            self._observe(batch, exact, bands, None)
            self.tokens_total += batch.flat.size

    def observe_text(self, texts: str | Iterable[str]) -> None:
        """Observe raw texts (one per sequence): duplicates and near-duplicates (5-character
        shingles), lengths in characters, and the special ratio as the share of Unicode control
        (Cc) and format (Cf) characters, ordinary whitespace \\t \\n \\r excepted. The KL
        divergence and the token counter are token-only."""
        batch, controls = _text_batch(texts)
        with self._lock:
            self._claim("text")
            if self._text_hasher is None:
                cfg = self.config
                self._text_hasher = _Hasher(None, cfg.shingle, cfg.bands, cfg.rows)
            exact, bands = self._text_hasher.digest(batch, self.config.near_duplicates)
            self._observe(batch, exact, bands, controls)

    def _claim(self, mode: str) -> None:
        if self._mode is None:
            self._mode = mode
        elif self._mode != mode:
            raise ValueError(f"this monitor observes {self._mode}; use a separate DataMonitor for {mode}")

    def _observe(self, batch: _Batch, exact: np.ndarray, bands: np.ndarray | None,
                 controls: np.ndarray | None) -> None:
        n = self.config.window
        nseq = batch.lengths.size
        self._sketch.update(exact)
        keep = min(nseq, n)  # only the last `window` sequences of a huge batch reach the window
        slots = (self._pos + np.arange(keep)) % n
        self._hashes[slots] = exact[nseq - keep:]
        if bands is not None:
            self._bandkeys[slots] = bands[nseq - keep:]
        self._lengths[slots] = batch.lengths[nseq - keep:]
        if controls is not None:
            self._specials[slots] = controls[nseq - keep:]
        self._pos = (self._pos + keep) % n
        self._filled = min(n, self._filled + keep)
        if self._mode == "tokens":
            first = int(batch.starts[nseq - keep])
            self._tokens.push(batch.flat[first:], batch.lengths[nseq - keep:], n)
            if self._ref_counts is not None:
                take = min(self.config.reference_tokens - self._ref_seen, batch.flat.size)
                self._ref_counts += np.bincount(batch.flat[:take], minlength=self.config.vocab_size)
                self._ref_seen += take
                if self._ref_seen == self.config.reference_tokens:
                    self._ref_log = self._smoothed_log(self._ref_counts / self._ref_seen)
                    self._ref_counts = None
        self._observe_lengths(batch.lengths)
        self.sequences_total += nseq
        self._version += 1

    def _observe_lengths(self, lengths: np.ndarray) -> None:
        if self._len_ref is not None:
            self._after_ref += lengths.size
            return
        take = min(self._len_ref_target - self._len_ref_count, lengths.size)
        self._len_ref_parts.append(lengths[:take].copy())
        self._len_ref_count += take
        if self._len_ref_count == self._len_ref_target:
            self._len_ref = np.sort(np.concatenate(self._len_ref_parts))
            self._len_ref_parts = []
            self._after_ref = lengths.size - take

    def _smoothed_log(self, p: np.ndarray) -> np.ndarray:
        eps = self.config.kl_epsilon
        return np.log((p + eps) / (1.0 + p.size * eps))

    # -- read-out ---------------------------------------------------------------------------

    def take_sketch(self) -> np.ndarray:
        """The bottom-k sketch (``trainer_agent.sketch``, k = ``SKETCH_K``) of the exact hashes of
        the sequences observed since the previous call, as an int64 row; starts a new interval."""
        return self._sketch.take()

    def _window_order(self) -> np.ndarray:
        """Ring slots of the window, oldest first."""
        n = self.config.window
        return (self._pos - self._filled + np.arange(self._filled)) % n

    def values(self) -> dict[str, float]:
        """Every signal that has a value, as {metric name: float}, reflecting all batches observed
        before the call. Cached until the next batch."""
        with self._lock:
            version, cached = self._cache
            if version != self._version:
                cached = self._compute()
                self._cache = (self._version, cached)
            return dict(cached)

    def _compute(self) -> dict[str, float]:
        out: dict[str, float] = {TOKENS_TOTAL: float(self.tokens_total),
                                 SEQUENCES_TOTAL: float(self.sequences_total)}
        filled = self._filled
        if filled == 0:
            return out
        order = self._window_order()
        out[DUPLICATE_RATIO] = (filled - np.unique(self._hashes[order]).size) / filled
        if self._bandkeys is not None:
            keys = self._bandkeys[order]
            near = np.zeros(filled, dtype=np.bool_)
            for b in range(keys.shape[1]):
                later = np.ones(filled, dtype=np.bool_)
                later[np.unique(keys[:, b], return_index=True)[1]] = False  # first occurrences
                near |= later
            out[NEAR_DUPLICATE_RATIO] = float(near.sum()) / filled
        if self._mode == "tokens":
            tw = self._tokens
            if tw.tokens > 0:
                if self._ref_log is not None:
                    p = tw.counts / tw.tokens
                    logp = self._smoothed_log(p)
                    out[TOKEN_KL] = float(np.sum(np.exp(logp) * (logp - self._ref_log)))
                if self._special_idx.size:
                    out[SPECIAL_RATIO] = float(tw.counts[self._special_idx].sum()) / tw.tokens
        else:
            chars = int(self._lengths[order].sum())
            if chars > 0:
                out[SPECIAL_RATIO] = float(self._specials[order].sum()) / chars
        current = min(self._after_ref, filled)
        if self._len_ref is not None and min(self._len_ref.size, current) >= self.config.min_length_samples:
            recent = self._lengths[order[filled - current:]]
            out[LENGTH_PVALUE] = ks_2samp(self._len_ref, recent)[1]
        return out


def _base_labels(labels: Mapping[str, str] | None) -> dict[str, str]:
    out = {"job": "", "run": "", "rank": "0"}
    for key, value in (labels or {}).items():
        if key not in BASE_LABELS:
            raise ValueError(f"unknown label {key!r}; expected some of {BASE_LABELS}")
        out[key] = str(value)
    return out


class _MonitorCollector(Collector):
    """Exports a monitor's values at scrape time."""

    def __init__(self, monitor: DataMonitor) -> None:
        self._monitor = monitor

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        labels = self._monitor.labels
        names, vals = list(labels), list(labels.values())
        for name, value in self._monitor.values().items():
            s = spec(name)
            family = (CounterMetricFamily if s.kind == "counter" else GaugeMetricFamily)(
                name, s.help, labels=names)
            family.add_metric(vals, value)
            yield family

    def describe(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        # Describe every metric the monitor may export so duplicates are refused at registration.
        for s in DATA_METRICS:
            if s.name != FILTERED_TOTAL:
                cls = CounterMetricFamily if s.kind == "counter" else GaugeMetricFamily
                yield cls(s.name, s.help, labels=list(BASE_LABELS))


# ---------------------------------------------------------------------------------------------
# Background feeding for the training loop.


class DataFeed:
    """Feeds a ``DataMonitor`` from the training loop without ever syncing the step or raising.

        feed = DataFeed(monitor, max_pending=16)
        for input_ids, attention_mask in loader:        # inside the training step
            feed.submit(input_ids, attention_mask)      # returns at once; never raises
            ...
        feed.values()            # at the report interval: the monitor's values
        feed.errors, feed.dropped
        feed.close(timeout=1.0)  # at shutdown

    Design:
    * ``submit`` on a CUDA tensor allocates a pinned host buffer (PyTorch's caching host
      allocator), enqueues ``copy_(non_blocking=True)`` on the current stream and records a CUDA
      event after it. Nothing waits on the device in the caller's thread: the copy is ordered on the
      stream with the step's kernels. The daemon worker thread waits on the event
      (``event.synchronize()``, which blocks only the worker) and then runs the numpy work of the
      monitor. CPU tensors and arrays are copied (cheap, and safe against loaders that reuse their
      buffers).
    * The queue is bounded (``max_pending`` batches). When it is full the batch is dropped and
      counted in ``dropped``: the monitor sees a sample of the stream, the step never waits.
    * Any exception (``ValueError`` for an empty batch or an id outside the vocabulary, or anything
      else) is counted in ``errors`` and logged once per exception type; it never reaches the caller.
    * ``flush(timeout)`` waits until every batch submitted before the call is processed (for tests
      and report steps); ``close(timeout)`` stops the worker within the deadline. The worker is a
      daemon thread, so it never keeps the process from exiting.
    """

    def __init__(self, monitor: DataMonitor, *, max_pending: int = 16,
                 logger: logging.Logger | None = None) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.monitor = monitor
        self.errors = 0
        self.dropped = 0
        self._log = logger or _LOG
        self._logged: set[type[BaseException]] = set()
        self._queue: queue.Queue[tuple[Any, Any, Any] | None] = queue.Queue(maxsize=max_pending)
        self._cond = threading.Condition()
        self._submitted = 0  # accepted into the queue
        self._done = 0       # processed (successfully or not)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="trainguard-data-feed", daemon=True)
        self._thread.start()

    def submit(self, input_ids: Any, attention_mask: Any = None) -> bool:
        """Hand a batch to the worker; False when it was dropped (queue full, closed) or failed."""
        if self._closed:
            self.dropped += 1
            return False
        try:
            item = (*self._stage(input_ids, attention_mask),)
        except Exception as exc:  # never raise into the training loop
            self._count_error(exc)
            return False
        with self._cond:
            try:
                self._queue.put_nowait(item)
            except queue.Full:
                self.dropped += 1
                return False
            self._submitted += 1
        return True

    @staticmethod
    def _stage(input_ids: Any, attention_mask: Any) -> tuple[Any, Any, Any]:
        event = None
        staged = []
        for x in (input_ids, attention_mask):
            if isinstance(x, torch.Tensor) and x.is_cuda:
                host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
                # No host-device sync: an asynchronous device-to-pinned-host copy on the current
                # stream; the worker waits on the event recorded after it.
                host.copy_(x.detach(), non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                staged.append(host)
            elif isinstance(x, torch.Tensor):
                staged.append(x.detach().clone())
            elif isinstance(x, np.ndarray):
                staged.append(x.copy())
            else:
                staged.append(x)
        return staged[0], staged[1], event

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            ids, mask, event = item
            try:
                if event is not None:
                    event.synchronize()  # blocks this worker thread only, until the copy landed
                self.monitor.observe_batch(ids, mask)
            except Exception as exc:
                self._count_error(exc)
            finally:
                with self._cond:
                    self._done += 1
                    self._cond.notify_all()
            if self._closed and self._queue.empty():
                return  # closed while the queue was full (no room for the stop signal): drained

    def _count_error(self, exc: Exception) -> None:
        self.errors += 1
        if type(exc) not in self._logged:
            self._logged.add(type(exc))
            self._log.warning("trainguard data monitor: batch skipped (%s: %s); further %s are counted, "
                              "not logged", type(exc).__name__, exc, type(exc).__name__)

    def values(self) -> dict[str, float]:
        """The monitor's values (batches still queued are not in them; ``flush`` first if needed)."""
        return self.monitor.values()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every batch submitted before this call is processed; False on timeout."""
        with self._cond:
            target = self._submitted
            return self._cond.wait_for(lambda: self._done >= target or not self._thread.is_alive(),
                                       timeout)

    def close(self, timeout: float | None = 1.0) -> bool:
        """Stop the worker after the queued batches; True when it stopped within ``timeout`` (in
        all: the hand-off of the stop signal and the wait share it)."""
        self._closed = True
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return False
        self._thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not self._thread.is_alive()


# ---------------------------------------------------------------------------------------------
# Dynamic cleaning (seed section 3.2).


def dynamic_threshold(step: float, initial: float = 0.8, final: float = 0.95,
                      decay_steps: float = 10_000) -> float:
    """The seed's cleaning threshold: ``final - (final - initial) * exp(-step / decay_steps)``.

    Starts at ``initial`` (keep more noisy data early, for robustness) and rises towards
    ``final``."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if decay_steps <= 0:
        raise ValueError(f"decay_steps must be > 0, got {decay_steps}")
    return final - (final - initial) * math.exp(-step / decay_steps)


class DefaultQualityScore:
    """The default quality score of one sample, from the data signals:

        score = (1 - special share of the sample) * (duplicate_score if duplicate else 1)

    A sample is a duplicate when its exact non-padding content occurred among the last ``window``
    samples scored. With the default ``duplicate_score=0.9`` and the seed's schedule (0.8 -> 0.95),
    duplicates are kept early in training and dropped once the threshold passes 0.9 (about step
    11,000); samples with more than 5-20% special tokens are dropped throughout.

    A sample is a token sequence (tensor, array or list) or a mapping holding ``input_ids`` (and
    optionally ``attention_mask``), as Hugging Face datasets yield them.
    """

    def __init__(self, *, special_ids: Iterable[int] = (), window: int = 10_000,
                 duplicate_score: float = 0.9, pad_id: int | None = None) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if not 0.0 <= duplicate_score <= 1.0:
            raise ValueError(f"duplicate_score must lie in [0, 1], got {duplicate_score}")
        self.special_ids = np.array(sorted({int(i) for i in special_ids}), dtype=np.int64)
        self.duplicate_score = duplicate_score
        self.pad_id = pad_id
        self._hasher = _Hasher(None, 1, 1, 1)
        self._recent: deque[int] = deque(maxlen=window)
        self._seen: Counter[int] = Counter()

    def __call__(self, sample: Any) -> float:
        if isinstance(sample, Mapping):
            batch = _flatten(sample["input_ids"], sample.get("attention_mask"), self.pad_id, None)
        else:
            batch = _flatten(sample, None, self.pad_id, None)
        hashes, _ = self._hasher.digest(batch, near=False)
        score = 1.0
        if self.special_ids.size:
            score -= float(np.isin(batch.flat, self.special_ids).mean())
        for h in hashes.tolist():  # a 2-D sample is several sequences: any duplicate counts
            if self._seen[h] > 0:
                score *= self.duplicate_score
                break
        for h in hashes.tolist():
            if len(self._recent) == self._recent.maxlen:
                old = self._recent[0]
                self._seen[old] -= 1
                if self._seen[old] == 0:
                    del self._seen[old]
            self._recent.append(h)
            self._seen[h] += 1
        return score


def sample_identity(sample: Any) -> Hashable:
    """The default identity of a sample for loss feedback: its ``"id"`` when it is a mapping that
    has one, else a 64-bit hash of its token ids (a tensor, array or list, or a mapping's
    ``input_ids``)."""
    if isinstance(sample, Mapping):
        if "id" in sample:
            key = sample["id"]
            return key.item() if isinstance(key, torch.Tensor) else key
        sample = sample["input_ids"]
    ids = _as_numpy(sample, "sample")
    if ids.dtype == np.bool_ or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"a sample's token ids must be integers, got dtype {ids.dtype}")
    flat = np.ascontiguousarray(ids.reshape(-1), dtype=np.int64)
    return int.from_bytes(hashlib.blake2b(flat.tobytes(), digest_size=8).digest(), "little")


class QualityFilter:
    """Wraps an iterable dataset and drops the samples whose quality score is below the cleaning
    threshold at the current step (a sample is kept when ``score >= threshold``; a NaN score is
    dropped). Kept and dropped samples are counted in ``kept`` / ``dropped`` and exported as
    ``trainguard_data_filtered_total{decision="kept"|"dropped"|"downsampled"}`` when a registry is
    given.

        filt = QualityFilter(dataset, score=DefaultQualityScore(special_ids=(0,)),
                             current_step=lambda: trainer.state.global_step, registry=registry)
        for sample in filt: ...

    ``score``: a callable sample -> float (None: ``DefaultQualityScore()``). ``current_step``: a
    callable returning the training step; None uses the attribute ``step``, which the training
    loop may set. ``schedule``: step -> threshold (default ``dynamic_threshold``).
    Count in the process that serves the metrics: DataLoader worker processes have their own copy.

    **Loss feedback** (optional; the stability guide, section 3.2: down-weight what the model has
    learned well). Give the filter the per-sample losses of the last steps::

        losses = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(dim=1)
        filt.record_losses(batch_samples, losses)     # samples (or their keys) and one loss each

    A sample is *well learned* when its last recorded loss is below the ``learned_quantile``
    quantile of the last ``loss_window`` losses recorded (over all samples); the filter then keeps
    it only with probability ``learned_keep`` (a deterministic draw from ``seed``) and counts the
    others as ``downsampled``. A sample with no recorded loss, or a non-finite one, is never
    treated as learned. Samples are identified by ``key`` (default :func:`sample_identity`); the losses
    of at most ``max_tracked`` samples are kept (least recently recorded forgotten first). Record
    losses in the process that iterates the filter (``num_workers=0``, or the worker that owns it).
    """

    def __init__(self, dataset: Iterable[Any], *, score: Callable[[Any], float] | None = None,
                 current_step: Callable[[], int] | None = None,
                 schedule: Callable[[float], float] = dynamic_threshold,
                 registry: CollectorRegistry | None = None,
                 labels: Mapping[str, str] | None = None,
                 key: Callable[[Any], Hashable] = sample_identity,
                 learned_quantile: float = 0.2, learned_keep: float = 0.25,
                 loss_window: int = 10_000, max_tracked: int = 1_000_000, seed: int = 0) -> None:
        if not 0.0 < learned_quantile < 1.0:
            raise ValueError(f"learned_quantile must lie in (0, 1), got {learned_quantile}")
        if not 0.0 <= learned_keep <= 1.0:
            raise ValueError(f"learned_keep must lie in [0, 1], got {learned_keep}")
        for name, v in (("loss_window", loss_window), ("max_tracked", max_tracked)):
            if type(v) is not int or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        self.dataset = dataset
        self.score = score if score is not None else DefaultQualityScore()
        self.current_step = current_step
        self.schedule = schedule
        self.step = 0
        self.kept = 0
        self.dropped = 0
        self.downsampled = 0
        self.labels = _base_labels(labels)
        self.key = key
        self.learned_quantile = learned_quantile
        self.learned_keep = learned_keep
        self.max_tracked = max_tracked
        self._losses: OrderedDict[Hashable, float] = OrderedDict()
        self._recent: deque[float] = deque(maxlen=loss_window)
        self._cutoff: float | None = None  # cached quantile; None: recompute
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()
        if registry is not None:
            registry.register(_FilterCollector(self))

    def threshold(self) -> float:
        """The threshold at the current step."""
        step = self.current_step() if self.current_step is not None else self.step
        return self.schedule(step)

    def record_losses(self, samples: Iterable[Any], losses: Any, *, keys: bool = False) -> None:
        """Record one loss per sample (``losses``: a 1-D tensor, array or list of the same length;
        a device tensor is read here, a host sync). With ``keys=True``, ``samples`` are already
        keys (see ``key``). ``ValueError`` for a length mismatch or non-numeric losses."""
        if isinstance(losses, torch.Tensor):
            losses = losses.detach().to("cpu", torch.float64).numpy()
        values = np.asarray(losses, dtype=np.float64).reshape(-1) if not isinstance(losses, np.ndarray) else losses
        if values.dtype.kind not in "fiu":
            raise ValueError(f"losses must be numbers, got dtype {values.dtype}")
        ks = list(samples) if keys else [self.key(s) for s in samples]
        if len(ks) != values.size:
            raise ValueError(f"{len(ks)} samples but {values.size} losses")
        with self._lock:
            for k, v in zip(ks, values.astype(np.float64).tolist()):
                self._losses[k] = v
                self._losses.move_to_end(k)
                if math.isfinite(v):
                    self._recent.append(v)
            while len(self._losses) > self.max_tracked:
                self._losses.popitem(last=False)
            self._cutoff = None

    def learned_cutoff(self) -> float | None:
        """The loss below which a sample counts as well learned (None before any loss)."""
        with self._lock:
            if self._cutoff is None and self._recent:
                self._cutoff = float(np.quantile(np.fromiter(self._recent, dtype=np.float64), self.learned_quantile))
            return self._cutoff

    def _learned(self, sample: Any) -> bool:
        if not self._losses:
            return False
        cutoff = self.learned_cutoff()
        loss = self._losses.get(self.key(sample))
        return cutoff is not None and loss is not None and loss < cutoff

    def __iter__(self) -> Iterator[Any]:
        for sample in self.dataset:
            if not float(self.score(sample)) >= self.threshold():
                self.dropped += 1
            elif self._learned(sample) and not self._rng.random() < self.learned_keep:
                self.downsampled += 1
            else:
                self.kept += 1
                yield sample


class _FilterCollector(Collector):
    def __init__(self, filt: QualityFilter) -> None:
        self._filter = filt

    def collect(self) -> Iterator[CounterMetricFamily]:
        s = spec(FILTERED_TOTAL)
        family = CounterMetricFamily(s.name, s.help, labels=[*self._filter.labels, "decision"])
        base = list(self._filter.labels.values())
        family.add_metric([*base, "kept"], self._filter.kept)
        family.add_metric([*base, "dropped"], self._filter.dropped)
        family.add_metric([*base, "downsampled"], self._filter.downsampled)
        yield family
