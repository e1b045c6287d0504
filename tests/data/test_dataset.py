"""The sharded token dataset (trainer_agent/data/sharded_dataset.py): the on-disk format and its quality
report, the order (a permutation, disjoint across ranks and workers), exact resume, bad input."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer_agent.dataset import (
    Permutation,
    ShardWriter,
    TokenBatches,
    TokenLoader,
    TokenShard,
    worker_seed,
    write_shards,
)

VOCAB = 1000


def _sequences(n: int, seed: int = 0) -> list[np.ndarray]:
    """``n`` sequences of distinct content: the first token is the sequence number (mod VOCAB)
    and the second its quotient, so every sequence is unique."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(3, 40))
        s = rng.integers(0, VOCAB, size=length)
        s[0], s[1] = i % VOCAB, i // VOCAB
        out.append(s)
    return out


def _key(row: torch.Tensor, mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(row[mask.bool()].tolist())


@pytest.fixture
def shards(tmp_path: Path) -> tuple[list, list[np.ndarray]]:
    seqs = _sequences(500)
    infos = write_shards(tmp_path / "ds", seqs, vocab_size=VOCAB, tokens_per_shard=2000)
    return infos, seqs


def test_written_shards_read_back_with_their_quality_report(tmp_path: Path) -> None:
    seqs = _sequences(200)
    dup = [seqs[i] for i in range(10)]  # 10 exact repeats of earlier sequences
    infos = write_shards(tmp_path, seqs + dup, vocab_size=VOCAB, tokens_per_shard=10**9, special_ids=(7,))
    assert len(infos) == 1
    shard = TokenShard(infos[0].path)
    everything = seqs + dup
    assert len(shard) == 210 and shard.tokens == sum(s.size for s in everything)
    for i in (0, 57, 209):
        np.testing.assert_array_equal(shard.sequence(i), everything[i])
    assert shard.data.dtype == np.dtype("<u2")
    meta = json.loads((tmp_path / "shard-00000.json").read_text())
    # independent reference: 10 of the 210 sequences repeat an earlier content
    assert meta["quality"]["trainguard_data_duplicate_ratio"] == pytest.approx(10 / 210)
    flat = np.concatenate(everything)
    assert meta["quality"]["trainguard_data_special_token_ratio"] == pytest.approx(np.mean(flat == 7))
    assert meta["quality"]["trainguard_data_sequences_total"] == 210
    # the byte-level index: offsets in bytes
    idx = np.fromfile(tmp_path / "shard-00000.idx", dtype="<i8").reshape(-1, 2)
    assert idx[1, 0] == 2 * everything[0].size and idx[5, 1] == everything[5].size


def test_text_goes_in_as_utf8_bytes_and_shards_split_by_size(tmp_path: Path) -> None:
    texts = [f"sample {i} — ünïcode" for i in range(50)]
    infos = write_shards(tmp_path, texts, vocab_size=256, tokens_per_shard=300)
    assert len(infos) > 1 and all(i.tokens >= 300 for i in infos[:-1])
    first = TokenShard(infos[0].path)
    assert bytes(first.sequence(3).astype(np.uint8)) == texts[3].encode()
    assert sum(i.sequences for i in infos) == 50


def test_large_vocabulary_uses_uint32(tmp_path: Path) -> None:
    with ShardWriter(tmp_path / "big", vocab_size=100_000, monitor=False) as w:
        w.add([99_999, 70_000, 1])
    shard = TokenShard(tmp_path / "big")
    assert shard.data.dtype == np.dtype("<u4") and shard.sequence(0).tolist() == [99_999, 70_000, 1]


def test_a_numpy_integer_vocabulary_size_is_a_vocabulary_size(tmp_path: Path) -> None:
    """A vocabulary size read from a tokenizer's numpy array (``np.int64``), as the data monitor
    takes it; a bool is no size."""
    with ShardWriter(tmp_path / "np", vocab_size=np.int64(300), monitor=True) as w:
        w.add([299, 7])
    shard = TokenShard(tmp_path / "np")
    assert shard.vocab_size == 300 and type(shard.vocab_size) is int and shard.sequence(0).tolist() == [299, 7]
    with pytest.raises(ValueError, match="vocab_size must be a positive integer"):
        ShardWriter(tmp_path / "bool", vocab_size=True)


@pytest.mark.parametrize("bad, message", [
    ([1, VOCAB], "outside the vocabulary"),
    ([-1, 2], "outside the vocabulary"),
    ([], "empty sequence"),
    ([1.5, 2.0], "integers"),
    ([[1, 2], [3, 4]], "1-D"),
])
def test_writer_refuses_bad_sequences(tmp_path: Path, bad: list, message: str) -> None:
    w = ShardWriter(tmp_path / "s", vocab_size=VOCAB)
    w.add([1, 2, 3])
    with pytest.raises(ValueError, match=message):
        w.add(bad)
    w.add([4, 5])  # the writer is unchanged by the refused sequence
    info = w.close()
    assert info.sequences == 2 and TokenShard(info.path).sequence(1).tolist() == [4, 5]


def test_writer_failures_leave_no_partial_shard(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no sequence"):
        ShardWriter(tmp_path / "empty", vocab_size=VOCAB).close()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError):
        with ShardWriter(tmp_path / "s", vocab_size=VOCAB) as w:
            w.add([1, 2])
            raise RuntimeError("the caller failed")
    assert list(tmp_path.iterdir()) == []
    with ShardWriter(tmp_path / "s", vocab_size=VOCAB) as w:
        w.add([1])
    with pytest.raises(ValueError, match="exists"):
        ShardWriter(tmp_path / "s", vocab_size=VOCAB)
    with pytest.raises(ValueError, match="vocab_size"):
        ShardWriter(tmp_path / "t", vocab_size=0)
    with pytest.raises(ValueError, match="no sequence"):
        write_shards(tmp_path / "none", [], vocab_size=VOCAB)


def test_reader_refuses_foreign_or_corrupt_shards(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a readable"):
        TokenShard(tmp_path / "missing")
    (tmp_path / "foreign.json").write_text('{"format": "something"}')
    with pytest.raises(ValueError, match="not a trainguard-token-shard"):
        TokenShard(tmp_path / "foreign")
    with ShardWriter(tmp_path / "s", vocab_size=VOCAB, monitor=False) as w:
        w.add([1, 2, 3])
        w.add([4, 5])
    idx = tmp_path / "s.idx"
    good = idx.read_bytes()
    idx.write_bytes(good[:-8])
    with pytest.raises(ValueError, match="expected 2"):
        TokenShard(tmp_path / "s")
    entries = np.frombuffer(good, dtype="<i8").copy().reshape(2, 2)
    entries[1] = (6, 100)  # past the end of the .bin
    idx.write_bytes(entries.tobytes())
    shard = TokenShard(tmp_path / "s")
    with pytest.raises(ValueError, match="corrupt index"):
        shard.sequence(1)
    assert shard.sequence(0).tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match="outside"):
        shard.sequence(2)


def test_a_huge_sparse_shard_opens_in_constant_memory(tmp_path: Path) -> None:
    tokens = 1 << 31  # 4 GiB of uint16, sparse: only its last sequence is written
    base = tmp_path / "huge"
    with open(base.with_name("huge.bin"), "wb") as f:
        f.truncate(tokens * 2)
        f.seek(tokens * 2 - 6)
        f.write(np.array([11, 12, 13], dtype="<u2").tobytes())
    n = 1 << 20
    with open(base.with_name("huge.idx"), "wb") as f:
        f.truncate(n * 16)
        f.seek((n - 1) * 16)
        f.write(np.array([tokens * 2 - 6, 3], dtype="<i8").tobytes())
    base.with_name("huge.json").write_text(json.dumps(
        {"format": "trainguard-token-shard", "version": 1, "dtype": "<u2", "vocab_size": 100,
         "sequences": n, "tokens": tokens, "quality": {}}))

    def rss() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = rss()
    shard = TokenShard(base)
    assert shard.sequence(n - 1).tolist() == [11, 12, 13]
    assert rss() - before < 32 << 20  # a few pages, not the 4 GiB file nor the 16 MiB index


@pytest.mark.parametrize("n", [1, 2, 3, 17, 1000, 4097])
def test_permutation_is_a_bijection(n: int) -> None:
    values = Permutation(n, key=42)(np.arange(n))
    assert sorted(values.tolist()) == list(range(n))
    if n >= 17:
        assert values.tolist() != list(range(n))
        assert Permutation(n, key=43)(np.arange(n)).tolist() != values.tolist()


def test_worker_seeds_are_distinct_and_reproducible() -> None:
    grid = [(s, e, r, w) for s in (0, 1) for e in range(3) for r in range(8) for w in range(4)]
    seeds = [worker_seed(*g) for g in grid]
    assert len(set(seeds)) == len(grid)
    assert seeds == [worker_seed(*g) for g in grid]
    assert all(0 <= s < 2**63 for s in seeds)


def test_no_two_rank_worker_pairs_read_the_same_sequence_in_an_epoch(shards) -> None:  # type: ignore[no-untyped-def]
    infos, seqs = shards
    world, workers, bs = 3, 2, 8
    seen: dict[tuple[int, ...], tuple[int, int]] = {}
    total = 0
    for rank in range(world):
        ds = TokenBatches(infos, batch_size=bs, seq_len=64, seed=5, rank=rank, world_size=world)
        for worker in range(workers):
            for b in ds.worker_batches(1, 0, worker, workers):
                batch = ds.batch(1, b)
                for row, mask in zip(batch["input_ids"], batch["attention_mask"]):
                    key = _key(row, mask)
                    assert key not in seen, f"rank {rank} worker {worker} repeats {seen.get(key)}"
                    seen[key] = (rank, worker)
                    total += 1
    assert total == world * bs * (500 // (world * bs))
    contents = {tuple(s.tolist()) for s in seqs}
    assert set(seen) <= contents


def _drain(loader: TokenLoader, n: int) -> list[dict]:
    out = []
    for batch in loader:
        out.append(batch)
        if len(out) == n:
            break
    return out


def _same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["attention_mask"], y["attention_mask"])


def test_order_is_deterministic_and_follows_the_batch_numbers(shards) -> None:  # type: ignore[no-untyped-def]
    infos, _ = shards
    make = lambda seed: TokenLoader(  # noqa: E731
        TokenBatches(infos, batch_size=4, seq_len=32, seed=seed, rank=1, world_size=2), num_workers=2, prefetch=3)
    a, b = list(make(9)), list(make(9))
    _same(a, b)
    ds = TokenBatches(infos, batch_size=4, seq_len=32, seed=9, rank=1, world_size=2)
    _same(a, [ds.batch(0, i) for i in range(ds.batches_per_epoch)])
    other = list(make(10))
    assert not all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, other))
    # sequences longer than seq_len are truncated, shorter ones padded; tokens counts the mask
    assert all(x["tokens"] == int(x["attention_mask"].sum()) for x in a)


