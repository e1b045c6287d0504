"""The agent's host work on an ordinary step against the tensor count, as a GPU would see it.

    .venv/bin/python bench/ordinary_step_host.py                     # tensors 100, 1000, 5000 (~1 min)
    PYTHONPATH=/path/to/other/checkout .venv/bin/python bench/ordinary_step_host.py   # that code's
    .venv/bin/python bench/ordinary_step_host.py --gc --tensors 100 5000   # garbage collections, agent on and off

On a GPU an ordinary step's work on the device is a handful of asynchronous launches (the
modeled counts of ``bench/agent_scale.py``); what the training thread pays is the host work
around them: Python, the dispatcher, a launch's own overhead. On the CPU the copy that a CUDA
kernel makes of a bucket of many small gradients (``torch._chunk_cat``) is instead computed
in place on the calling thread, element by element and tensor by tensor, which a GPU run never
pays. So this bench runs the agent's accelerator formulations on the CPU
(``agent_overhead.accelerator_paths``) with that one copy replaced by a preallocated buffer of
its size (what the launch returns at once on a GPU), and prints, per tensor count T (a model of
``--elements`` parameters split into T vectors, SGD, gradients kept between steps or set to None):

- ``agent ms/step``: the agent's own time inside an ordinary step (``overhead_seconds_total``
  on a clock of the thread's CPU time, median over ``--steps`` steps), its backward-end hook and ``end_step`` together; ``agent
  ms/report step`` the same on the report steps (one in 10, the default), without a controller;
- ``read ms``: one Python read of every parameter's ``.grad`` (``[p.grad for p in params]``),
  the floor for any measurement that looks at each step's gradients from Python;
- ``optimizer host ms``: ``torch.optim.SGD(foreach=True).step()`` of the same parameters with
  its kernels as cheap as the stubbed copy (the optimizer's own per-tensor Python: its
  ``_init_group`` reads every parameter's gradient and state every step);
- ``ns/tensor``: the agent's time per tensor above the 100-tensor model's.

Medians of the training thread's time; the machine's load moves them a little, so compare rows
of one run, and runs of two checkouts made one after the other.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import trainer_agent as ta  # noqa: E402
from agent_overhead import accelerator_paths  # noqa: E402
from agent_scale import Split  # noqa: E402
from trainer_agent.agent import Agent  # noqa: E402
from trainer_agent.compat import torch_private  # noqa: E402


@contextlib.contextmanager
def launched_copies():
    """``torch_private.chunk_cat`` returning a buffer of the copy's size without computing it:
    the host side of one CUDA launch (no value read from it matters to the timing)."""
    real = torch_private.chunk_cat
    buffers: dict[tuple, torch.Tensor] = {}

    def stub(tensors, chunks, out=None):
        if out is not None:
            return out
        total = _numel(tensors)
        key = (total, chunks, tensors[0].dtype)
        if key not in buffers:
            buffers[key] = torch.zeros(chunks, -(-total // chunks), dtype=tensors[0].dtype)
        return buffers[key]

    torch_private.chunk_cat = stub
    try:
        yield
    finally:
        torch_private.chunk_cat = real


REPORT_EVERY = 10

_SIZES: dict[int, int] = {}


def _numel(tensors) -> int:
    """The elements of ``tensors``, once per list length (the model's buckets do not change)."""
    n = len(tensors)
    if n not in _SIZES:
        _SIZES[n] = sum(t.numel() for t in tensors)
    return _SIZES[n]


def measure(elements: int, tensors: int, steps: int, set_to_none: bool) -> dict[str, float]:
    model = Split(elements, tensors)
    x = torch.randn(elements + tensors)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=1e-3, foreach=True)
    # The agent's clock on this thread's CPU time: what it spends, not what the machine's load adds.
    agent = Agent(model, opt, job="host", run=f"host-{tensors}", clock=time.thread_time,
                  config=ta.AgentConfig(metrics_port=None, report_every=REPORT_EVERY))
    own, report_own, read, optim = [], [], [], []
    for k in range(steps + 2 * REPORT_EVERY):
        before = agent.overhead_seconds_total
        report = (agent.step + 1) % REPORT_EVERY == 0
        loss = model(x)
        loss.backward()  # the agent's backward-end hook measures the gradients
        t0 = time.thread_time()
        _ = [p.grad for p in params]
        t1 = time.thread_time()
        opt.step()
        t2 = time.thread_time()
        opt.zero_grad(set_to_none=set_to_none)
        agent.end_step(loss.detach())
        if k >= 2 * REPORT_EVERY:  # (the first reports make the staged plans)
            (report_own if report else own).append((agent.overhead_seconds_total - before) * 1e3)
            read.append((t1 - t0) * 1e3)
            optim.append((t2 - t1) * 1e3)
    agent.close()
    return {"own": statistics.median(own), "report": statistics.median(report_own), "read": statistics.median(read),
            "optim": statistics.median(optim)}


