"""Throughput of DataMonitor.observe_batch, all signals on, on one core.

    .venv/bin/python bench/data_monitor.py [--batches 200] [--repeats 5]

Batches of 8 x 2048 token ids (int64, 50,257-id vocabulary, special ids, a tenth of the rows
right-padded through an attention mask, a few duplicate rows), window 10,000 sequences, reference
frozen from the first 1M tokens, near-duplicates on. Prints tokens/s per core (best of the repeats,
the steady state after the window is full), the cost of one values() call, and the ratio to the
target of 20M tokens/s per core.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from trainer_agent.data import DataMonitor

TARGET = 20e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    vocab, rows, width = 50_257, 8, 2048
    pool = []
    for _ in range(64):
        ids = torch.from_numpy(rng.integers(0, vocab, (rows, width)))
        mask = torch.ones((rows, width), dtype=torch.int64)
        mask[0, rng.integers(1, width):] = 0  # padding in one row of eight
        ids[7] = ids[6]  # one duplicate row
        pool.append((ids, mask))
    monitor = DataMonitor(vocab, special_ids=(0, 1, 2, 50_256), window=10_000, reference_tokens=1_000_000)
    for ids, mask in pool * 20:  # fill the window and freeze the reference
        monitor.observe_batch(ids, mask)
    best = 0.0
    for _ in range(args.repeats):
        tokens = 0
        start = time.perf_counter()
        for i in range(args.batches):
            ids, mask = pool[i % len(pool)]
            monitor.observe_batch(ids, mask)
            tokens += int(mask.sum())
        best = max(best, tokens / (time.perf_counter() - start))
    start = time.perf_counter()
    monitor.observe_batch(*pool[0])
    values = monitor.values()
    values_ms = (time.perf_counter() - start) * 1e3
    print(f"observe_batch: {best / 1e6:.1f}M tokens/s per core (target {TARGET / 1e6:.0f}M: "
          f"{best / TARGET:.2f}x)")
    print(f"values(): {values_ms:.1f} ms with a full 10,000-sequence window")
    for name, value in sorted(values.items()):
        print(f"  {name} = {value:.6g}")


if __name__ == "__main__":
    main()