@pytest.mark.parametrize("workers", [0, 2])
def test_exact_resume_from_state_dict(shards, workers: int) -> None:  # type: ignore[no-untyped-def]
    infos, _ = shards
    make = lambda: TokenLoader(  # noqa: E731
        TokenBatches(infos, batch_size=8, seq_len=48, seed=3, rank=0, world_size=2), num_workers=workers, prefetch=4)
    per_epoch = 500 // 16
    reference = make()
    never_stopped = list(reference) + list(reference)  # two whole epochs
    assert len(never_stopped) == 2 * per_epoch and reference.epoch == 2

    first = make()
    head = _drain(first, 7)
    state = first.state_dict()
    assert (state["epoch"], state["batch"]) == (0, 7)
    resumed = make()
    resumed.load_state_dict(state)
    tail = list(resumed) + list(resumed)  # rest of epoch 0, then epoch 1
    _same(head + tail[: 2 * per_epoch - 7], never_stopped)

    # a stop inside the second epoch, resumed by a fresh loader
    second = make()
    second.load_state_dict({**state, "epoch": 1, "batch": per_epoch - 2})
    _same(list(second), never_stopped[-2:])


@pytest.mark.parametrize("workers", [0, 2])
def test_the_quarantine_leaves_samples_out_and_survives_a_resume(shards, workers: int) -> None:  # type: ignore[no-untyped-def]
    infos, seqs = shards
    make = lambda: TokenLoader(  # noqa: E731
        TokenBatches(infos, batch_size=8, seq_len=48, seed=3, rank=0, world_size=2), num_workers=workers, prefetch=4)
    clean = list(make())  # the epoch without any quarantine
    first = make()
    head = _drain(first, 5)
    quarantined = first.quarantine_last()  # every rank skipped the step of batch 4 for its data
    ds = first.dataset
    assert quarantined == ds.sequence_ids(0, 4).tolist()
    later = ds.sequence_ids(0, 20).tolist()[:3]  # and three samples further on
    first.quarantine(later)
    state = first.state_dict()
    assert state["skip"] == sorted(set(quarantined) | set(later))
    assert first.quarantined() == ds.locate(state["skip"])
    where = ds.locate(later)  # shard base path -> indices in it, the contents as written
    assert sum(len(v) for v in where.values()) == 3
    starts = {str(i.path): sum(x.sequences for x in infos[:k]) for k, i in enumerate(infos)}
    assert sorted(starts[p] + i for p, idx in where.items() for i in idx) == sorted(later)

    resumed = make()
    resumed.load_state_dict(state)
    tail = list(resumed)
    assert len(head) + len(tail) == len(clean)  # the same number of batches: the ranks stay in step
    for b, (got, ref) in enumerate(zip(tail, clean[5:]), start=5):
        ids = ds.sequence_ids(0, b).tolist()
        out = [i in later for i in ids]
        for row, skip in enumerate(out):
            if skip:  # a padding row the loss does not see
                assert int(got["attention_mask"][row].sum()) == 0 and int(got["input_ids"][row].abs().sum()) == 0
            else:
                assert torch.equal(got["input_ids"][row], ref["input_ids"][row])
        assert got["tokens"] == ref["tokens"] - sum(int(ref["attention_mask"][r].sum()) for r, s in enumerate(out) if s)
    assert sum(1 for b in tail for r in range(8) if int(b["attention_mask"][r].sum()) == 0) == 3
    # a quarantine outside the data set, or a foreign skip list, is refused
    with pytest.raises(ValueError, match="sequence numbers"):
        resumed.quarantine([len(seqs)])
    with pytest.raises(ValueError, match="skip list"):
        make().load_state_dict({**state, "skip": [-1]})