def collections(elements: int, tensors: int, steps: int, agent_on: bool, held: int) -> tuple[list[int], float]:
    """Garbage collections per generation over ``steps`` report steps (``report_every=1``) of the
    same model with the agent on or off, in a process holding ``held`` more Python objects (a
    training process's datasets, tokenizers, configs: what a full collection walks), and the
    milliseconds per step they took."""
    import gc

    model = Split(elements, tensors)
    x = torch.randn(elements + tensors)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, foreach=True)
    agent = (Agent(model, opt, job="gc", run=f"gc-{tensors}", config=ta.AgentConfig(metrics_port=None, report_every=1))
             if agent_on else None)
    held_objects = [[i] for i in range(held)]
    counts, spent, started = [0, 0, 0], [0.0], [0.0]

    def watch(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            counts[info["generation"]] += 1
            spent[0] += time.perf_counter() - started[0]

    for k in range(steps + 10):
        if k == 10:  # (the first steps make the plans)
            gc.callbacks.append(watch)
        loss = model(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if agent is not None:
            agent.end_step(loss.detach())
    gc.callbacks.remove(watch)
    if agent is not None:
        agent.close()
    del held_objects
    return counts, spent[0] / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", type=int, nargs="+", default=[100, 1000, 5000])
    ap.add_argument("--elements", type=int, default=200_000)
    ap.add_argument("--steps", type=int, default=100, help="measured steps (one in 10 a report step)")
    ap.add_argument("--set-to-none", action="store_true", help="zero_grad(set_to_none=True) between steps")
    ap.add_argument("--gc", action="store_true",
                    help="instead: garbage collections per 100 report steps, the agent on and off")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.gc:
        print(f"garbage collections per 100 report steps (report_every=1, accelerator formulations, the copy "
              f"launched; 1,000,000 more objects held; trainer_agent from {Path(ta.__file__).resolve().parent})")
        print("tensors | agent | gen 0 | gen 1 | gen 2 (full) | ms/step in collections")
        with accelerator_paths(), launched_copies():
            for t in args.tensors:
                for on in (False, True):
                    (g0, g1, g2), ms = collections(args.elements, t, 100, on, 1_000_000)
                    print(f"{t:,} | {'on' if on else 'off'} | {g0} | {g1} | {g2} | {ms:.3f}", flush=True)
        return
    print(f"agent host work on ordinary steps (accelerator formulations, the copy launched, not computed; "
          f"{args.elements:,} parameters, trainer_agent from {Path(ta.__file__).resolve().parent})")
    print("tensors | agent ms/step | agent ms/report step | read ms | optimizer host ms | ns/tensor (step)")
    base = None
    with accelerator_paths(), launched_copies():
        for t in args.tensors:
            m = measure(args.elements, t, args.steps, args.set_to_none)
            base = (t, m["own"]) if base is None else base
            per = (m["own"] - base[1]) / (t - base[0]) * 1e6 if t != base[0] else float("nan")
            print(f"{t:,} | {m['own']:.3f} | {m['report']:.3f} | {m['read']:.3f} | {m['optim']:.3f} | {per:.0f}",
                  flush=True)


if __name__ == "__main__":
    main()
