"""A sharded token dataset: shards of token ids in memory-mapped files, a writer that builds them
(with the data monitor run over them, so each shard carries its own quality report), and a
deterministic, resumable reader for ``torch.utils.data`` (the stability guide, section 3.3).

    paths = write_shards("data/", texts, vocab_size=256, tokens_per_shard=50_000_000)
    loader = TokenLoader(TokenBatches(paths, batch_size=16, seq_len=2048, seed=1234), num_workers=2)
    for batch in loader:                        # {"input_ids", "attention_mask", "tokens"}
        ...
    checkpoint["loader"] = loader.state_dict()  # later: loader.load_state_dict(...)

On disk, a shard ``NAME`` is three files:

=============  ==================================================================================
``NAME.bin``   the token ids of all its sequences back to back, little-endian ``uint16`` (a
               vocabulary of at most 65,536 ids) or ``uint32``.
``NAME.idx``   the byte-level index: one pair of little-endian int64 per sequence, (byte offset
               into ``NAME.bin``, length in tokens).
``NAME.json``  format, version, dtype, vocabulary size, sequence and token counts, and
               ``quality``: the data monitor's values over the shard (its duplicate ratio,
               special-token ratio, ... over the last ``monitor_window`` sequences, and the
               token and sequence totals of the whole shard).
=============  ==================================================================================

Opening a shard reads its JSON and maps the two binary files (``np.memmap``): memory held per
open shard is a few kilobytes whatever its size, and a batch reads only the pages of its own
sequences.

**Order.** Epoch ``e`` visits the sequences of all shards in the order of a pseudo-random
permutation keyed by ``(seed, e)``: a 4-round Feistel network over the next even power of two,
cycle-walked into ``[0, N)``, computed position by position (O(1) memory, no index scan, and
any position of the epoch can be jumped to). Position ``p`` of the epoch belongs to rank
``p % world_size``; a rank's ``b``-th batch holds its positions ``b*batch_size ..
(b+1)*batch_size - 1`` (a rank gets ``N // (world_size * batch_size)`` batches, the same count on
every rank, and the remainder is left out of that epoch). Within a rank, the ``DataLoader``
workers take batches round robin. No two (rank, worker) pairs read the same position, whatever
the seed: the shared-seed failure (workers or ranks that shuffle independently with the same seed
and feed the same samples) cannot happen by construction; the agent's cross-rank sketches catch
it in loaders that are not this one.

**Seeds.** Each worker reseeds ``random``, ``numpy.random`` and ``torch`` at the start of an
epoch with ``worker_seed(seed, epoch, rank, worker)``, distinct per (seed, epoch, rank, worker)
and reproducible, so randomness a user adds in the workers (augmentation, masking) neither
repeats across workers nor changes from one run to the next.

**Resume.** ``TokenLoader.state_dict()`` holds the epoch and the number of batches the training
loop has received in it (not the number prefetched); a loader given that state yields exactly the
batches the original would have yielded next.

**Quarantine.** ``TokenLoader.quarantine(ids)`` (or ``quarantine_last()``: the samples of the batch
it yielded last, which the agent calls when every rank skipped a step for its data) adds samples —
global sequence numbers in shard order, see ``TokenBatches.locate`` for their shard and index —
to a skip list kept in ``state_dict()``. A skipped sample's row of a batch is padding with
``attention_mask`` 0 and counts no tokens, so every rank still gets the same number of batches
of the same shape (the loss must honour the mask). The list applies from the loader's next pass
(its ``DataLoader`` workers hold the data set as it was when the pass started; with
``num_workers=0`` at once) and after a resume.
"""

from __future__ import annotations

import json
import mmap
import os
import queue
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from trainer_agent.data.signals import _mix64 as _mix64_bits

__all__ = [
    "ShardWriter",
    "ShardInfo",
    "TokenShard",
    "TokenBatches",
    "TokenLoader",
    "write_shards",
    "worker_seed",
    "Permutation",
]

