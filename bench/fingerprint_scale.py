"""The cross-rank fingerprint comparison (``trainer_agent.measure.fingerprint.desync``) and its
whole-model screen (``trainer_agent/report/fingerprint_rounds.py``) against the world size.

    .venv/bin/python bench/fingerprint_scale.py                    # W 512, 4096, 32768; 32 and 131 layers
    .venv/bin/python bench/fingerprint_scale.py --world 512 4096 --layers 32

Synthetic gathered fingerprint parts (K = 2 projections and a norm per layer, gradients and
parameters, as the float32 pairs of the report row) of W data-parallel ranks in sync, and the same with one rank whose gradient differs in
one layer. Per case: the thread CPU time (``time.thread_time``, median of ``--rounds``) of the host
comparison (a majority by one linear pass, only the differing ranks compared) side by side with
the comparison by sorting every group's values (the device path, and the host path before), and
their ratio. Both return the same vector (checked).

The screen's columns: the float64 values each rank's row carries for the fingerprints, per-layer
(every layer's K + 1 values of both kinds, as float32 pairs) against the screen (K + 1 per kind and
replica layout), and the bytes every rank then receives in the report step's all-gather for them;
the thread CPU ms of the check every rank runs on the gathered screens (``FingerprintRounds.differ``)
and of the leader's comparison of the screens; and whether the per-layer rows were then gathered
(to the leader only, which compares them as in the first columns).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from trainer_agent.measure.fingerprint import Fingerprinter, desync
from trainer_agent.report.exchange import RANK_FIELDS
from trainer_agent.measure.fingerprint_screen import Screen
from trainer_agent.report.fingerprint_rounds import FingerprintRounds


def _rows(world: int, layers: int, k: int, bad: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(world + layers)
    one = torch.randn(2, layers, k + 1, generator=g, dtype=torch.float32)
    one[..., k] = one[..., k].abs() + 1
    rows = one.reshape(1, -1).repeat(world, 1)
    if bad:
        rows.view(world, 2, layers, k + 1)[world // 3, 0, layers // 2, 0] += 1e-3
    return rows.view(torch.float64)  # the gathered float32 pairs (Fingerprinter.row)


def _screens(rows: torch.Tensor, world: int, layers: int, k: int) -> tuple[FingerprintRounds, torch.Tensor]:
    """The rounds of a ``layers``-layer model and every rank's screen of its per-layer ``rows``."""
    fp = Fingerprinter([64] * layers, torch.arange(layers), layers, projections=k, device=torch.device("cpu"))
    rounds = FingerprintRounds(fp, world=world, rank=0, tol=1e-5)
    values = rows.view(torch.float32).view(world, 2, layers, k + 1).to(torch.float64)
    distinct, inverse = values.reshape(world, -1).unique(dim=0, return_inverse=True)
    screens = torch.stack([rounds.screen.row(v.view(2, layers, k + 1)) for v in distinct])[inverse]
    return rounds, screens


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
    print("W | layers | ranks | majority ms | sorting ms | ratio | row values per-layer -> screen "
          "| gather MB per rank per-layer -> screen | every rank's check ms | leader's screen ms | per-layer gathered")
    for layers in args.layers:
        for world in args.world:
            for bad in (False, True):
                rows = _rows(world, layers, k, bad)
                fast_ms, fast = _cpu_ms(lambda: desync(rows, layers, k), args.rounds)
                slow_ms, slow = _cpu_ms(lambda: desync(rows, layers, k, by_sorting=True), args.rounds)
                assert torch.equal(fast, slow), "the two comparisons differ"
                rounds, screens = _screens(rows, world, layers, k)
                fields = np.zeros((world, len(RANK_FIELDS)))  # every report built (no NaN row)
                check_ms, differ = _cpu_ms(lambda: rounds.differ(screens.numpy(), fields), args.rounds)
                screen_ms, _ = _cpu_ms(lambda: rounds.screen.compare(screens), args.rounds)
                assert bool(differ) is bad, "the screen's check missed the difference"
                wide, narrow = rows.shape[1], screens.shape[1]
                print(f"{world:,} | {layers} | {'one differs' if bad else 'in sync'} | {fast_ms:.1f} | {slow_ms:.1f} | "
                      f"{slow_ms / fast_ms:.1f}x | {wide} -> {narrow} | {world * wide * 8 / 1e6:.1f} -> "
                      f"{world * narrow * 8 / 1e6:.2f} | {check_ms:.2f} | {screen_ms:.2f} | "
                      f"{'yes' if bool(differ) else 'no'}", flush=True)


if __name__ == "__main__":
    main()
