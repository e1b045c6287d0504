"""How the agent's per-step cost grows with the number of parameter tensors, at a fixed model size.

    .venv/bin/python bench/agent_scale.py                        # tensors 100, 1000, 5000 (~1 min)
    .venv/bin/python bench/agent_scale.py --tensors 100 5000 --device cuda
    .venv/bin/python bench/agent_scale.py --ddp                  # the same under DDP, 2 gloo ranks
    .venv/bin/python bench/agent_scale.py --ddp --bucket-view    # DDP(gradient_as_bucket_view=True)
    .venv/bin/python bench/agent_scale.py --ddp --bucket-view --device cuda   # one GPU: DDP on 1 NCCL rank
    .venv/bin/python bench/agent_scale.py --fsdp                 # FSDP2, 2 gloo ranks, flat buffers and not

A model of ``--elements`` parameters split into T tensors (T in ``--tensors``) trains with SGD
(``foreach``: a constant number of operators whatever T) in two copies, one step each per round,
interleaved so that both see the same machine: a plain step and a step with the agent in its
default configuration (``report_every=10``). Per T it prints, for ordinary steps and for report
steps apart:

- ``agent ops``: ATen operators the agent adds to a step (dispatched inside a step with the agent
  minus a plain step; a ``torch._foreach_*`` call counts once; on a GPU each is a kernel launch),
  counted with a ``TorchDispatchMode``, which a loaded machine does not move, all of them and
  with views aside (``views aside``: operators that only make a view launch no kernel on a
  GPU; the target counts launches). On the CPU they are
  counted on the agent's accelerator formulations (``agent_overhead.accelerator_paths``): the
  CPU's own paths for large or many tensors work through cache-sized chunks, a number of
  operators that follows the elements (loops, not launches), never the tensor count;
- ``CUDA launch model``: the kernels those operators would launch on CUDA by
  ``agent_overhead.cuda_launches``, where a ``torch._foreach_*`` call launches once per ~110
  tensors (ATen's multi-tensor constants) and a ``stack`` once per 128 inputs; a model on the
  CPU, printed beside the profiler's count (``cuda kernels``) with ``--device cuda``;
- ``agent CPU ms``: the training thread's CPU time (``time.thread_time``) of a step with the agent
  minus that of a plain step, medians over the rounds: what another process on the machine does
  not move, unlike wall time.

``--ddp`` runs both copies under ``DistributedDataParallel`` on 2 gloo ranks (CPU) and prints rank
0's figures: every report step then also fingerprints every layer and measures the noise scale's
incoming gradients before the all-reduce. ``--bucket-view`` makes the gradients views of DDP's
flat buckets (``gradient_as_bucket_view=True``), from which the agent takes an ordinary step's
norm (``trainer_agent/measure/bucket_views.py``). With ``--device cuda`` DDP runs on one GPU, a
world of one NCCL rank (the same buckets and reducer), so that the kernels are counted.

``--fsdp`` runs both copies under FSDP2 on 2 gloo ranks (``fully_shard`` on each of ``--groups``
blocks of the tensors, then on the root) and prints rank 0's figures twice per T: with an ordinary
step's norm from FSDP2's flat gradient buffers (``trainer_agent/measure/fsdp_grad_buffers.py``) and
with that path turned off (the norm per tensor), measured one after the other in the same process.
Its time columns are the agent's own (``Agent.overhead_seconds_total``, medians per step): the
difference of two FSDP2 steps' thread CPU times scatters by more than the agent's cost there.

``--rows`` prints instead the report step's row against the world size W and the depth (layers):
its float64 values per rank (the desired state, the fields, the fingerprints' screen, the data
sketch: ``RankExchange``'s layout for a data-parallel run with a controller) and the bytes each
rank receives in the all-gather, beside the row that carried every layer's fingerprints (3 values
per layer) before the screen.

``--device cuda`` also counts CUDA kernel launches with the profiler (``cuda kernels``). The
design target: ordinary steps flat in T (at most 10 operators, 0.1 ms at 5,000 tensors), report
steps at most 100 operators at 5,000 tensors.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import trainer_agent as ta  # noqa: E402
from agent_overhead import OpCounter, accelerator_paths  # noqa: E402


class Split(nn.Module):
    """``elements`` parameters in ``tensors`` vectors; the loss touches each once (one fused
    multiply-add per tensor in the forward: the plain step's own cost, subtracted below)."""

    def __init__(self, elements: int, tensors: int) -> None:
        super().__init__()
        size = max(1, elements // tensors)
        g = torch.Generator().manual_seed(0)
        self.parts = nn.ParameterList([nn.Parameter(torch.randn(size, generator=g) * 0.02) for _ in range(tensors)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = torch.cat(list(self.parts))
        return (flat * x[: flat.numel()]).square().sum()


class Blocks(nn.Module):
    """The same ``elements`` in ``tensors`` vectors, held by ``groups`` modules (one FSDP2 group
    each under ``--fsdp``: FSDP2 gathers a module's parameters in its forward)."""

    class Block(nn.Module):
        def __init__(self, sizes: list[int], gen: torch.Generator) -> None:
            super().__init__()
            self.parts = nn.ParameterList([nn.Parameter(torch.randn(n, generator=gen) * 0.02) for n in sizes])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            flat = torch.cat(list(self.parts))
            return (flat * x[: flat.numel()]).square().sum()

    def __init__(self, elements: int, tensors: int, groups: int) -> None:
        super().__init__()
        size = max(1, elements // tensors)
        g = torch.Generator().manual_seed(0)
        per = [tensors // groups + (i < tensors % groups) for i in range(groups)]
        self.blocks = nn.ModuleList(Blocks.Block([size] * n, g) for n in per)
        self.offsets = [size * sum(per[:i]) for i in range(groups)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(block(x[offset:]) for block, offset in zip(self.blocks, self.offsets))


def _run(fn) -> None:
    """``fn()``, with no kernel count (a step off CUDA)."""
    fn()


def _kernels(fn) -> int:
    """The CUDA kernels (and copies, fills) ``fn`` launches, by the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def measure(elements: int, tensors: int, rounds: int, device: str, ddp: bool = False,
            bucket_view: bool = False, fsdp_groups: int = 0, set_to_none: bool = False,
            kernels=None) -> dict[str, float]:
    """The agent's operators, modeled launches and CPU time per ordinary and per report step (see
    the module docstring); ``kernels(fn)``: the CUDA kernels ``fn`` launches (:func:`_kernels`), or
    None. The kernels are counted on the very steps whose operators are counted, so that the
    report steps keep their place in the interval (an extra profiled step per round put every
    counted step off the report step: no report step was counted, and the table had no row)."""
    base = (Blocks(elements, tensors, fsdp_groups) if fsdp_groups else Split(elements, tensors)).to(device)
    plain, watched = base, copy.deepcopy(base)
    if fsdp_groups:
        from torch.distributed.fsdp import fully_shard

        for model in (plain, watched):
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
    if ddp:
        from torch.nn.parallel import DistributedDataParallel

        plain, watched = (DistributedDataParallel(m, gradient_as_bucket_view=bucket_view) for m in (plain, watched))
    opts = [torch.optim.SGD(m.parameters(), lr=1e-3, foreach=True) for m in (plain, watched)]
    agent = ta.attach(watched, opts[1], job="scale", run=f"scale-{tensors}",
                      config=ta.AgentConfig(metrics_port=None, report_every=10))
    x = torch.randn(elements + tensors, device=device)
    every = agent.config.report_every

    def step(model, opt, with_agent: bool) -> None:
        loss = model(x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        if with_agent:
            agent.end_step(loss)

    rows: dict[str, list[float]] = {"plain_ops": [], "ops": [], "report_ops": [], "plain_ms": [], "ms": [], "report_ms": [],
                                    "plain_kernels": [], "kernels": [], "report_kernels": [],
                                    "plain_computing": [], "computing": [], "report_computing": [],
                                    "plain_launches": [], "launches": [], "report_launches": [],
                                    "own_ms": [], "report_own_ms": []}
    for w in range(2 * every):  # warm-up: first reports, caches, the fused paths
        step(plain, opts[0], False)
        # On the CPU the first half on the accelerator formulations, which lay out the update's
        # snapshot as an accelerator does (one flat buffer for a bucket of many tensors).
        with accelerator_paths() if device == "cpu" and w < every else contextlib.nullcontext():
            step(watched, opts[1], True)
    for r in range(2 * rounds * every):  # operators counted in the first half, CPU time in the second
        report = (agent.step + 1) % every == 0
        if r < rounds * every:
            with OpCounter() as plain_count:
                plain_kernels = (kernels or _run)(lambda: step(plain, opts[0], False))
            with accelerator_paths() if device == "cpu" else contextlib.nullcontext(), OpCounter() as count:
                watched_kernels = (kernels or _run)(lambda: step(watched, opts[1], True))
            if kernels is not None:
                rows["plain_kernels"].append(plain_kernels)
                rows["report_kernels" if report else "kernels"].append(watched_kernels)
            rows["plain_ops"].append(plain_count.ops)
            rows["report_ops" if report else "ops"].append(count.ops)
            rows["plain_computing"].append(plain_count.ops - plain_count.views)
            rows["report_computing" if report else "computing"].append(count.ops - count.views)
            rows["plain_launches"].append(plain_count.launches)
            rows["report_launches" if report else "launches"].append(count.launches)
        else:
            t0 = time.thread_time()
            step(plain, opts[0], False)
            t1 = time.thread_time()
            own = agent.overhead_seconds_total
            step(watched, opts[1], True)
            t2 = time.thread_time()
            rows["plain_ms"].append((t1 - t0) * 1e3)
            rows["report_ms" if report else "ms"].append((t2 - t1) * 1e3)
            rows["report_own_ms" if report else "own_ms"].append((agent.overhead_seconds_total - own) * 1e3)
    agent.close()
    med = {k: statistics.median(v) for k, v in rows.items() if v}
    out = {"ops": med["ops"] - med["plain_ops"], "report_ops": med["report_ops"] - med["plain_ops"],
           "computing": med["computing"] - med["plain_computing"],
           "report_computing": med["report_computing"] - med["plain_computing"],
           "launches": med["launches"] - med["plain_launches"],
           "report_launches": med["report_launches"] - med["plain_launches"],
           "ms": med["ms"] - med["plain_ms"], "report_ms": med["report_ms"] - med["plain_ms"],
           "own_ms": med["own_ms"], "report_own_ms": med["report_own_ms"]}
    if "kernels" in med:
        out["kernels"] = med["kernels"] - med["plain_kernels"]
        out["report_kernels"] = med["report_kernels"] - med["plain_kernels"]
    return out


def _row(label: list[str], m: dict[str, float], time: str = "ms") -> str:
    """One table row: ``label``'s cells, the operator counts, the times (``time``: "ms", the thread
    CPU difference, or "own_ms", the agent's own time) and, where counted, the CUDA kernels."""
    cells = [*label, f"{m['ops']:.0f}", f"{m['report_ops']:.0f}", f"{m['computing']:.0f}",
             f"{m['report_computing']:.0f}", f"{m['launches']:.0f}", f"{m['report_launches']:.0f}",
             f"{m[time]:.3f}", f"{m['report_' + time]:.3f}"]
    if "kernels" in m:
        cells += [f"{m['kernels']:.0f}", f"{m['report_kernels']:.0f}"]
    return " | ".join(cells)


def _rank(rank: int, world: int, init: str, args: argparse.Namespace) -> None:
    """One rank of ``--ddp`` or ``--fsdp``; rank 0 prints. Under ``--fsdp`` each T twice: with the
    flat gradient buffers and with their finder turned off (read by the agent at attach)."""
    import torch.distributed as dist

    from trainer_agent.measure import fsdp_grad_buffers

    torch.set_num_threads(1)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", init_method=init, rank=rank, world_size=world)
    for_index = fsdp_grad_buffers.for_index
    paths = (("flat buffers", for_index), ("per tensor", lambda index: None)) if args.fsdp else ((None, for_index),)
    try:
        for t in args.tensors:
            for path, finder in paths:
                fsdp_grad_buffers.for_index = finder
                m = measure(args.elements, t, args.rounds, args.device, ddp=args.ddp, bucket_view=args.bucket_view,
                            fsdp_groups=args.groups if args.fsdp else 0, set_to_none=args.set_to_none,
                            kernels=_kernels if args.device == "cuda" else None)
                if rank == 0:
                    print(_row([f"{t:,}"] + ([path] if path else []), m, "own_ms" if args.fsdp else "ms"), flush=True)
    finally:
        fsdp_grad_buffers.for_index = for_index
        dist.destroy_process_group()


def rows_table(worlds: tuple[int, ...] = (8, 512, 4096, 32768), depths: tuple[int, ...] = (15, 131)) -> None:
    """The report row per rank and the all-gather's bytes per rank (see the module docstring)."""
    from trainer_agent.measure.fingerprint import Fingerprinter
    from trainer_agent.measure.fingerprint_screen import screen_width
    from trainer_agent.report.exchange import RankExchange

    print("layers | W | row values per-layer -> screen | all-gather MB per rank per-layer -> screen")
    for layers in depths:
        fp = Fingerprinter([64] * layers, torch.arange(layers), layers, device=torch.device("cpu"))
        for world in worlds:
            wide, narrow = (RankExchange(world, with_state=True, extra_width=w).width
                            for w in (fp.width(), screen_width(fp)))
            print(f"{layers} | {world:,} | {wide} -> {narrow} | {world * wide * 8 / 1e6:.2f} -> "
                  f"{world * narrow * 8 / 1e6:.2f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", type=int, nargs="+", default=[100, 1000, 5000])
    ap.add_argument("--elements", type=int, default=2_000_000, help="model size, split over the tensors")
    ap.add_argument("--rounds", type=int, default=3, help="report intervals measured per size")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--ddp", action="store_true", help="under DDP: 2 gloo ranks on the CPU, 1 NCCL rank with --device cuda")
    ap.add_argument("--bucket-view", action="store_true", help="with --ddp: gradient_as_bucket_view=True")
    ap.add_argument("--set-to-none", action="store_true",
                    help="zero_grad() as training loops call it (gradients set to None); default: zeroed in place")
    ap.add_argument("--fsdp", action="store_true", help="under FSDP2: 2 gloo ranks, the flat buffers' path and not")
    ap.add_argument("--groups", type=int, default=8, help="with --fsdp: fully_shard groups (blocks of the tensors)")
    ap.add_argument("--rows", action="store_true", help="the report row and the all-gather's bytes per rank")
    args = ap.parse_args()
    if args.rows:
        rows_table()
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("agent_scale: --device cuda, but no CUDA device is available")
    if args.fsdp and args.ddp:
        sys.exit("agent_scale: --fsdp and --ddp are two runs: give one")
    if args.bucket_view and not args.ddp:
        sys.exit("agent_scale: --bucket-view is a DDP setting: add --ddp")
    torch.set_num_threads(1)
    cols = ["tensors", "agent ops/step", "agent ops/report step", "views aside/step", "views aside/report step",
            "CUDA launch model/step", "CUDA launch model/report step", "agent CPU ms/step", "agent CPU ms/report step"]
    if args.device == "cuda":
        cols += ["cuda kernels/step", "cuda kernels/report step"]
    if args.fsdp:
        import tempfile

        import torch.multiprocessing as mp

        if args.device != "cpu":
            sys.exit("agent_scale: --fsdp runs on 2 gloo ranks on the CPU")
        print(f"agent cost against the tensor count ({args.elements:,} parameters, FSDP2 on 2 gloo ranks, "
              f"{args.groups} groups, rank 0, torch {torch.__version__})")
        print(" | ".join(cols[:1] + ["ordinary step's norm"] + cols[1:7] + ["agent's own ms/step", "agent's own ms/report step"]))
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_rank, args=(2, f"file://{tmp}/store", args), nprocs=2)
        return
    if args.ddp:
        import tempfile

        import torch.multiprocessing as mp

        views = (", gradient_as_bucket_view" if args.bucket_view else "") + (", zero_grad() to None" if args.set_to_none else "")
        if args.device == "cuda":  # one GPU: DDP over NCCL in a world of one, its buckets and reducer all the same
            print(f"agent cost against the tensor count ({args.elements:,} parameters, DDP on 1 NCCL rank{views}, "
                  f"torch {torch.__version__})")
            print(" | ".join(cols))
            with tempfile.TemporaryDirectory() as tmp:
                _rank(0, 1, f"file://{tmp}/store", args)
            return
        print(f"agent cost against the tensor count ({args.elements:,} parameters, DDP on 2 gloo ranks{views}, rank 0, "
              f"torch {torch.__version__})")
        print(" | ".join(cols))
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_rank, args=(2, f"file://{tmp}/store", args), nprocs=2)
        return
    print(f"agent cost against the tensor count ({args.elements:,} parameters, {args.device}, torch {torch.__version__})")
    print(" | ".join(cols))
    for t in args.tensors:
        m = measure(args.elements, t, args.rounds, args.device, set_to_none=args.set_to_none,
                    kernels=_kernels if args.device == "cuda" else None)
        print(_row([f"{t:,}"], m), flush=True)


if __name__ == "__main__":
    main()
