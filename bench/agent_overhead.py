"""What the training agent costs a training step, on the CPU.

    .venv/bin/python bench/agent_overhead.py            # ~2-3 minutes
    .venv/bin/python bench/agent_overhead.py --distributed   # DDP and FSDP2, 2 gloo ranks

A GPT-like model of ~27M parameters trains with AdamW in four identical copies, one step each per
round, interleaved so that all four see the same machine: a plain step, a step with the agent in
its default configuration, one with every metric every step (report_every=1, update ratio and
per-layer metrics on every step), and one with a naive reference that computes the same metrics
with a per-parameter ``.item()`` loop. Whole-step A/B ratios scatter by about ±10% on a shared
machine, far more than the effect measured, so the cost is the time spent inside the sections
the agent touches (its gradient hooks, backward-end callback, optimizer step hooks and
``end_step``; on the CPU all work is synchronous, so that time is the work), as recorded by the
agent itself in ``Agent.overhead_seconds_total``, and the naive loop timed around its code.
Costs are the mean per step over whole report intervals (the naive loop runs every 4th
round only); the plain step and the AdamW step (``optimizer.step()`` alone) are medians of the
plain copy's steps. The agent's cost is per parameter, the step's per token: the percentages
scale with 1 / (tokens per step); the default 16 x 128 tokens is a small step for a 27M model. The physical floor is the
number of bytes the metrics must read or write per step divided by the memory bandwidth measured
here with a large copy.

``--distributed``: 2 gloo ranks on the CPU (a smaller model by default, d=256 x 4 blocks) train
six copies interleaved: DDP and FSDP2 (``fully_shard`` per block and at the root), each plain,
with the default agent and with every metric every step. The agent's cost (its own
``overhead_seconds_total``, including its report-step collectives) is given as a share of the
plain step of the same parallelism, DDP beside FSDP2; rank 0 prints, each rank's figures are the
same program's.

``--distributed --comm-timing``: DDP only, the default agent beside the default agent with
``AgentConfig(comm_timing=True)`` (``trainer_agent/measure/comm_timing.py``). Its hook runs inside DDP's
reducer and gloo's threads, outside the agent's own overhead count, so the cost is the whole step
side by side: the ratio of the two copies' median step times, interleaved round by round, and the
communication times the timed copy measured.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import math
import statistics
import time

import torch
from torch import nn
from torch.nn import functional as F

import trainer_agent as ta
from trainer_agent.measure import stats

try:  # (a trainer_agent before the staged passes, measured side by side through PYTHONPATH)
    from trainer_agent.measure import staged
except ImportError:  # pragma: no cover
    staged = None
from trainer_agent.measure.bucket_views import BucketViews
from trainer_agent.measure.fsdp_grad_buffers import FsdpGradBuffers
from trainer_agent.compat import torch_private
from trainer_agent.compat.torch_private import TorchDispatchMode
from torch.utils._python_dispatch import _disable_current_modes  # the emulation below, hidden from the counters


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, seq: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList([
            nn.TransformerEncoderLayer(d, d // 64, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers)
        ])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids[:, :-1]) + self.pos
        for block in self.blocks:
            x = block(x, src_mask=self.mask, is_causal=True)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


class NaiveMetrics:
    """The same metrics, the obvious way: a loop over parameters with a host read per value."""

    def __init__(self, model: nn.Module) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.seconds = 0.0

    def before_step(self) -> None:
        t0 = time.perf_counter()
        self.grad_sq = sum(p.grad.float().norm().item() ** 2 for p in self.params)
        self.nonfinite = sum(int((~torch.isfinite(p.grad)).sum().item()) for p in self.params)
        self.before = [p.detach().clone() for p in self.params]
        self.seconds += time.perf_counter() - t0

    def after_step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        delta_sq = sum((p.detach() - b).norm().item() ** 2 for p, b in zip(self.params, self.before))
        before_sq = sum(b.norm().item() ** 2 for b in self.before)
        param_sq = sum(p.detach().norm().item() ** 2 for p in self.params)
        self.before = []
        out = {"grad_norm": math.sqrt(self.grad_sq), "param_norm": math.sqrt(param_sq),
               "update_ratio": math.sqrt(delta_sq / before_sq), "nonfinite": self.nonfinite}
        self.seconds += time.perf_counter() - t0
        return out


#: CUDA's multi-tensor kernels (``torch._foreach_*``; ATen's ``MultiTensorApply.cuh``): tensors per
#: launch by the number of tensor lists a kernel reads and writes, blocks per launch, elements per block.
MTA_TENSORS = {1: 110, 2: 64, 3: 48, 4: 36, 5: 30}
MTA_BLOCKS, MTA_CHUNK = 320, 65536
#: Inputs per launch of CUDA's ``cat`` (and so ``stack``; ATen's ``Shape.cu``, ``CAT_ARRAY_BATCH_SIZE``).
CAT_BATCH = 128
#: Reductions whose CUDA form adds two launches to its multi-tensor ones (a zero-filled partial buffer
#: and the per-tensor cleanup kernel).
_TWO_STAGE = {"_foreach_norm", "_foreach_max"}
#: Operators of more than one launch whatever their inputs: ``segment_reduce`` with offsets (their
#: ``diff``, then CUB's segmented reduction; ATen's ``SegmentReduce.cu``).
_LAUNCHES = {"segment_reduce": 2}


def cuda_launches(name: str, lists: list[list[torch.Tensor]], is_view: bool) -> int:
    """A model of the kernels CUDA launches for one operator: 0 for a view or an allocation
    (``empty``), ``ceil(inputs / CAT_BATCH)`` for ``cat``/``stack``, for a ``torch._foreach_*``
    call the multi-tensor launches (by its tensors, the lists it reads and writes, and its
    blocks) plus two for a two-stage reduction, 2 for ``segment_reduce``, 1 for any other
    (``_chunk_cat`` too: one kernel for all its contiguous inputs). A model from ATen's constants:
    ``bench/device_check.sh`` prints the profiler's count beside it on a GPU."""
    if is_view or name.startswith("empty"):
        return 0
    if name in ("cat", "stack"):
        return max(1, -(-len(lists[0]) // CAT_BATCH)) if lists else 1
    if not name.startswith("_foreach_") or not lists:
        return _LAUNCHES.get(name, 1)
    depth = len(lists) + (0 if name.endswith("_") or name in _TWO_STAGE else 1)  # an out-of-place op's outputs
    tensors = lists[0]
    blocks = sum(-(-t.numel() // MTA_CHUNK) for t in tensors)
    launches = max(-(-len(tensors) // MTA_TENSORS.get(depth, 30)), -(-blocks // MTA_BLOCKS))
    return launches + (2 if name in _TWO_STAGE else 0)


class OpCounter(TorchDispatchMode):
    """Counts the ATen operators dispatched while active (a ``torch._foreach_*`` call counts once):
    a machine-independent measure of host work. ``ops`` counts every one; ``views`` those that
    only make a view of a tensor (``slice``, ``select``, ``view``, ``detach``...: the schema's
    ``is_view``), which launch no kernel on a GPU, so ``ops - views`` is the GPU's launch count
    where each other operator is one kernel; ``launches``: :func:`cuda_launches`, where a fused
    ``_foreach_*`` call is one launch per ~110 tensors and a ``stack`` one per 128 inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.views = 0
        self.launches = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.views += func.is_view
        lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
        self.launches += cuda_launches(func.overloadpacket.__name__, lists, func.is_view)
        return func(*args, **(kwargs or {}))


def _norms_in_one_buffer(fused):
    """``torch._foreach_norm`` as CUDA returns its results: 0-dim views of one contiguous buffer
    (``ret_per_tensor[i]`` in ATen's ``ForeachReduceOp.cu``), which the agent takes as a vector
    without stacking them (``trainer_agent/compat/foreach_results.py``). The CPU's separate
    results are laid out so with dispatch modes off: the operator counters see the norm only."""
    def norm(tensors, *args, **kwargs):
        results = fused(tensors, *args, **kwargs)
        if len(results) < 2:
            return results
        with _disable_current_modes():
            return list(torch.stack(results).unbind(0))
    return norm


@contextlib.contextmanager
def accelerator_paths():
    """The agent's accelerator formulations, run on the CPU to count their operators: the update
    norms from an in-place difference (not in cache-sized chunks), the non-finite counts by a
    fused scan of every tensor (not only of those whose norm is non-finite), the gradients'
    moments by fused passes over every tensor (not large ones chunk by chunk), DDP's gradient
    buckets and FSDP2's flat gradient buffers normed whole (not row by row), buckets of many
    tensors measured by the staged passes (``staged.ON_CPU``), and the fused norms' results laid
    out as CUDA returns them (:func:`_norms_in_one_buffer`)."""
    update, count, moments = stats.update_sq_norms, stats.nonfinite_count, stats.tensor_moments
    bucket_count = getattr(stats, "bucket_nonfinite", None)  # (absent from older checkouts)
    fused_norm = torch_private.foreach_norm
    stats.update_sq_norms = functools.partial(update, chunked=False)
    stats.nonfinite_count = functools.partial(count, scan="device")
    if bucket_count is not None:
        stats.bucket_nonfinite = functools.partial(bucket_count, scan="device")
    stats.tensor_moments = functools.partial(moments, chunked=False)
    torch_private.foreach_norm = _norms_in_one_buffer(fused_norm)
    BucketViews.cpu_rows = FsdpGradBuffers.cpu_rows = False
    if staged is not None:
        staged.ON_CPU = True
    try:
        yield
    finally:
        stats.update_sq_norms, stats.nonfinite_count, stats.tensor_moments = update, count, moments
        if bucket_count is not None:
            stats.bucket_nonfinite = bucket_count
        torch_private.foreach_norm = fused_norm
        BucketViews.cpu_rows = FsdpGradBuffers.cpu_rows = True
        if staged is not None:
            staged.ON_CPU = False


def bandwidth_gbs(device: torch.device, sync) -> float:
    a = torch.randn(32 << 20, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    times = []
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        b.copy_(a)
        sync()
        times.append(time.perf_counter() - t0)
    return 2 * a.numel() * 4 / min(times) / 1e9


class Sharded(GPT):
    """The GPT with ``forward`` = loss: FSDP2 (and the agent's output hook) act on ``forward``."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.loss(ids)


def _distributed_rank(rank: int, world: int, init: str, args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.manual_seed(0)
    base = Sharded(vocab=8192, d=args.d_model, layers=args.layers, seq=args.seq)
    n = sum(p.numel() for p in base.parameters())
    mesh = init_device_mesh("cpu", (world,))
    configs = {
        "plain": None,
        "default": ta.AgentConfig(metrics_port=None),
        "every metric every step": ta.AgentConfig(metrics_port=None, report_every=1, update_ratio="every",
                                                  per_layer="all"),
    }
    kinds: tuple[str, ...] = ("DDP", "FSDP2")
    if args.comm_timing:
        kinds = ("DDP",)
        configs["default + comm_timing"] = ta.AgentConfig(metrics_port=None, comm_timing=True)
        del configs["every metric every step"]
    runs = {}
    for kind in kinds:
        for name, cfg in configs.items():
            model = copy.deepcopy(base)
            if kind == "DDP":
                model = nn.parallel.DistributedDataParallel(model)
            else:
                for block in model.blocks:
                    fully_shard(block, mesh=mesh)
                fully_shard(model, mesh=mesh)
            opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
            agent = ta.attach(model, opt, job="bench", run="bench-1", config=cfg) if cfg else None
            runs[(kind, name)] = {"model": model, "opt": opt, "agent": agent, "cost": [], "step": []}
    gen = torch.Generator().manual_seed(1 + rank)
    for i in range(args.warmup + args.steps):
        ids = torch.randint(0, 8192, (args.batch, args.seq + 1), generator=gen)
        for run in runs.values():
            model, opt, agent = run["model"], run["opt"], run["agent"]
            before = agent.overhead_seconds_total if agent else 0.0
            t0 = time.perf_counter()
            loss = model(ids)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if agent:
                agent.end_step(loss, tokens=ids.shape[0] * (ids.shape[1] - 1))
            t1 = time.perf_counter()
            if i >= args.warmup:
                run["cost"].append((agent.overhead_seconds_total if agent else 0.0) - before)
                run["step"].append(t1 - t0)
    if rank == 0:
        print(f"model {n / 1e6:.1f}M parameters, {world} gloo ranks, batch {args.batch}x{args.seq} tokens per "
              f"rank, {args.threads} thread(s) per rank, {args.steps} measured rounds after {args.warmup} warm-up")
        print(f"{'parallelism':12s} {'configuration':26s} {'cost/step':>10s} {'% of step':>10s}  plain step (median)")
    for (kind, name), run in runs.items():
        agent = run["agent"]
        if agent is None:
            continue
        assert agent.latest()["trainguard_agent_errors_total"] == 0
        plain = statistics.median(runs[(kind, "plain")]["step"])
        cycle = agent.config.report_every
        cost = run["cost"]
        whole = len(cost) // cycle * cycle or len(cost)
        mean = sum(cost[:whole]) / whole
        if rank == 0:
            print(f"{kind:12s} {name:26s} {mean * 1e3:8.1f}ms {100 * mean / plain:9.2f}%  {plain * 1e3:.0f} ms")
        if agent.config.comm_timing:
            _print_comm_timing(rank, agent, run["step"], runs[(kind, "default")]["step"])
        agent.close()
    dist.destroy_process_group()


def _print_comm_timing(rank: int, agent: ta.Agent, timed: list[float], untimed: list[float]) -> None:
    """Each rank's side-by-side step medians and what the timed copy measured."""
    got = agent.latest()
    ratio = statistics.median(timed) / statistics.median(untimed)
    print(f"rank {rank}: step median with comm_timing / without: {ratio:.3f} "
          f"({statistics.median(timed) * 1e3:.1f} / {statistics.median(untimed) * 1e3:.1f} ms); measured "
          f"comm {got['trainguard_comm_seconds'] * 1e3:.1f} ms/step, exposed "
          f"{got['trainguard_comm_exposed_seconds'] * 1e3:.1f} ms/step "
          f"({100 * got['trainguard_comm_exposed_ratio']:.1f}% of the step)", flush=True)


def distributed_main(args: argparse.Namespace) -> None:
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_distributed_rank, args=(2, f"file://{tmp}/store", args), nprocs=2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="measured rounds (after warm-up)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: whole steps are then timed with a "
                    "synchronize at their end (the agent's device work is asynchronous there)")
    ap.add_argument("--d-model", type=int, default=None, help="default 512 (256 with --distributed)")
    ap.add_argument("--layers", type=int, default=None, help="default 6 (4 with --distributed)")
    ap.add_argument("--distributed", action="store_true",
                    help="DDP beside FSDP2 on 2 gloo ranks (see the module docstring)")
    ap.add_argument("--comm-timing", action="store_true",
                    help="with --distributed: DDP's default agent beside it with comm_timing=True")
    args = ap.parse_args()
    if args.distributed:
        args.d_model = args.d_model or 256
        args.layers = args.layers or 4
        distributed_main(args)
        return
    args.d_model = args.d_model or 512
    args.layers = args.layers or 6
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
    base = GPT(vocab=8192, d=args.d_model, layers=args.layers, seq=args.seq).to(device)
    n = sum(p.numel() for p in base.parameters())
    variants = {
        "plain": None,
        "default": ta.AgentConfig(metrics_port=None),
        "every metric every step": ta.AgentConfig(metrics_port=None, report_every=1, update_ratio="every",
                                                  per_layer="all"),
        "naive .item() loop": "naive",
    }
    runs = {}
    for name, cfg in variants.items():
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
        agent = ta.attach(model, opt, job="bench", run="bench-1", config=cfg) if isinstance(cfg, ta.AgentConfig) else None
        naive = NaiveMetrics(model) if cfg == "naive" else None
        runs[name] = {"model": model, "opt": opt, "agent": agent, "naive": naive, "cost": [], "step": [], "adamw": []}

    def one_step(run: dict, ids: torch.Tensor, measure: bool) -> None:
        model, opt, agent, naive = run["model"], run["opt"], run["agent"], run["naive"]
        before = agent.overhead_seconds_total if agent else naive.seconds if naive else 0.0
        sync()
        t0 = time.perf_counter()
        with autocast:
            loss = model.loss(ids)
        loss.backward()
        if naive:
            naive.before_step()
        sync()
        t1 = time.perf_counter()
        opt.step()
        sync()
        t2 = time.perf_counter()
        if naive:
            naive.after_step()
        opt.zero_grad()
        if agent:
            agent.end_step(loss, tokens=ids.shape[0] * (ids.shape[1] - 1))  # no slice: no operator
        sync()
        t3 = time.perf_counter()
        if measure:
            after = agent.overhead_seconds_total if agent else naive.seconds if naive else 0.0
            run["cost"].append(after - before)
            run["step"].append(t3 - t0)
            run["adamw"].append(t2 - t1)

    gen = torch.Generator().manual_seed(1)
    for i in range(args.warmup + args.steps):
        ids = torch.randint(0, 8192, (args.batch, args.seq + 1), generator=gen).to(device)
        for name, run in runs.items():
            if run["naive"] and i % 4:
                continue  # the naive reference every 4th round only: it is a yardstick, and slow
            one_step(run, ids, measure=i >= args.warmup)

    # Operators per step: a step of each copy under an operator counter, over one whole report
    # interval (any report_every consecutive steps hold exactly one report step), minus the
    # plain step's count. After the timed rounds, so the counter's own cost is not timed.
    # On the CPU, once more with the accelerator formulations (what a GPU step launches).
    ids = torch.randint(0, 8192, (args.batch, args.seq + 1), generator=gen).to(device)
    passes = {"ops/step": contextlib.nullcontext}
    if not cuda:
        passes["GPU path"] = accelerator_paths
    ops: dict[str, dict[str, float]] = {}
    for column, paths in passes.items():
        ops[column] = {}
        for name, run in runs.items():
            cycle = run["agent"].config.report_every if run["agent"] else 1
            with paths(), OpCounter() as counter:
                for _ in range(cycle):
                    one_step(run, ids, measure=False)
            ops[column][name] = counter.ops / cycle - (ops[column]["plain"] if name != "plain" else 0.0)

    plain = statistics.median(runs["plain"]["step"])
    adamw = statistics.median(runs["plain"]["adamw"])
    gbs = bandwidth_gbs(device, sync)
    print(f"model {n / 1e6:.1f}M parameters, batch {args.batch}x{args.seq} tokens, {args.threads} thread(s), "
          f"{device.type}, {args.steps} measured rounds after {args.warmup} warm-up")
    print(f"plain step (median) {plain * 1e3:.0f} ms; AdamW optimizer.step() {adamw * 1e3:.1f} ms; "
          f"memory bandwidth (copy) {gbs:.1f} GB/s")
    print("cost/step: time inside the agent's sections" + (" (host time: the device work is asynchronous)" if cuda else ""))
    print("ops/step: ATen operators the agent dispatches per step (a GPU kernel launch each, views aside)"
          + ("; GPU path: the same with the accelerator formulations" if not cuda else ""))
    print(f"{'configuration':26s} {'cost/step':>10s} {'% of step':>10s} {'x AdamW':>8s} "
          + "".join(f"{column:>9s} " for column in ops) + "  whole-step median (vs plain)")
    for name, run in runs.items():
        if name == "plain":
            continue
        cost = run["cost"]
        if not cost:  # (the naive loop runs every 4th round: none among too few --steps)
            print(f"{name:26s} no measured step (--steps {args.steps} after --warmup {args.warmup})")
            continue
        cycle = run["agent"].config.report_every if run["agent"] else 1
        whole = len(cost) // cycle * cycle or len(cost)  # whole report intervals when there are any
        mean = sum(cost[:whole]) / whole
        print(f"{name:26s} {mean * 1e3:8.1f}ms {100 * mean / plain:9.2f}% {mean / adamw:8.2f} "
              + "".join(f"{ops[column][name]:9.1f} " for column in ops) + "  "
              f"{statistics.median(run['step']) * 1e3:.0f} ms ({100 * (statistics.median(run['step']) / plain - 1):+.1f}%)")
    # Physical floor: bytes the metrics must touch (fp32 parameters, AdamW's two moments).
    # Every step the gradient norm reads the gradients (4n). A measured update ratio needs
    # W_before kept (a copy: read 4n + write 4n), then reads W_before and W_after once (8n: the
    # difference, ||W_after|| and ||W_before|| in one pass); the optimizer-state check reads both
    # moments (8n): 24n more on a report step. On consecutive measured steps the snapshot is
    # refreshed from W_after while that pass holds it in cache (write 4n instead of the copy): 20n.
    default_cfg = variants["default"]
    floor_every = (4 + 20) * n / (gbs * 1e9)
    floor_default = (4 + 24 / default_cfg.report_every) * n / (gbs * 1e9)
    print(f"physical floor: default {floor_default * 1e3:.1f} ms ({100 * floor_default / plain:.2f}% of step), "
          f"every metric every step {floor_every * 1e3:.1f} ms ({100 * floor_every / plain:.2f}%)")
    for run in runs.values():
        if run["agent"]:
            assert run["agent"].latest()["trainguard_agent_errors_total"] == 0
            run["agent"].close()


if __name__ == "__main__":
    main()
