"""The cost of a report step's fingerprint projections (``Fingerprinter.layer_values``, one per
report for the gradients and one for the parameters) against the tensor count, at a fixed model
size.

    .venv/bin/python bench/fingerprint_projection.py                       # 100, 1,000, 5,000 tensors
    .venv/bin/python bench/fingerprint_projection.py --tensors 100 5000 --device cuda

A model of ``--elements`` float32 elements in T tensors (T in ``--tensors``; every fifth tensor
a 2-D one whose first dimension the layout's 16 rows do not divide, the others 1-D), one layer per
5 tensors, the squared norms given (the report step has them). Per T: the ATen operators of one
``layer_values`` call once its plan is made (``agent_overhead.OpCounter``: all, views aside, and
the model of their CUDA launches), the thread CPU ms of a call (best of ``--rounds``; on a GPU,
synchronized), the same for the tensors tagged with their settled layout as the agent passes its
parameters and gradients (``staged.Settled``: no shape read per tensor), and on a GPU the kernels
the profiler counts. Run it against another
``trainer_agent`` through ``PYTHONPATH`` to compare.
"""

from __future__ import annotations

import argparse
import time

import torch

from agent_overhead import OpCounter
from trainer_agent.measure.fingerprint import Fingerprinter


def _tensors(elements: int, count: int, device: torch.device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(count)
    each = elements // count
    out = []
    for i in range(count):
        shape = (each // 4, 4) if i % 5 == 4 and each >= 8 else (each,)
        out.append(torch.randn(shape, generator=g).to(device))
    return out


def measure(elements: int, count: int, rounds: int, device: torch.device, settled: bool = False) -> dict[str, float]:
    xs = _tensors(elements, count, device)
    units = torch.arange(count) // 5
    fp = Fingerprinter([x.numel() for x in xs], units, int(units.max()) + 1, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    # the squared norms come with the report step's other statistics (the step's gradient norms)
    sq = torch.stack([x.double().square().sum() for x in xs])
    if settled:  # as the agent passes its parameters and gradients: tagged with their layout
        from trainer_agent.measure import staged

        xs = staged.Settled(xs, staged.Layout(xs))
    fp.layer_values([xs], sq=sq)  # first use: the plan
    with OpCounter() as count_ops:
        fp.layer_values([xs], sq=sq)
    best = float("inf")
    for _ in range(rounds):
        sync()
        t0 = time.thread_time()
        fp.layer_values([xs], sq=sq)
        sync()
        best = min(best, time.thread_time() - t0)
    out = {"ops": count_ops.ops, "computing": count_ops.ops - count_ops.views, "launches": count_ops.launches,
           "ms": best * 1e3}
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fp.layer_values([xs], sq=sq)
            sync()
        out["kernels"] = sum(1 for e in prof.events() if e.device_type.name == "CUDA")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", type=int, nargs="+", default=[100, 1000, 5000])
    ap.add_argument("--elements", type=int, default=2_000_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(1)
    print(f"fingerprint projections of {args.elements:,} float32 elements ({device.type}, torch {torch.__version__})")
    try:
        from trainer_agent.measure.staged import Settled  # noqa: F401
        layouts = True
    except ImportError:  # an older checkout: its lists as they are
        layouts = False
    print("tensors | ops | views aside | CUDA launch model | thread CPU ms | thread CPU ms, settled layout"
          + (" | cuda kernels" if device.type == "cuda" else ""))
    for count in args.tensors:
        m = measure(args.elements, count, args.rounds, device)
        ms = measure(args.elements, count, args.rounds, device, settled=True)["ms"] if layouts else float("nan")
        row = f"{count:,} | {m['ops']} | {m['computing']} | {m['launches']} | {m['ms']:.3f} | {ms:.3f}"
        print(row + (f" | {m['kernels']}" if "kernels" in m else ""), flush=True)


if __name__ == "__main__":
    main()