FORMAT = "trainguard-token-shard"
VERSION = 1
_INDEX_DTYPE = np.dtype("<i8")
#: Batches whose sequences are located at once (see ``TokenBatches._plan``).
_PLAN_BATCHES = 64
_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser on one Python int (mod 2**64)."""
    z = x & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _derive(*parts: int) -> int:
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = _mix64(h ^ _mix64(int(p) + 0x632BE59BD9B4E019))
    return h


def worker_seed(seed: int, epoch: int, rank: int, worker: int) -> int:
    """The 63-bit seed of one (rank, worker) in one epoch: distinct for every (seed, epoch, rank,
    worker) (a 64-bit mix of the four), the same in every run."""
    return _derive(seed, epoch, rank, worker) >> 1


class Permutation:
    """A pseudo-random permutation of ``range(n)`` keyed by ``key``, evaluated position by position
    (vectorised, O(1) memory): a 4-round Feistel network over ``2**bits >= n`` (``bits`` even),
    cycle-walked until the value falls in ``[0, n)``."""

    def __init__(self, n: int, key: int) -> None:
        if type(n) is not int or n < 1:
            raise ValueError(f"a permutation needs n >= 1 elements, got {n!r}")
        bits = max(2, (n - 1).bit_length())
        bits += bits % 2
        self.n = n
        self._half = np.uint64(bits // 2)
        self._mask = np.uint64((1 << (bits // 2)) - 1)
        self._keys = [np.uint64(_derive(key, r)) for r in range(4)]

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self._half, x & self._mask
        for k in self._keys:
            left, right = right, left ^ (_mix64_bits(right ^ k) & self._mask)
        return (left << self._half) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """The permuted values of ``positions`` (int array in ``[0, n)``), as int64."""
        x = np.asarray(positions, dtype=np.uint64)
        y = self._encrypt(x)
        out = y >= np.uint64(self.n)
        while out.any():  # the domain is < 4n: a few rounds on a few values
            y[out] = self._encrypt(y[out])
            out = y >= np.uint64(self.n)
        return y.astype(np.int64)


# ----------------------------------------------------------------------------------- writing


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """A shard written by :class:`ShardWriter`."""

    path: Path
    """The shard's base path (``.bin``/``.idx``/``.json`` appended)."""
    sequences: int
    tokens: int
    quality: dict[str, float]


def _dtype_for(vocab_size: int) -> np.dtype:
    if type(vocab_size) is not int or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
    if vocab_size <= 1 << 16:
        return np.dtype("<u2")
    if vocab_size <= 1 << 32:
        return np.dtype("<u4")
    raise ValueError(f"vocab_size {vocab_size} is over 2**32")


def _files(base: Path) -> tuple[Path, Path, Path]:
    return base.with_name(base.name + ".bin"), base.with_name(base.name + ".idx"), base.with_name(base.name + ".json")


