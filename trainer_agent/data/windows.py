"""The data monitor's state over its sliding window (``trainer_agent/data/monitor.py``): the
window's unigram counts, its ring of sequence hashes, band keys and lengths, and the two
references the drift signals compare against (the unigram reference of the KL divergence, the
length sample of the KS test), each given or frozen from the first data observed."""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
import torch

from trainer_agent.data.signals import _as_numpy

__all__: list[str] = []  # the monitor's internals


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


class _SequenceRing:
    """The last ``window`` sequences' exact hashes, LSH band keys, lengths and (raw text) control
    characters, in ring slots."""

    def __init__(self, window: int, bands: int | None) -> None:
        self.window = window
        self.hashes = np.zeros(window, dtype=np.uint64)
        self.bandkeys = np.zeros((window, bands), dtype=np.uint64) if bands is not None else None
        self.lengths = np.zeros(window, dtype=np.int64)
        self.specials = np.zeros(window, dtype=np.int64)  # raw text only: control chars per text
        self.pos = 0  # next ring slot
        self.filled = 0

    def push(self, exact: np.ndarray, bands: np.ndarray | None, lengths: np.ndarray, controls: np.ndarray | None) -> int:
        """The last ``window`` of a batch's sequences into the ring; how many were kept."""
        n, nseq = self.window, lengths.size
        keep = min(nseq, n)  # only the last `window` sequences of a huge batch reach the window
        slots = (self.pos + np.arange(keep)) % n
        self.hashes[slots] = exact[nseq - keep:]
        if bands is not None and self.bandkeys is not None:
            self.bandkeys[slots] = bands[nseq - keep:]
        self.lengths[slots] = lengths[nseq - keep:]
        if controls is not None:
            self.specials[slots] = controls[nseq - keep:]
        self.pos = (self.pos + keep) % n
        self.filled = min(n, self.filled + keep)
        return keep

    def order(self) -> np.ndarray:
        """Ring slots of the window, oldest first."""
        return (self.pos - self.filled + np.arange(self.filled)) % self.window

    def near_duplicate_ratio(self, order: np.ndarray) -> float:
        """The share of the window's sequences that share a whole band with an earlier one."""
        assert self.bandkeys is not None
        keys = self.bandkeys[order]
        near = np.zeros(self.filled, dtype=np.bool_)
        for b in range(keys.shape[1]):
            later = np.ones(self.filled, dtype=np.bool_)
            later[np.unique(keys[:, b], return_index=True)[1]] = False  # first occurrences
            near |= later
        return float(near.sum()) / self.filled


class _UnigramReference:
    """The KL divergence's reference: given, or frozen from the first ``tokens`` tokens observed."""

    def __init__(self, vocab_size: int, tokens: int, eps: float, reference: Any) -> None:
        self.vocab_size, self.tokens, self.eps = vocab_size, tokens, eps
        self.log: np.ndarray | None = None
        self._counts: np.ndarray | None = None
        self._seen = 0
        if reference is not None:
            self.log = self.smoothed_log(_validated_reference(reference, vocab_size))
        else:
            self._counts = np.zeros(vocab_size, dtype=np.int64)

    def smoothed_log(self, p: np.ndarray) -> np.ndarray:
        return np.log((p + self.eps) / (1.0 + p.size * self.eps))

    def observe(self, flat: np.ndarray) -> None:
        if self._counts is None:
            return
        take = min(self.tokens - self._seen, flat.size)
        self._counts += np.bincount(flat[:take], minlength=self.vocab_size)
        self._seen += take
        if self._seen == self.tokens:
            self.log = self.smoothed_log(self._counts / self._seen)
            self._counts = None

    def kl(self, counts: np.ndarray, tokens: int) -> float | None:
        """KL(window || reference) of the window's unigram ``counts``; None before the reference."""
        if self.log is None:
            return None
        logp = self.smoothed_log(counts / tokens)
        return float(np.sum(np.exp(logp) * (logp - self.log)))


class _LengthReference:
    """The KS test's reference sample of sequence lengths: given, or frozen from the first
    ``target`` sequences; then counts the sequences observed after it."""

    def __init__(self, target: int, reference_lengths: Any) -> None:
        self.sorted: np.ndarray | None = None
        self._target = target
        self._parts: list[np.ndarray] = []
        self._count = 0
        if reference_lengths is not None:
            lens = _as_numpy(reference_lengths, "reference_lengths")
            if lens.ndim != 1 or lens.size == 0 or not np.issubdtype(lens.dtype, np.integer) or (lens < 0).any():
                raise ValueError("reference_lengths must be a non-empty 1-D array of non-negative integers")
            self.sorted = np.sort(lens.astype(np.int64))
        self.after = 0  # sequences observed after the length reference was complete

    def observe(self, lengths: np.ndarray) -> None:
        if self.sorted is not None:
            self.after += lengths.size
            return
        take = min(self._target - self._count, lengths.size)
        self._parts.append(lengths[:take].copy())
        self._count += take
        if self._count == self._target:
            self.sorted = np.sort(np.concatenate(self._parts))
            self._parts = []
            self.after = lengths.size - take
