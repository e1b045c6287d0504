"""The files of a token shard (``trainer_agent/data/sharded_dataset.py`` describes the format):
:class:`ShardWriter` and :func:`write_shards` build them, with the data monitor run over each
shard so it carries its own quality report; :class:`TokenShard` maps one for reading (a few
kilobytes held per open shard whatever its size; a batch reads only the pages of its own
sequences)."""

from __future__ import annotations
import json
import mmap
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
import numpy as np
import torch

from trainer_agent.data.settings import is_int

__all__ = ["ShardInfo", "ShardWriter", "TokenShard", "byte_tokenizer", "write_shards"]

FORMAT = "trainguard-token-shard"
VERSION = 1
_INDEX_DTYPE = np.dtype("<i8")


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """A shard written by :class:`ShardWriter`."""

    path: Path
    """The shard's base path (``.bin``/``.idx``/``.json`` appended)."""
    sequences: int
    tokens: int
    quality: dict[str, float]


def _dtype_for(vocab_size: int) -> np.dtype:
    if not is_int(vocab_size) or vocab_size < 1:
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
        self.vocab_size = vocab_size = int(vocab_size)  # a numpy integer too (the description is JSON)
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
        base = _base(path)
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
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
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
        # Compared without a sum, which a corrupt length near 2**63 wraps to a negative number.
        if ((offsets < 0) | (lengths < 1) | (offsets % item != 0)
                | (lengths > self.tokens - offsets // item)).any():
            raise ValueError(f"{self.path}.idx: an entry points outside {self.path}.bin (corrupt index)")
        return offsets // item, lengths

    def sequence(self, i: int) -> np.ndarray:
        """Sequence ``i`` (a read-only view into the mapped file)."""
        if not 0 <= i < self.sequences:
            raise ValueError(f"sequence {i} outside [0, {self.sequences})")
        (start,), (length,) = self.entries(np.array([i]))
        return self.data[start: start + length]


def _base(path: str | os.PathLike[str]) -> Path:
    """The base path of a shard given by its base path or by one of its three files."""
    base = Path(path)
    return base.with_suffix("") if base.suffix in (".bin", ".idx", ".json") else base


def _shard_paths(shards: str | os.PathLike[str] | Sequence[Any]) -> list[Path]:
    if isinstance(shards, (str, os.PathLike)):
        root = Path(shards)
        if root.is_dir():
            paths = sorted(p.with_suffix("") for p in root.glob("*.json"))
            if not paths:
                raise ValueError(f"no shard in {root}")
            return paths
        return [_base(root)]
    paths = [_base(s.path if isinstance(s, (ShardInfo, TokenShard)) else s) for s in shards]
    if not paths:
        raise ValueError("no shard given")
    seen: dict[Path, Path] = {}
    for p in paths:
        first = seen.setdefault(p.resolve(), p)
        if first is not p:
            raise ValueError(f"shard {p} is listed twice (also as {first}): an epoch would read its sequences twice")
    return paths