def byte_tokenizer(text: str) -> np.ndarray:
    """UTF-8 bytes as token ids (a 256-id vocabulary): the writer's default for text."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


class ShardWriter:
    """Writes one shard, sequence by sequence, streaming to disk (memory: the monitor's window
    and one buffer of ``monitor_batch`` sequences).

        with ShardWriter("data/shard-00000", vocab_size=50_257, special_ids=(50_256,)) as w:
            for ids in sequences:
                w.add(ids)
        w.info.quality  # {"trainguard_data_duplicate_ratio": 0.0, ...}

    ``monitor``: run the data monitor over the shard (True) or not. A writer that fails or is
    left by an exception removes its partial files. ``ValueError`` for an empty sequence, ids that
    are not integers or lie outside ``[0, vocab_size)``, an existing shard, or a shard with no
    sequence at all.
    """

    def __init__(self, path: str | os.PathLike[str], *, vocab_size: int, special_ids: Iterable[int] = (),
                 monitor: bool = True, monitor_window: int = 10_000, monitor_batch: int = 256) -> None:
        self.dtype = _dtype_for(vocab_size)
        self.vocab_size = vocab_size
        self.base = Path(path)
        self._bin, self._idx, self._json = _files(self.base)
        for f in (self._bin, self._idx, self._json):
            if f.exists():
                raise ValueError(f"{f} exists: a shard is written once")
        self._monitor = None
        if monitor:
            from trainer_agent.data import DataMonitor

            self._monitor = DataMonitor(vocab_size, special_ids=special_ids, window=monitor_window)
        self._monitor_batch = monitor_batch
        self._pending: list[np.ndarray] = []
        self.base.parent.mkdir(parents=True, exist_ok=True)
        self._bin_f = open(self._bin, "wb")
        self._idx_f = open(self._idx, "wb")
        self._offset = 0
        self.sequences = 0
        self.tokens = 0
        self.info: ShardInfo | None = None

    def add(self, tokens: Any) -> None:
        """Append one sequence of token ids (1-D, any integer dtype, list or array or tensor)."""
        if self.info is not None:
            raise ValueError("this shard is closed")
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.detach().cpu().numpy()
        arr = np.asarray(tokens)
        if arr.ndim != 1 or arr.dtype == object:
            raise ValueError(f"a sequence is a 1-D array of token ids, got shape {arr.shape}")
        if arr.size == 0:
            raise ValueError("empty sequence")
        if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= self.vocab_size:
            raise ValueError(f"token id {lo if lo < 0 else hi} outside the vocabulary [0, {self.vocab_size})")
        data = arr.astype(self.dtype, copy=False)
        self._bin_f.write(data.tobytes())
        self._idx_f.write(np.array([self._offset, arr.size], dtype=_INDEX_DTYPE).tobytes())
        self._offset += data.nbytes
        self.sequences += 1
        self.tokens += arr.size
        if self._monitor is not None:
            self._pending.append(data)
            if len(self._pending) >= self._monitor_batch:
                self._observe()

    def add_text(self, text: str, tokenizer: Callable[[str], Any] | None = None) -> None:
        """Append one text, tokenized by ``tokenizer`` (str -> ids; default: its UTF-8 bytes)."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        self.add((tokenizer or byte_tokenizer)(text))

    def _observe(self) -> None:
        seqs, self._pending = self._pending, []
        if not seqs:
            return
        width = max(s.size for s in seqs)
        ids = np.zeros((len(seqs), width), dtype=np.int64)
        mask = np.zeros((len(seqs), width), dtype=np.bool_)
        for i, s in enumerate(seqs):
            ids[i, : s.size] = s
            mask[i, : s.size] = True
        assert self._monitor is not None
        self._monitor.observe_batch(ids, mask)

    def close(self) -> ShardInfo:
        """Finish the shard: flush, write the index and the JSON with the quality report."""
        if self.info is not None:
            return self.info
        try:
            if self.sequences == 0:
                raise ValueError(f"shard {self.base} has no sequence")
            quality: dict[str, float] = {}
            if self._monitor is not None:
                self._observe()
                quality = self._monitor.values()
            self._bin_f.close()
            self._idx_f.close()
            meta = {"format": FORMAT, "version": VERSION, "dtype": self.dtype.str, "vocab_size": self.vocab_size,
                    "sequences": self.sequences, "tokens": self.tokens, "quality": quality}
            tmp = self._json.with_name(self._json.name + ".tmp")
            tmp.write_text(json.dumps(meta, indent=1, sort_keys=True))
            os.replace(tmp, self._json)  # the JSON appears last: a shard with one is complete
        except BaseException:
            self.abort()
            raise
        self.info = ShardInfo(self.base, self.sequences, self.tokens, quality)
        return self.info

    def abort(self) -> None:
        """Close and remove the partial files."""
        for f in (self._bin_f, self._idx_f):
            f.close()
        for p in (self._bin, self._idx, self._json):
            p.unlink(missing_ok=True)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        elif self.info is None:
            self.abort()


