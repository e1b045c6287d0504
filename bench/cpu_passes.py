"""The report step's passes over every tensor on the CPU: the accelerator formulations beside the
CPU's chunked passes, on two sets of tensors.

    .venv/bin/python bench/cpu_passes.py                # ~1 minute
    .venv/bin/python bench/cpu_passes.py --rounds 9

Two passes of a report step, one thread, each in its two formulations alternated round by round
so that both see the same machine:

- the gradients' moments (``stats.tensor_moments``: sum, L1, squared norm, max and min |g| per
  tensor): eight fused ``torch._foreach_*`` passes (``chunked=False``) beside the chunked pass
  (``trainer_agent/measure/chunked_moments.py``);
- the update's squared norms (``stats.update_sq_norms``: ||W_before - W_after||^2, ||W_after||^2,
  ||W_before||^2 per tensor, the snapshot refreshed): an in-place difference and fused norms
  (``chunked=False``) beside the chunked pass (``trainer_agent/measure/chunked_updates.py``);
- the non-finite count of AdamW's state of the same tensors (``stats.nonfinite_count``, two
  moments and a step counter per tensor, none non-finite): the tensors picked by the fused float32
  norm of every tensor (given as ``sq``, as before) beside one dot per large tensor
  (``trainer_agent/measure/nonfinite_scan.py``).

Three sets of float32 tensors: the sizes of ``bench/agent_overhead.py``'s model (77 tensors, 27.4M
elements: large tensors, cut into chunks), 5,000 tensors of 400 elements (2M: small tensors of
one length, packed into chunks) and 2,000 tensors of 200 to 2,199 elements, every length once
(2.4M: packed longest first, the shorter rows of a chunk padded). Prints the thread CPU medians, their ratio, and the largest
relative difference between the two results per value (for the count, both counts).
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

CPU = torch.device("cpu")


def _in_order(values: torch.Tensor, order: list[int]) -> torch.Tensor:
    """``tensor_moments``' blocks with the tensors in their own order."""
    at = torch.empty(len(order), dtype=torch.long)
    at[torch.tensor(order)] = torch.arange(len(order))
    return values.view(len(stats.MOMENTS), len(order))[:, at]


def side_by_side(name: str, run, rounds: int, labels: tuple[str, str] = ("accelerator formulation", "CPU chunked")
                 ) -> tuple[float, float, torch.Tensor, torch.Tensor]:
    """``run(chunked)`` -> (seconds, result), alternated; medians in ms and both last results."""
    times: dict[bool, list[float]] = {False: [], True: []}
    out: dict[bool, torch.Tensor] = {}
    for _ in range(rounds + 1):  # the first round warms both up
        for chunked in (False, True):
            seconds, out[chunked] = run(chunked)
            times[chunked].append(seconds)
    fused, chunked = (statistics.median(times[c][1:]) * 1e3 for c in (False, True))
    print(f"{name}: {labels[0]} {fused:.1f} ms | {labels[1]} {chunked:.1f} ms | ratio {fused / chunked:.2f}x")
    return fused, chunked, out[False], out[True]


def _rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return ((a - b).abs() / a.abs().clamp_min(1e-300)).amax(dim=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    harness = [torch.randn(p.shape, generator=gen) for p in GPT(vocab=8192, d=512, layers=6, seq=128).parameters()]
    many = [torch.randn(400, generator=gen) for _ in range(5000)]
    ragged = [torch.randn(200 + i, generator=gen) for i in range(2000)]
    print(f"thread CPU ms, median of {args.rounds}; torch {torch.__version__}")
    for label, tensors in (("harness model", harness), ("5,000 x 400", many), ("2,000 of 200..2,199", ragged)):
        n = sum(t.numel() for t in tensors)
        print(f"-- {label}: {len(tensors)} tensors, {n:,} float32 elements")
        caches: dict[bool, dict] = {False: {}, True: {}}

        def moments(chunked: bool) -> tuple[float, torch.Tensor]:
            t0 = time.thread_time()
            values, order = stats.tensor_moments(tensors, CPU, chunked=chunked, cache=caches[chunked])
            return time.thread_time() - t0, _in_order(values, order)

        *_, a, b = side_by_side("gradient moments", moments, args.rounds)
        print("  largest relative difference: " + ", ".join(
            f"{m} {float(r):.1e}" for m, r in zip(stats.MOMENTS, _rel(a, b))))
        after = [t + 1e-3 * torch.randn(t.shape, generator=gen) for t in tensors]

        def updates(chunked: bool) -> tuple[float, torch.Tensor]:
            snapshot = [[t.clone() for t in tensors]]  # W_before, overwritten by either pass
            t0 = time.thread_time()
            delta, param, before, _ = stats.update_sq_norms(snapshot, [after], CPU, caches[chunked],
                                                            before_norms=True, refresh=True, chunked=chunked)
            return time.thread_time() - t0, torch.stack([delta, param, before])

        *_, a, b = side_by_side("update norms", updates, args.rounds)
        print("  largest relative difference: " + ", ".join(
            f"{m} {float(r):.1e}" for m, r in zip(("delta_sq", "param_sq", "before_sq"), _rel(a, b))))
        state = _adamw_state(tensors)

        def state_check(dots: bool) -> tuple[float, torch.Tensor]:
            t0 = time.thread_time()
            sq = None if dots else stats.sq_norms([t for t in state if t.is_floating_point()], CPU)  # as before
            count = stats.nonfinite_count(state, CPU, sq)
            return time.thread_time() - t0, count

        *_, a, b = side_by_side("optimizer state non-finite count", state_check, args.rounds,
                                ("fused norm of every tensor", "dots"))
        print(f"  counts: {float(a):g}, {float(b):g}")


def _adamw_state(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """AdamW's state for parameters shaped like ``tensors`` after one step, as the report reads it
    (``step``, ``exp_avg``, ``exp_avg_sq`` per parameter)."""
    params = [torch.zeros(t.shape, requires_grad=True) for t in tensors]
    for p, t in zip(params, tensors):
        p.grad = t
    opt = torch.optim.AdamW(params)
    opt.step()
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


if __name__ == "__main__":
    main()
