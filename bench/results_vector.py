"""Joining fused reductions' 0-dim results into one vector: ``torch.stack`` beside
``trainer_agent.compat.foreach_results.results_vector`` on the CPU's own results (stacked, as
before) and on results laid out as CUDA's ``_foreach_norm`` returns them (views of one buffer,
taken as it is). Best of 5 rounds, thread CPU time per call, one thread.

    .venv/bin/python bench/results_vector.py
"""

from __future__ import annotations

import time

import torch

from trainer_agent.compat.foreach_results import results_vector


def per_call_us(fn, calls: int) -> float:
    best = []
    for _ in range(5):
        t0 = time.thread_time()
        for _ in range(calls):
            fn()
        best.append((time.thread_time() - t0) / calls * 1e6)
    return min(best)


def main() -> None:
    torch.set_num_threads(1)
    print("tensors | torch.stack µs | results_vector, the CPU's results µs | results_vector, one buffer µs")
    for count in (100, 5000):
        results = torch._foreach_norm([torch.randn(4) for _ in range(count)])
        in_one_buffer = list(torch.stack(results).unbind(0))
        calls = 2000 if count == 100 else 200
        row = [per_call_us(lambda: torch.stack(results), calls), per_call_us(lambda: results_vector([results]), calls),
               per_call_us(lambda: results_vector([in_one_buffer]), calls)]
        print(f"{count:,} | " + " | ".join(f"{v:.1f}" for v in row))


if __name__ == "__main__":
    main()