def write_shards(directory: str | os.PathLike[str], items: Iterable[Any], *, vocab_size: int,
                 tokens_per_shard: int = 1 << 28, prefix: str = "shard",
                 tokenizer: Callable[[str], Any] | None = None, special_ids: Iterable[int] = (),
                 monitor: bool = True) -> list[ShardInfo]:
    """Write ``items`` (texts, tokenized by ``tokenizer``, default UTF-8 bytes; or sequences of
    token ids) into shards ``directory/prefix-00000`` ... of about ``tokens_per_shard`` tokens each
    (a shard is closed once it holds at least that many). Returns the shards written."""
    if type(tokens_per_shard) is not int or tokens_per_shard < 1:
        raise ValueError(f"tokens_per_shard must be a positive integer, got {tokens_per_shard!r}")
    special = tuple(special_ids)
    out: list[ShardInfo] = []
    writer: ShardWriter | None = None
    try:
        for item in items:
            if writer is None:
                writer = ShardWriter(Path(directory) / f"{prefix}-{len(out):05d}", vocab_size=vocab_size,
                                     special_ids=special, monitor=monitor)
            if isinstance(item, str):
                writer.add_text(item, tokenizer)
            else:
                writer.add(item)
            if writer.tokens >= tokens_per_shard:
                out.append(writer.close())
                writer = None
        if writer is not None:
            out.append(writer.close())
            writer = None
    finally:
        if writer is not None:
            writer.abort()
    if not out:
        raise ValueError("no sequence to write")
    return out


# ----------------------------------------------------------------------------------- reading


