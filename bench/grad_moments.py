"""The gradients' moments of a report step on the CPU: the fused passes beside the chunked pass.

    .venv/bin/python bench/grad_moments.py                # the harness model's gradient sizes
    .venv/bin/python bench/grad_moments.py --rounds 9

``stats.tensor_moments`` (sum, L1, squared norm, max and min |g| per tensor) over tensors of the
sizes of ``bench/agent_overhead.py``'s model (27.4M parameters, float32), one thread: the eight
fused ``torch._foreach_*`` passes (``chunked=False``, the accelerator formulation) and the CPU's
chunked pass through a cached float64 buffer (``trainer_agent/measure/chunked_moments.py``),
alternated round by round so that both see the same machine. Prints the thread CPU medians,
their ratio, and the largest relative difference between the two results per moment (the
chunked sums are float64 throughout).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agent_overhead import GPT  # noqa: E402
from trainer_agent.measure import stats  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=gen) for p in GPT(vocab=8192, d=512, layers=6, seq=128).parameters()]
    cpu, cache = torch.device("cpu"), {}
    times: dict[bool, list[float]] = {False: [], True: []}
    out = {}
    for _ in range(args.rounds + 1):  # the first round warms both up
        for chunked in (False, True):
            t0 = time.thread_time()
            out[chunked], _ = stats.tensor_moments(grads, cpu, chunked=chunked, cache=cache)
            times[chunked].append(time.thread_time() - t0)
    fused, chunked = (statistics.median(times[c][1:]) * 1e3 for c in (False, True))
    n = sum(g.numel() for g in grads)
    print(f"gradient moments of {len(grads)} tensors, {n:,} float32 elements (thread CPU ms, median of "
          f"{args.rounds}; torch {torch.__version__})")
    print(f"fused passes {fused:.1f} ms | chunked {chunked:.1f} ms | ratio {fused / chunked:.1f}x")
    a, b = (out[c].view(len(stats.MOMENTS), -1) for c in (False, True))
    rel = ((a - b).abs() / a.abs().clamp_min(1e-300)).amax(dim=1)
    print("largest relative difference per moment: " + ", ".join(
        f"{name} {float(r):.1e}" for name, r in zip(stats.MOMENTS, rel)))


if __name__ == "__main__":
    main()
