"""The sharded token reader (trainer_agent/data/sharded_dataset.py) against a plain numpy.memmap slice loop
and a naive list-of-tensors dataset, side by side in one run; time to the first batch of a 10 GB
shard set; memory held per open shard.

    .venv/bin/python bench/data_pipeline.py [--tokens 64000000] [--repeats 3]

Everything is written to a temporary directory (the 10 GB set sparse: its .bin files are
truncated to size, only the index is real) and deleted at the end.

1. Throughput, tokens/s per core (one process, torch on one thread), on a page-cache-warm shard
   set of ``--tokens`` uint16 tokens in sequences of 256..4096 tokens, batches of 16 x 2048
   (truncated / padded, int64 ids and mask), the same sequences in the same order for all:
   - floor: a Python loop of ``numpy.memmap`` slices copied into a preallocated int64 batch
     (the least a reader of these files must do);
   - ``TokenBatches.batch`` called in a loop (the reader without a loader), and ``TokenLoader``
     with ``num_workers=0`` (the reader plus its prefetch thread);
   - naive: every sequence held as a torch tensor in a Python list, a map-style ``Dataset`` and
     ``DataLoader(batch_size=16)`` with a padding collate (after it has loaded everything).
   Target: TokenBatches >= 0.8x the floor.
2. Time to first batch on a 10 GB set (10 shards of 1 GB, 2,048-token sequences): open +
   first batch, with 0 and with 2 workers.
4. The demo model (``TinyGPT``, batches of 8 x 129 bytes of the standard library's source) trained
   for ``--demo-steps`` steps from a ``TokenLoader`` with 2 workers, the agent attached: the
   input wait per step against the step time (the target: the loader is never why a step waits).
3. Memory per open shard of that set (each shard opened 50 times): Python heap (tracemalloc)
   and resident set growth.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset

from trainer_agent.dataset import TokenBatches, TokenLoader, TokenShard, write_shards

BATCH, SEQ_LEN = 16, 2048


def rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def make_set(root: Path, tokens: int) -> list[Path]:
    rng = np.random.default_rng(0)
    lengths = []
    total = 0
    while total < tokens:
        n = int(rng.integers(256, 4097))
        lengths.append(n)
        total += n

    def sequences():  # type: ignore[no-untyped-def]
        for n in lengths:
            yield rng.integers(0, 50_257, size=n, dtype=np.int64)

    infos = write_shards(root, sequences(), vocab_size=50_257, tokens_per_shard=tokens // 4, monitor=False)
    for info in infos:  # warm the page cache: the benchmark measures the CPU, not the disk
        (info.path.with_name(info.path.name + ".bin")).read_bytes()
    return [i.path for i in infos]


def floor(ds: TokenBatches, batches: int) -> tuple[float, int]:
    """Plain memmap slices for the same sequences (their ids and index entries precomputed)."""
    shards = ds.shards()
    maps = [np.memmap(p.with_name(p.name + ".bin"), dtype="<u2", mode="r") for p in ds.paths]
    plan = []
    for b in range(batches):
        ids = ds.sequence_ids(0, b)
        which = np.searchsorted(ds._starts, ids, side="right") - 1
        rows = []
        for i, s in zip(ids.tolist(), which.tolist()):
            off, n = shards[s].index[i - ds._starts[s]]
            rows.append((maps[s], int(off) // 2, min(int(n), SEQ_LEN)))
        plan.append(rows)
    tokens = 0
    start = time.perf_counter()
    for rows in plan:
        ids = np.zeros((BATCH, SEQ_LEN), dtype=np.int64)
        mask = np.zeros((BATCH, SEQ_LEN), dtype=np.int64)
        for r, (data, off, n) in enumerate(rows):
            ids[r, :n] = data[off: off + n]
            mask[r, :n] = 1
            tokens += n
    return time.perf_counter() - start, tokens


def reader(ds: TokenBatches, batches: int) -> tuple[float, int]:
    tokens = 0
    start = time.perf_counter()
    for b in range(batches):
        tokens += ds.batch(0, b)["tokens"]
    return time.perf_counter() - start, tokens


def loader(ds: TokenBatches, batches: int, workers: int) -> tuple[float, int]:
    ld = TokenLoader(ds, num_workers=workers, prefetch=8, pin_memory=False)
    tokens, n = 0, 0
    it = iter(ld)
    first = next(it)  # worker start-up is not throughput
    start = time.perf_counter()
    for batch in it:
        tokens += batch["tokens"]
        n += 1
        if n == batches:
            break
    elapsed = time.perf_counter() - start
    del it, first
    return elapsed, tokens


class ListDataset(Dataset):
    def __init__(self, seqs: list[torch.Tensor]) -> None:
        self.seqs = seqs

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.seqs[i]


def collate(seqs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    seqs = [s[:SEQ_LEN] for s in seqs]
    ids = pad_sequence(seqs, batch_first=True)
    ids = torch.nn.functional.pad(ids, (0, SEQ_LEN - ids.shape[1]))
    mask = (torch.arange(SEQ_LEN)[None, :] < torch.tensor([len(s) for s in seqs])[:, None]).long()
    return {"input_ids": ids, "attention_mask": mask}


def naive(ds: TokenBatches, batches: int) -> tuple[float, int]:
    shards = ds.shards()
    seqs = [torch.from_numpy(s.data[o // 2: o // 2 + n].astype(np.int64)) for s in shards for o, n in s.index]
    order = np.concatenate([ds.sequence_ids(0, b) for b in range(batches)]).tolist()
    dl = DataLoader(ListDataset(seqs), batch_size=BATCH, sampler=order, collate_fn=collate, num_workers=0)
    tokens = 0
    start = time.perf_counter()
    for batch in dl:
        tokens += int(batch["attention_mask"].sum())
    return time.perf_counter() - start, tokens


def ten_gb(root: Path) -> list[Path]:
    per_shard = 1 << 29  # tokens: 1 GiB of uint16
    n = per_shard // SEQ_LEN
    paths = []
    for k in range(10):
        base = root / f"big-{k:02d}"
        with open(base.with_name(base.name + ".bin"), "wb") as f:
            f.truncate(per_shard * 2)
        index = np.empty((n, 2), dtype="<i8")
        index[:, 0] = np.arange(n, dtype=np.int64) * SEQ_LEN * 2
        index[:, 1] = SEQ_LEN
        index.tofile(base.with_name(base.name + ".idx"))
        base.with_name(base.name + ".json").write_text(
            '{"format": "trainguard-token-shard", "version": 1, "dtype": "<u2", "vocab_size": 50257, '
            f'"sequences": {n}, "tokens": {per_shard}, "quality": {{}}}}')
        paths.append(base)
    return paths


def first_batch(paths: list[Path], workers: int) -> float:
    start = time.perf_counter()
    ld = TokenLoader(TokenBatches(paths, batch_size=BATCH, seq_len=SEQ_LEN, seed=1, rank=0, world_size=1),
                     num_workers=workers, pin_memory=False)
    it = iter(ld)
    next(it)
    elapsed = time.perf_counter() - start
    del it
    return elapsed


def demo_wait(root: Path, steps: int) -> None:
    import trainer_agent as ta
    from trainguard.demo.model import TinyGPT, next_byte_loss, stdlib_source_bytes

    data = np.frombuffer(stdlib_source_bytes(), dtype=np.uint8)
    write_shards(root, (data[i: i + 129] for i in range(0, data.size - 129, 129)), vocab_size=256,
                 tokens_per_shard=1 << 20, monitor=False)
    torch.manual_seed(0)
    model = TinyGPT(seq_len=128)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = TokenLoader(TokenBatches(root, batch_size=8, seq_len=129, seed=0, rank=0, world_size=1),
                         num_workers=2, prefetch=8, pin_memory=False)
    agent = ta.attach(model, opt, job="bench", run="bench-1", loader=loader, config=ta.AgentConfig(report_every=10, metrics_port=None))
    waits, durations = [], []
    it = iter(loader)
    for step in range(steps):
        batch = next(it)
        loss = next_byte_loss(model, batch["input_ids"], batch["attention_mask"])
        loss.backward()
        opt.step()
        opt.zero_grad()
        agent.end_step(loss.detach(), tokens=batch["tokens"])
        if step >= 10 and (step + 1) % 10 == 0:  # reports after the workers' start-up
            values = agent.latest()
            waits.append(values["trainguard_input_wait_seconds"])
            durations.append(values["trainguard_step_duration_seconds"])
    del it
    agent.close()
    wait, step_time = float(np.median(waits)), float(np.median(durations))
    print(f"demo model, {steps} steps from a TokenLoader with 2 workers: input wait per step "
          f"{wait * 1e3:.2f} ms (median of reports), step time {step_time * 1e3:.1f} ms "
          f"({wait / step_time:.1%} of the step)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--demo-steps", type=int, default=120)
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="trainguard-bench-"))
    try:
        paths = make_set(root / "small", args.tokens)
        ds = TokenBatches(paths, batch_size=BATCH, seq_len=SEQ_LEN, seed=1, rank=0, world_size=1)
        batches = ds.batches_per_epoch
        runs = {
            "floor: numpy.memmap slice loop": lambda: floor(ds, batches),
            "TokenBatches.batch loop": lambda: reader(ds, batches),
            "TokenLoader, num_workers=0": lambda: loader(ds, batches - 1, 0),
            "naive list of tensors + DataLoader": lambda: naive(ds, batches),
        }
        best: dict[str, float] = {}
        for _ in range(args.repeats):  # interleaved: the same machine load for each
            for name, fn in runs.items():
                elapsed, tokens = fn()
                best[name] = max(best.get(name, 0.0), tokens / elapsed)
        ref = best["floor: numpy.memmap slice loop"]
        print(f"throughput, {batches} batches of {BATCH}x{SEQ_LEN} from {ds.tokens / 1e6:.0f}M tokens "
              f"in {len(paths)} shards (best of {args.repeats}, one core)")
        for name, rate in best.items():
            print(f"  {name:40s} {rate / 1e6:8.1f} M tokens/s   {rate / ref:5.2f}x floor")
        two, tokens = loader(ds, batches - 1, 2)
        print(f"  {'TokenLoader, num_workers=2 (2 cores)':40s} {tokens / two / 1e6:8.1f} M tokens/s   "
              f"{tokens / two / ref:5.2f}x floor")
        ok = best["TokenBatches.batch loop"] >= 0.8 * ref
        print(f"  target >= 0.8x floor: {'met' if ok else 'NOT met'}")
        shutil.rmtree(root / "small")

        (root / "big").mkdir()
        big = ten_gb(root / "big")
        size = sum(p.with_name(p.name + ".bin").stat().st_size for p in big)
        before = rss()
        tracemalloc.start()
        opened = [TokenShard(p) for _ in range(50) for p in big]  # 500 open: above the page resolution
        heap = tracemalloc.get_traced_memory()[0] / len(opened)
        tracemalloc.stop()
        per_shard = (rss() - before) / len(opened)
        print(f"10 GB set ({size / 1e9:.1f} GB in {len(big)} shards, sparse):")
        print(f"  memory per open shard: {heap / 1024:.1f} KiB of Python heap (tracemalloc), "
              f"{per_shard / 1024:.1f} KiB resident set growth")
        del opened
        for workers in (0, 2):
            print(f"  time to first batch, num_workers={workers}: {first_batch(big, workers) * 1e3:.0f} ms")
        shutil.rmtree(root / "big")
        demo_wait(root / "demo", args.demo_steps)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