class TokenShard:
    """One shard opened read-only: its JSON read, its ``.bin`` and ``.idx`` memory-mapped (a few
    kilobytes held, whatever its size). ``ValueError`` for a missing, foreign or inconsistent
    shard."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        base = Path(path)
        if base.suffix in (".bin", ".idx", ".json"):
            base = base.with_suffix("")
        self.path = base
        bin_path, idx_path, json_path = _files(base)
        try:
            meta = json.loads(json_path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{json_path}: not a readable shard description ({exc})") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise ValueError(f"{json_path}: not a {FORMAT} version {VERSION} description")
        try:
            self.dtype = np.dtype(meta["dtype"])
            self.vocab_size = int(meta["vocab_size"])
            self.sequences = int(meta["sequences"])
            self.tokens = int(meta["tokens"])
            self.quality: dict[str, float] = dict(meta.get("quality") or {})
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{json_path}: malformed shard description ({exc!r})") from None
        if self.dtype not in (np.dtype("<u2"), np.dtype("<u4")) or self.sequences < 1 or self.tokens < 1:
            raise ValueError(f"{json_path}: dtype {self.dtype}, {self.sequences} sequences, {self.tokens} tokens")
        try:
            bin_size, idx_size = bin_path.stat().st_size, idx_path.stat().st_size
        except OSError as exc:
            raise ValueError(f"shard {base}: {exc}") from None
        if idx_size != self.sequences * 2 * _INDEX_DTYPE.itemsize:
            raise ValueError(f"{idx_path}: {idx_size} bytes, expected {self.sequences} (offset, length) pairs")
        if bin_size != self.tokens * self.dtype.itemsize:
            raise ValueError(f"{bin_path}: {bin_size} bytes, expected {self.tokens} tokens of {self.dtype}")
        self.index = np.memmap(idx_path, dtype=_INDEX_DTYPE, mode="r", shape=(self.sequences, 2))
        # A plain array over the mapping: slicing it costs a fraction of an np.memmap slice.
        with open(bin_path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.data = np.frombuffer(self._map, dtype=self.dtype, count=self.tokens)

    def __len__(self) -> int:
        return self.sequences

    def entries(self, local: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(token offset, length) of the sequences ``local``; ``ValueError`` for an index entry
        that points outside the shard (a corrupt ``.idx``)."""
        rows = self.index[local]
        offsets, lengths = rows[:, 0], rows[:, 1]
        item = self.dtype.itemsize
        if ((offsets < 0) | (lengths < 1) | (offsets % item != 0)
                | (offsets // item + lengths > self.tokens)).any():
            raise ValueError(f"{self.path}.idx: an entry points outside {self.path}.bin (corrupt index)")
        return offsets // item, lengths

    def sequence(self, i: int) -> np.ndarray:
        """Sequence ``i`` (a read-only view into the mapped file)."""
        if not 0 <= i < self.sequences:
            raise ValueError(f"sequence {i} outside [0, {self.sequences})")
        (start,), (length,) = self.entries(np.array([i]))
        return self.data[start: start + length]


def _shard_paths(shards: str | os.PathLike[str] | Sequence[Any]) -> list[Path]:
    if isinstance(shards, (str, os.PathLike)):
        root = Path(shards)
        if root.is_dir():
            paths = sorted(p.with_suffix("") for p in root.glob("*.json"))
            if not paths:
                raise ValueError(f"no shard in {root}")
            return paths
        return [root]
    paths = [Path(s.path if isinstance(s, (ShardInfo, TokenShard)) else s) for s in shards]
    if not paths:
        raise ValueError("no shard given")
    return paths


class TokenBatches(IterableDataset):
    """The batches of one rank for a ``DataLoader(batch_size=None)`` (use :class:`TokenLoader`,
    which keeps the position). Each batch is a dict: ``input_ids`` (int64 ``[batch_size,
    seq_len]``, sequences truncated to ``seq_len`` and padded with ``pad_id``), ``attention_mask``
    (int64, 1 on tokens) and ``tokens`` (the batch's non-padding tokens, an int). See the module
    docstring for the order and the seeds.

    ``rank``/``world_size``: default to the default process group's (0 and 1 without one).
    """

    def __init__(self, shards: str | os.PathLike[str] | Sequence[Any], *, batch_size: int, seq_len: int,
                 seed: int = 0, pad_id: int = 0, rank: int | None = None, world_size: int | None = None) -> None:
        for name, v in (("batch_size", batch_size), ("seq_len", seq_len)):
            if type(v) is not int or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if type(seed) is not int or type(pad_id) is not int or pad_id < 0:
            raise ValueError(f"seed and pad_id must be integers (pad_id >= 0), got {seed!r}, {pad_id!r}")
        if rank is None or world_size is None:
            initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
            rank = (torch.distributed.get_rank() if initialized else 0) if rank is None else rank
            world_size = (torch.distributed.get_world_size() if initialized else 1) if world_size is None else world_size
        if type(world_size) is not int or world_size < 1 or type(rank) is not int or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank {rank!r} of {world_size!r}")
        self.paths = _shard_paths(shards)
        self.batch_size, self.seq_len, self.seed, self.pad_id = batch_size, seq_len, seed, pad_id
        self.rank, self.world_size = rank, world_size
        opened = [TokenShard(p) for p in self.paths]
        self._shards: list[TokenShard] | None = opened
        self.sequences = sum(len(s) for s in opened)
        self.tokens = sum(s.tokens for s in opened)
        self._starts = np.cumsum([0] + [len(s) for s in opened[:-1]], dtype=np.int64)
        self.batches_per_epoch = self.sequences // (world_size * batch_size)
        if self.batches_per_epoch == 0:
            raise ValueError(f"{self.sequences} sequences make no batch of {batch_size} on each of {world_size} ranks")
        self.epoch = 0
        self.start = 0
        self.skip: frozenset[int] = frozenset()
        """Global sequence numbers left out of every batch (a quarantine: ``TokenLoader.quarantine``)."""
        self._perm: tuple[int, Permutation] | None = None
        self._block: tuple[tuple[int, int], list[int], list[int], list[int]] | None = None

    def __getstate__(self) -> dict[str, Any]:  # worker processes map the files themselves
        state = dict(self.__dict__)
        state["_shards"] = None
        state["_perm"] = None
        state["_block"] = None
        return state

    def shards(self) -> list[TokenShard]:
        if self._shards is None:
            self._shards = [TokenShard(p) for p in self.paths]
        return self._shards

    def order(self, epoch: int) -> Permutation:
        """The permutation of epoch ``epoch`` (the same on every rank and worker)."""
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, Permutation(self.sequences, _derive(self.seed, epoch)))
        return self._perm[1]

    def sequence_ids(self, epoch: int, batch: int) -> np.ndarray:
        """Global sequence numbers (in shard order) of this rank's batch ``batch`` of ``epoch``."""
        if not 0 <= batch < self.batches_per_epoch:
            raise ValueError(f"batch {batch} outside [0, {self.batches_per_epoch})")
        positions = (batch * self.batch_size + np.arange(self.batch_size, dtype=np.int64)) * self.world_size + self.rank
        return self.order(epoch)(positions)

    def _plan(self, epoch: int, batch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(shard, first token, length) of each sequence of ``batch``. Planned for a block of
        ``_PLAN_BATCHES`` batches at once (one permutation, one index read and check per block:
        the per-batch cost is then the copies), the last block kept."""
        block = batch // _PLAN_BATCHES
        if self._block is None or self._block[0] != (epoch, block):
            first = block * _PLAN_BATCHES
            count = min(_PLAN_BATCHES, self.batches_per_epoch - first)
            positions = (first * self.batch_size + np.arange(count * self.batch_size, dtype=np.int64)) * self.world_size + self.rank
            ids = self.order(epoch)(positions)
            which = np.searchsorted(self._starts, ids, side="right") - 1
            starts = np.empty_like(ids)
            lengths = np.empty_like(ids)
            shards = self.shards()
            for s in np.unique(which).tolist():
                rows = np.flatnonzero(which == s)
                starts[rows], lengths[rows] = shards[s].entries(ids[rows] - self._starts[s])
            np.minimum(lengths, self.seq_len, out=lengths)
            self._block = ((epoch, block), which.tolist(), starts.tolist(), lengths.tolist())
        _, which, starts, lengths = self._block
        lo = (batch % _PLAN_BATCHES) * self.batch_size
        hi = lo + self.batch_size
        return which[lo:hi], starts[lo:hi], lengths[lo:hi]

    def batch(self, epoch: int, batch: int) -> dict[str, Any]:
        """This rank's batch ``batch`` of ``epoch``."""
        if not 0 <= batch < self.batches_per_epoch:
            raise ValueError(f"batch {batch} outside [0, {self.batches_per_epoch})")
        which, starts, lengths = self._plan(epoch, batch)
        shape = (self.batch_size, self.seq_len)
        input_ids = np.zeros(shape, dtype=np.int64) if self.pad_id == 0 else np.full(shape, self.pad_id, dtype=np.int64)
        mask = np.zeros(shape, dtype=np.int64)
        data = [s.data for s in self.shards()]
        skipped = ([int(i) in self.skip for i in self.sequence_ids(epoch, batch).tolist()] if self.skip
                   else [False] * len(lengths))
        tokens = 0
        for row, (s, start, length, out) in enumerate(zip(which, starts, lengths, skipped)):
            if out:
                continue  # quarantined: a padding row the loss does not see
            input_ids[row, :length] = data[s][start: start + length]
            mask[row, :length] = 1
            tokens += length
        return {"input_ids": torch.from_numpy(input_ids), "attention_mask": torch.from_numpy(mask),
                "tokens": tokens}

    def locate(self, ids: Iterable[int]) -> dict[str, list[int]]:
        """Where global sequence numbers ``ids`` live: ``{shard base path: [index in that shard]}``."""
        arr = np.asarray(sorted({int(i) for i in ids}), dtype=np.int64)
        if len(arr) and (arr[0] < 0 or arr[-1] >= self.sequences):
            raise ValueError(f"sequence numbers must lie in [0, {self.sequences})")
        which = np.searchsorted(self._starts, arr, side="right") - 1
        out: dict[str, list[int]] = {}
        for s, i in zip(which.tolist(), arr.tolist()):
            out.setdefault(str(self.paths[s]), []).append(i - int(self._starts[s]))
        return out

    def worker_batches(self, epoch: int, start: int, worker: int, workers: int) -> Iterator[int]:
        """Batch numbers that worker ``worker`` of ``workers`` produces when an epoch is read from
        batch ``start``: ``start + worker``, then every ``workers``-th (the order in which a
        ``DataLoader`` collects them round robin is then the batch order)."""
        return iter(range(start + worker, self.batches_per_epoch, workers))

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if info is not None:
            s = worker_seed(self.seed, self.epoch, self.rank, worker)
            random.seed(s)
            np.random.seed(s % (1 << 32))
            torch.manual_seed(s)
        for b in self.worker_batches(self.epoch, self.start, worker, workers):
            yield self.batch(self.epoch, b)


_END = object()


class _Failed:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class TokenLoader:
    """Iterates a :class:`TokenBatches` through a ``DataLoader`` (``num_workers`` processes) and
    a prefetch thread that keeps up to ``prefetch`` batches ready (in pinned memory when CUDA is
    available: the ``DataLoader``'s ``pin_memory``). Iterating yields the batches of the current
    epoch from the current position; a completed pass moves to the next epoch. Breaking out of
    the loop keeps the position (the batches received so far).

    ``values()`` gives the reader's metrics (host values; safe from another thread):
    ``trainguard_input_prefetch_depth`` and ``trainguard_input_tokens_per_second``.
    """

    def __init__(self, dataset: TokenBatches, *, num_workers: int = 2, prefetch: int = 8,
                 pin_memory: bool | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        if not isinstance(dataset, TokenBatches):
            raise ValueError(f"dataset must be a TokenBatches, got {type(dataset).__name__}")
        if type(num_workers) is not int or num_workers < 0:
            raise ValueError(f"num_workers must be an integer >= 0, got {num_workers!r}")
        if type(prefetch) is not int or prefetch < 1:
            raise ValueError(f"prefetch must be an integer >= 1, got {prefetch!r}")
        self.dataset = dataset
        self.num_workers = num_workers
        self.prefetch = prefetch
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self._clock = clock
        self.epoch = 0
        self.batch = 0
        self._last: tuple[int, int] | None = None  # (epoch, batch) the training loop received last
        self._queue: queue.Queue[Any] | None = None
        self._tokens = 0
        self._rate = (clock(), 0)  # (time, tokens) at the last values() call
        self._tokens_per_second = float("nan")
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.dataset.batches_per_epoch

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its first batch at the next iteration."""
        if type(epoch) is not int or epoch < 0:
            raise ValueError(f"epoch must be an integer >= 0, got {epoch!r}")
        self.epoch, self.batch = epoch, 0

    def quarantine(self, ids: Iterable[int]) -> None:
        """Leave the samples ``ids`` (global sequence numbers) out of every batch from the next
        pass on, and after a resume (module docstring). ``ValueError`` for a number outside the
        data set."""
        new = {int(i) for i in ids}
        if new and (min(new) < 0 or max(new) >= self.dataset.sequences):
            raise ValueError(f"sequence numbers must lie in [0, {self.dataset.sequences})")
        with self._lock:
            self.dataset.skip = self.dataset.skip | new

    def quarantine_last(self) -> list[int]:
        """Quarantine the samples of the batch the training loop received last; returns them."""
        last = self._last
        if last is None:
            return []
        ids = self.dataset.sequence_ids(*last).tolist()
        self.quarantine(ids)
        return ids

    def located_last(self) -> dict[str, list[int]]:
        """Where the samples of the batch the training loop received last lie, on every rank
        (``{shard base path: [index in the shard]}``): each rank's loader is at the same batch of
        the same epoch, so one rank can name them all; empty before the first batch."""
        last = self._last
        if last is None:
            return {}
        ds = self.dataset
        positions = (last[1] * ds.batch_size + np.arange(ds.batch_size, dtype=np.int64)) * ds.world_size
        everywhere = (positions[:, None] + np.arange(ds.world_size, dtype=np.int64)[None, :]).ravel()
        return ds.locate(ds.order(last[0])(everywhere).tolist())

    def quarantined(self) -> dict[str, list[int]]:
        """The quarantined samples by shard: ``{shard base path: [index in the shard]}``."""
        return self.dataset.locate(self.dataset.skip)

    def state_dict(self) -> dict[str, Any]:
        """The position: epoch and batches received in it (plus what must match to resume), and
        the quarantined samples."""
        ds = self.dataset
        return {"version": 1, "epoch": self.epoch, "batch": self.batch, "seed": ds.seed,
                "rank": ds.rank, "world_size": ds.world_size, "batch_size": ds.batch_size,
                "sequences": ds.sequences, "skip": sorted(ds.skip)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at ``state``'s position. ``ValueError`` for a foreign dict or one saved with
        another seed, rank, world size, batch size or data set."""
        if not isinstance(state, Mapping) or state.get("version") != 1:
            raise ValueError("not a TokenLoader state dict (version 1)")
        ds = self.dataset
        expected = {"seed": ds.seed, "rank": ds.rank, "world_size": ds.world_size,
                    "batch_size": ds.batch_size, "sequences": ds.sequences}
        for key, value in expected.items():
            if state.get(key) != value:
                raise ValueError(f"loader state has {key}={state.get(key)!r}, this loader {value!r}")
        epoch, batch = state.get("epoch"), state.get("batch")
        if type(epoch) is not int or epoch < 0 or type(batch) is not int or not 0 <= batch <= ds.batches_per_epoch:
            raise ValueError(f"loader state has an invalid position: epoch {epoch!r}, batch {batch!r}")
        skip = state.get("skip", [])
        if not isinstance(skip, (list, tuple)) or any(type(i) is not int or not 0 <= i < ds.sequences for i in skip):
            raise ValueError(f"loader state has an invalid skip list (sequence numbers in [0, {ds.sequences}))")
        self.epoch, self.batch = epoch, batch
        ds.skip = frozenset(skip)

    def values(self) -> dict[str, float]:
        """``trainguard_input_prefetch_depth`` (batches ready now) and
        ``trainguard_input_tokens_per_second`` (tokens received since the previous call divided by
        the time since; absent before a second call)."""
        now = self._clock()
        with self._lock:
            tokens = self._tokens
            last_t, last_tokens = self._rate
            if now > last_t:
                self._tokens_per_second = (tokens - last_tokens) / (now - last_t)
                self._rate = (now, tokens)
            rate = self._tokens_per_second
        q = self._queue
        out = {"trainguard_input_prefetch_depth": float(q.qsize()) if q is not None else 0.0}
        if rate == rate:
            out["trainguard_input_tokens_per_second"] = rate
        return out

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self.batch >= self.dataset.batches_per_epoch:
            self.epoch, self.batch = self.epoch + 1, 0
        ds = self.dataset
        ds.epoch, ds.start = self.epoch, self.batch
        loader = DataLoader(ds, batch_size=None, num_workers=self.num_workers, pin_memory=self.pin_memory,
                            prefetch_factor=max(1, self.prefetch // max(self.num_workers, 1)) if self.num_workers else None)
        q: queue.Queue[Any] = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def put(item: Any) -> bool:
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def fill() -> None:
            try:
                for item in loader:
                    if not put(item):
                        return
                put(_END)
            except BaseException as exc:  # handed to the training loop, which raises it
                put(_Failed(exc))

        thread = threading.Thread(target=fill, name="trainguard-token-loader", daemon=True)
        self._queue = q
        thread.start()
        try:
            while True:
                item = q.get()
                if item is _END:
                    break
                if isinstance(item, _Failed):
                    raise item.exc
                with self._lock:
                    self._last = (self.epoch, self.batch)
                    self.batch += 1
                    self._tokens += item["tokens"]
                yield item
            self.epoch, self.batch = self.epoch + 1, 0
        finally:
            stop.set()
            thread.join(timeout=10.0)
            self._queue = None
