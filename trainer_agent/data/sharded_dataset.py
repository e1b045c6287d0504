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
import os
import random
from collections.abc import Iterable, Iterator, Sequence


from typing import Any
import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info
from trainer_agent.data.shard_files import TokenShard, _shard_paths
from trainer_agent.data.signals import _mix64 as _mix64_bits

__all__ = ["TokenBatches", "worker_seed", "Permutation"]

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


class TokenBatches(IterableDataset):
    """The batches of one rank for a ``DataLoader(batch_size=None)`` (use :class:`TokenLoader`,
    which keeps the position). Each batch is a dict: ``input_ids`` (int64 ``[batch_size,
    seq_len]``, sequences truncated to ``seq_len`` and padded with ``pad_id``), ``attention_mask``
    (int64, 1 on tokens) and ``tokens`` (the batch's non-padding tokens, an int). See the module
    docstring for the order and the seeds.

    ``rank``/``world_size``: default to the default process group's (0 and 1 without one).
    A batch of a corrupt shard (an index entry outside its ``.bin``, a token id outside its
    vocabulary) is a ``ValueError`` in the training loop, naming the shard and the sequence.
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
        self._vocab_sizes = [s.vocab_size for s in opened]
        self._smallest_vocab = min(self._vocab_sizes)
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
        if tokens and int(np.max(input_ids, where=mask == 1, initial=0)) >= self._smallest_vocab:  # the tokens, not the padding
            self._check_vocabulary(epoch, batch, input_ids, mask)
        return {"input_ids": torch.from_numpy(input_ids), "attention_mask": torch.from_numpy(mask),
                "tokens": tokens}

    def _check_vocabulary(self, epoch: int, batch: int, input_ids: np.ndarray, mask: np.ndarray) -> None:
        """``ValueError`` for a token id outside its shard's vocabulary (a corrupt ``.bin``), which
        would reach the model's embedding."""
        which, _, _ = self._plan(epoch, batch)
        for row, seq in enumerate(self.sequence_ids(epoch, batch).tolist()):
            vocab = self._vocab_sizes[which[row]]
            tokens = input_ids[row][mask[row] == 1]
            if tokens.size and int(tokens.max()) >= vocab:
                (path, (index,)), = self.locate([seq]).items()
                raise ValueError(f"{path}.bin: sequence {index} holds token id {int(tokens.max())}, outside "
                                 f"the vocabulary [0, {vocab}) of {path}.json (a corrupt shard)")

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