def test_load_state_dict_refuses_another_configuration(shards) -> None:  # type: ignore[no-untyped-def]
    infos, _ = shards
    loader = TokenLoader(TokenBatches(infos, batch_size=8, seq_len=48, seed=3, rank=0, world_size=2), num_workers=0)
    state = loader.state_dict()
    for change in ({"seed": 4}, {"rank": 1}, {"batch_size": 4}, {"version": 2}, {"batch": -1}, {"batch": 10**6},
                   {"epoch": "x"}):
        with pytest.raises(ValueError):
            loader.load_state_dict({**state, **change})
    with pytest.raises(ValueError, match="rank"):
        TokenBatches(infos, batch_size=8, seq_len=48, rank=2, world_size=2)
    with pytest.raises(ValueError, match="no batch"):
        TokenBatches(infos, batch_size=400, seq_len=48, rank=0, world_size=2)
    with pytest.raises(ValueError, match="batch_size"):
        TokenBatches(infos, batch_size=0, seq_len=48)


def test_reader_values_count_the_tokens_received(shards) -> None:  # type: ignore[no-untyped-def]
    infos, _ = shards
    now = [0.0]
    loader = TokenLoader(TokenBatches(infos, batch_size=8, seq_len=48, rank=0, world_size=1),
                         num_workers=0, prefetch=2, clock=lambda: now[0])
    got = _drain(loader, 5)
    now[0] = 2.0
    values = loader.values()
    assert values["trainguard_input_tokens_per_second"] == sum(b["tokens"] for b in got) / 2.0
    assert values["trainguard_input_prefetch_depth"] == 0.0  # not iterating: no queue


