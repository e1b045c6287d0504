"""The cross-rank fingerprint comparison (``trainer_agent.measure.fingerprint.desync``) against the world size.

    .venv/bin/python bench/fingerprint_scale.py                    # W 512, 4096, 32768; 32 and 131 layers
    .venv/bin/python bench/fingerprint_scale.py --world 512 4096 --layers 32

Synthetic gathered fingerprint parts (K = 2 projections and a norm per layer, gradients and
parameters, as the float32 pairs of the report row) of W data-parallel ranks in sync, and the same with one rank whose gradient differs in
one layer. Per case: the thread CPU time (``time.thread_time``, median of ``--rounds``) of the host
comparison (a majority by one linear pass, only the differing ranks compared) side by side with
the comparison by sorting every group's values (the device path, and the host path before), and
their ratio. Both return the same vector (checked).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from trainer_agent.measure.fingerprint import desync


def _rows(world: int, layers: int, k: int, bad: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(world + layers)
    one = torch.randn(2, layers, k + 1, generator=g, dtype=torch.float32)
    one[..., k] = one[..., k].abs() + 1
    rows = one.reshape(1, -1).repeat(world, 1)
    if bad:
        rows.view(world, 2, layers, k + 1)[world // 3, 0, layers // 2, 0] += 1e-3
    return rows.view(torch.float64)  # the gathered float32 pairs (Fingerprinter.row)


def _cpu_ms(fn, rounds: int) -> tuple[float, torch.Tensor]:
    times, out = [], None
    for _ in range(rounds):
        t0 = time.thread_time()
        out = fn()
        times.append((time.thread_time() - t0) * 1e3)
    assert out is not None
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, nargs="+", default=[512, 4096, 32768])
    ap.add_argument("--layers", type=int, nargs="+", default=[32, 131])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    k = 2
    print(f"fingerprint comparison on the host (K = {k}, thread CPU ms, median of {args.rounds}; torch {torch.__version__})")
    print("W | layers | ranks | majority ms | sorting ms | ratio")
    for layers in args.layers:
        for world in args.world:
            for bad in (False, True):
                rows = _rows(world, layers, k, bad)
                fast_ms, fast = _cpu_ms(lambda: desync(rows, layers, k), args.rounds)
                slow_ms, slow = _cpu_ms(lambda: desync(rows, layers, k, by_sorting=True), args.rounds)
                assert torch.equal(fast, slow), "the two comparisons differ"
                print(f"{world:,} | {layers} | {'one differs' if bad else 'in sync'} | {fast_ms:.1f} | {slow_ms:.1f} | "
                      f"{slow_ms / fast_ms:.1f}x", flush=True)


if __name__ == "__main__":
    main()
