"""Data-quality monitoring inside the training rank and dynamic data cleaning (the stability
guide, sections 3.1 and 3.2).

``DataMonitor`` watches a stream of token batches (or raw texts) and keeps, over a sliding window
of the last ``window`` sequences, the signals below. ``values()`` returns them as
``{metric name: float}``; a signal that has no value yet is absent, not zero.

========================================  ====================================================
metric                                    definition
========================================  ====================================================
``trainguard_data_duplicate_ratio``       (sequences in the window - distinct contents in the
                                          window) / sequences in the window: the share of
                                          window sequences whose exact content occurred earlier
                                          in the window. Alert above 0.05.
``trainguard_data_near_duplicate_ratio``  share of window sequences sharing at least one MinHash
                                          LSH band with an earlier window sequence.
``trainguard_data_token_kl_divergence``   KL(window || reference) of unigram distributions,
                                          nats (smoothing: see ``DataMonitorConfig.kl_epsilon``).
                                          Alert above 0.1.
``trainguard_data_special_token_ratio``   special ids / tokens in the window (raw text: control
                                          and format characters / characters). Alert above 1e-4.
``trainguard_data_length_shift_pvalue``   two-sample Kolmogorov-Smirnov p-value, reference
                                          lengths vs window lengths. Alert when p < 0.05.
``trainguard_data_tokens_total``          non-padding tokens observed (token batches only).
``trainguard_data_sequences_total``       sequences (or texts) observed; a row that is all
                                          padding is no sequence and is not observed.
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
same sequence padded left, right or not at all is the same content; a row that is all padding (a
quarantined sample of ``TokenBatches``) is left out of every signal.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from trainguard.protocol.catalog import BASE_LABELS, DATA_METRICS, spec
from trainer_agent.config import MAX_VOCAB_SIZE
from trainer_agent.data.names import (
    DUPLICATE_RATIO, FILTERED_TOTAL, LENGTH_PVALUE, NEAR_DUPLICATE_RATIO, SEQUENCES_TOTAL, SPECIAL_RATIO, TOKEN_KL,
    TOKENS_TOTAL,
)
from trainer_agent.data.settings import check_pad_id, int_setting, is_real, token_ids
from trainer_agent.data.signals import _Batch, _Hasher, _flatten, _text_batch, ks_2samp
from trainer_agent.data.windows import _LengthReference, _SequenceRing, _TokenWindow, _UnigramReference
from trainer_agent.measure.sketch import SKETCH_K, BottomK

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
            if value is None:
                continue
            int_setting(name, value, most=_LIMITS.get(name), why=_LIMIT_REASONS.get(name, ""))
        self.special_ids = token_ids(self.special_ids, self.vocab_size)
        check_pad_id(self.pad_id)
        eps = self.kl_epsilon
        if not (is_real(eps) and math.isfinite(eps) and eps > 0):
            raise ValueError(f"kl_epsilon must be finite and > 0, got {eps!r}")
        if self.bands * self.rows > 4096:
            raise ValueError("bands * rows must be <= 4096")


#: Upper bounds of the settings that size what a monitor allocates, and why.
_LIMITS = {"vocab_size": MAX_VOCAB_SIZE, "window": 1 << 24, "length_reference": 1 << 24, "shingle": 4096}
_LIMIT_REASONS = {"vocab_size": "the monitor keeps about 24 bytes per token id",
                  "window": "the monitor keeps about 90 bytes and the tokens of each window sequence",
                  "length_reference": "the reference keeps every length", "shingle": "tokens per shingle"}


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
        self.config = DataMonitorConfig(vocab_size=vocab_size, special_ids=special_ids,
                                        window=window, reference_tokens=reference_tokens, **options)
        cfg = self.config
        self.labels = _base_labels(labels)
        self._lock = threading.Lock()
        self._hasher = _Hasher(cfg.vocab_size, cfg.shingle, cfg.bands, cfg.rows)
        self._text_hasher: _Hasher | None = None
        self._mode: str | None = None  # "tokens" or "text", fixed by the first observation
        self._ring = _SequenceRing(cfg.window, cfg.bands if cfg.near_duplicates else None)
        self._tokens = _TokenWindow(cfg.vocab_size)
        self._special_idx = np.array(sorted(set(cfg.special_ids)), dtype=np.int64)
        self._unigrams = _UnigramReference(cfg.vocab_size, cfg.reference_tokens, cfg.kl_epsilon, reference)
        self._lengths = _LengthReference(cfg.length_reference or cfg.window, reference_lengths)
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
        nseq = batch.lengths.size
        self._sketch.update(exact)
        keep = self._ring.push(exact, bands, batch.lengths, controls)
        if self._mode == "tokens":
            first = int(batch.starts[nseq - keep])
            self._tokens.push(batch.flat[first:], batch.lengths[nseq - keep:], self.config.window)
            self._unigrams.observe(batch.flat)
        self._lengths.observe(batch.lengths)
        self.sequences_total += nseq
        self._version += 1

    def take_sketch(self) -> np.ndarray:
        """The bottom-k sketch (``trainer_agent.measure.sketch``, k = ``SKETCH_K``) of the exact hashes of
        the sequences observed since the previous call, as an int64 row; starts a new interval."""
        return self._sketch.take()

    # -- read-out ---------------------------------------------------------------------------

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
        ring = self._ring
        filled = ring.filled
        if filled == 0:
            return out
        order = ring.order()
        out[DUPLICATE_RATIO] = (filled - np.unique(ring.hashes[order]).size) / filled
        if ring.bandkeys is not None:
            out[NEAR_DUPLICATE_RATIO] = ring.near_duplicate_ratio(order)
        if self._mode == "tokens":
            tw = self._tokens
            if tw.tokens > 0:
                kl = self._unigrams.kl(tw.counts, tw.tokens)
                if kl is not None:
                    out[TOKEN_KL] = kl
                if self._special_idx.size:
                    out[SPECIAL_RATIO] = float(tw.counts[self._special_idx].sum()) / tw.tokens
        else:
            chars = int(ring.lengths[order].sum())
            if chars > 0:
                out[SPECIAL_RATIO] = float(ring.specials[order].sum()) / chars
        current = min(self._lengths.after, filled)
        reference = self._lengths.sorted
        if reference is not None and min(reference.size, current) >= self.config.min_length_samples:
            recent = ring.lengths[order[filled - current:]]
            out[LENGTH_PVALUE] = ks_2samp(reference, recent)[1]
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