@pytest.mark.parametrize("workers", [0, 1])
def test_a_corrupt_index_raises_in_the_training_loop(tmp_path: Path, workers: int) -> None:
    write_shards(tmp_path, _sequences(64), vocab_size=VOCAB, tokens_per_shard=10**9, monitor=False)
    idx = tmp_path / "shard-00000.idx"
    entries = np.fromfile(idx, dtype="<i8").reshape(-1, 2)
    entries[:, 1] = 10**9  # every length past the end of the .bin
    entries.tofile(idx)
    loader = TokenLoader(TokenBatches(tmp_path, batch_size=4, seq_len=8, rank=0, world_size=1), num_workers=workers)
    with pytest.raises(ValueError, match="corrupt index"):
        next(iter(loader))
    assert loader.batch == 0  # nothing was received


def test_a_shard_listed_twice_is_refused(shards) -> None:  # type: ignore[no-untyped-def]
    infos, _ = shards
    base = infos[0].path
    # Each spelling read the shard's sequences twice an epoch (as many sequences as two shards).
    for listed in ([infos[0], infos[0]], [base, infos[1].path, base.with_name(base.name + ".bin")],
                   [base, base.parent / ".." / base.parent.name / base.name]):
        with pytest.raises(ValueError, match="listed twice"):
            TokenBatches(listed, batch_size=2, seq_len=8, rank=0, world_size=1)
    one = TokenBatches(base.with_name(base.name + ".json"), batch_size=2, seq_len=8, rank=0, world_size=1)
    assert one.paths == [base] and one.sequences == infos[0].sequences


def test_an_index_length_that_wraps_the_bounds_check_is_corrupt(tmp_path: Path) -> None:
    with ShardWriter(tmp_path / "s", vocab_size=VOCAB, monitor=False) as w:
        w.add([1, 2, 3])
        w.add([4, 5])
    entries = np.fromfile(tmp_path / "s.idx", dtype="<i8").reshape(2, 2)
    entries[0] = (2, 2**63 - 1)  # offset + length wraps to a negative int64: read as in bounds
    entries.tofile(tmp_path / "s.idx")
    shard = TokenShard(tmp_path / "s")
    with pytest.raises(ValueError, match="corrupt index"):
        shard.sequence(0)
    assert shard.sequence(1).tolist() == [4, 5]


def test_a_description_with_an_infinite_count_is_malformed(tmp_path: Path) -> None:
    with ShardWriter(tmp_path / "s", vocab_size=VOCAB, monitor=False) as w:
        w.add([1, 2, 3])
    meta = (tmp_path / "s.json").read_text().replace('"sequences": 1', '"sequences": Infinity')
    (tmp_path / "s.json").write_text(meta)  # Python's json reads it: int() raised OverflowError
    with pytest.raises(ValueError, match="malformed shard description"):
        TokenShard(tmp_path / "s")


def test_the_documented_import_path_gives_the_modules_own_objects():
    """``trainer_agent.dataset`` (the documented path) re-exports the three modules of the dataset."""
    import trainer_agent.dataset as documented
    from trainer_agent.data import shard_files, sharded_dataset, token_loader

    for module in (shard_files, sharded_dataset, token_loader):
        for name in module.__all__:
            assert getattr(documented, name) is getattr(module, name), name
    assert set(documented.__all__) == {n for m in (shard_files, sharded_dataset, token_loader) for n in m.__all__}


@pytest.mark.parametrize("workers", [0, 1])
def test_a_token_id_outside_the_shards_vocabulary_raises_in_the_training_loop(tmp_path: Path, workers: int) -> None:
    # A corrupt .bin (ids are uint16 for a vocabulary of 1000) handed ids >= vocab_size to the
    # model's embedding: an IndexError there, a device-side assert on CUDA.
    seqs = _sequences(8)
    write_shards(tmp_path, seqs, vocab_size=VOCAB, tokens_per_shard=10**9, monitor=False, prefix="p")
    data = np.fromfile(tmp_path / "p-00000.bin", dtype="<u2")
    victim = 5
    data[sum(len(s) for s in seqs[:victim]) + 2] = 60_000
    data.tofile(tmp_path / "p-00000.bin")
    ds = TokenBatches(tmp_path, batch_size=1, seq_len=64, pad_id=VOCAB + 7, rank=0, world_size=1)
    loader = TokenLoader(ds, num_workers=workers)
    got = []
    with pytest.raises(ValueError, match=f"sequence {victim} holds token id 60000, outside the vocabulary"):
        for batch in loader:
            got.append(batch)
    assert len(got) == int(np.flatnonzero(ds.order(0)(np.arange(8)) == victim)[0])  # the batches before it
    assert all(int(b["input_ids"][b["attention_mask"] == 1].max()) < VOCAB for b in got)  # padding VOCAB + 7 is no token
