"""What a snapshot costs the training step, in host memory and in time, on the CPU.

    .venv/bin/python bench/snapshots.py                # ~2-4 minutes on a loaded 2-core machine
    .venv/bin/python bench/snapshots.py --width 2048 --layers 5 --rounds 6

A stack of ``--layers`` Linear(width, width) + GELU (5 x 2048: 21M parameters) trains with AdamW
in three identical copies, interleaved round by round so that all three see the same machine:

- plain: no agent; its step time (forward, backward, ``optimizer.step()``) is the reference;
- in-memory: the agent with ``snapshot_every=N`` (host-memory snapshots, ``trainer_agent/control/snapshots.py``);
- dcp: the agent with ``snapshot_backend=DcpSnapshots(...)`` (``trainer_agent/control/dcp_snapshots.py``).

Per copy with the agent, ``end_step`` is timed on snapshot steps and on the other steps: the
difference is what a snapshot holds the step up. For the DCP backend that is the staging copy (the
write runs on a thread); the write's own duration, from ``end_step`` to the write's completion, is
given beside it, and the steps taken while a write was in flight (they share the CPU with it; the
copy's snapshot step comes first in its turn, and its turn ends when the write is done). The
floor is a plain ``clone()`` of every parameter and optimizer state tensor, the copies held as the
snapshots are (the last two), so that each lands in fresh memory as a snapshot does: a snapshot
cannot cost less than that copy. Host memory: the bytes of the tensors one in-memory snapshot holds, and the
resident set's growth over the first snapshot (for DCP: while the first write is in flight, and
once it is done). Figures are medians over the rounds; ratios are to the plain step's median.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import tempfile
import time

import torch
from torch import nn

import trainer_agent as ta


def _model(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.GELU())])


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _tensor_bytes(obj: object) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


class Copy:
    """One model + AdamW, optionally with an agent; times its own steps."""

    def __init__(self, name: str, width: int, layers: int, batch: int, every: int | None, directory: str | None) -> None:
        self.name, self.batch, self.width = name, batch, width
        self.model = _model(width, layers)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.backend = ta.DcpSnapshots(directory, self.model, self.opt) if directory else None
        self.save_s: list[float] = []
        if self.backend is not None:  # time the backend's save alone (the staging copy), inside end_step
            save = self.backend.save

            def timed_save(step: int) -> str:
                t0 = time.perf_counter()
                try:
                    return save(step)
                finally:
                    self.save_s.append(time.perf_counter() - t0)

            self.backend.save = timed_save  # type: ignore[method-assign]
        self.agent = None
        if every is not None:
            self.agent = ta.attach(self.model, self.opt, job="bench", run=f"bench-{name}", snapshot_backend=self.backend,
                                   config=ta.AgentConfig(metrics_port=None, controller=None, snapshot_every=every,
                                                         snapshot_keep=2))
        self.g = torch.Generator().manual_seed(1)
        self.step_s: list[float] = []
        self.step_during_write_s: list[float] = []
        self.end_plain_s: list[float] = []
        self.end_snap_s: list[float] = []
        self.write_s: list[float] = []
        self.rss: dict[str, int] = {}
        self.snapshot_bytes = 0
        self.steps = 0

    def _writing(self) -> bool:
        # The bench reads the backend's pending write to time it; not part of its interface.
        return self.backend is not None and any(not f.done() for f in self.backend._writes.values())

    def step(self) -> None:
        writing = self._writing()
        x = torch.randn(self.batch, self.width, generator=self.g)
        t0 = time.perf_counter()
        loss = (self.model(x) - x).square().mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        (self.step_during_write_s if writing else self.step_s).append(t1 - t0)
        if self.agent is None:
            return
        snap_step = self.agent.snapshots.due(self.steps + 1)
        first = snap_step and not self.agent.snapshots.snapshots
        if first:
            gc.collect()
            self.rss["before"] = _rss()
        self.agent.end_step(loss.detach())
        t2 = time.perf_counter()
        self.steps += 1
        (self.end_snap_s if snap_step else self.end_plain_s).append(t2 - t1)
        if snap_step and self.backend is not None:
            future = self.backend._writes[self.agent.snapshots.snapshots[-1].model]
            future.add_done_callback(lambda _f, t=t1: self.write_s.append(time.perf_counter() - t))
        if first:
            self.rss["after"] = _rss()
            snap = self.agent.snapshots.snapshots[-1]
            if self.backend is None:
                self.snapshot_bytes = _tensor_bytes(snap.model) + _tensor_bytes(snap.optimizer)
            else:
                self.backend.close()
                gc.collect()
                self.rss["written"] = _rss()


def _clone_floor(model: nn.Module, opt: torch.optim.Optimizer, held: list[list[torch.Tensor]]) -> tuple[float, int]:
    """Clone every parameter and optimizer state tensor; the copies are kept as the in-memory
    snapshots are (``held``: the last two), so that each clone, like a snapshot, lands in memory
    that is not the previous copy's."""
    tensors = [p.detach() for p in model.parameters()]
    tensors += [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    t0 = time.perf_counter()
    copies = [t.clone() for t in tensors]
    elapsed = time.perf_counter() - t0
    held.append(copies)
    del held[:-2]
    return elapsed, sum(c.numel() * c.element_size() for c in copies)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--every", type=int, default=4, help="snapshot_every (steps per round)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dir", default=None, help="where the DCP snapshots go (default: a temporary directory)")
    args = ap.parse_args()
    if min(args.width, args.layers, args.batch, args.every, args.rounds, args.threads) < 1:
        raise SystemExit("every size must be >= 1")
    torch.set_num_threads(args.threads)
    directory = args.dir or tempfile.mkdtemp(prefix="trainguard-snapshots-")
    try:
        copies = [Copy("plain", args.width, args.layers, args.batch, None, None),
                  Copy("in-memory", args.width, args.layers, args.batch, args.every, None),
                  Copy("dcp", args.width, args.layers, args.batch, args.every, os.path.join(directory, "dcp"))]
        params = sum(p.numel() for p in copies[0].model.parameters())
        print(f"model: {args.layers} x Linear({args.width}, {args.width}), {params / 1e6:.1f}M parameters, AdamW, "
              f"batch {args.batch}, {args.threads} thread(s), snapshot every {args.every} steps; "
              f"loadavg {open('/proc/loadavg').read().split()[:3]}")
        # The DCP copy's snapshot comes first in its turn, so that the turn's other steps run while
        # its write is in flight; the turn ends when the write is done, so that it does not run
        # beside the other copies' steps or the clone floor.
        for _ in range(args.every - 1):
            copies[2].step()
        floor_s: list[float] = []
        floor_bytes = 0
        floor_held: list[list[torch.Tensor]] = []
        for r in range(args.rounds):
            for c in copies:
                for _ in range(args.every):
                    c.step()
                if c.backend is not None:
                    c.backend.close()
            if r > 0:  # the optimizer state exists from the first step on
                s, floor_bytes = _clone_floor(copies[0].model, copies[0].opt, floor_held)
                floor_s.append(s)
            print(f"round {r + 1}/{args.rounds}: plain step {statistics.median(copies[0].step_s):.3f} s", flush=True)
        copies[2].backend.close()
        plain = statistics.median(copies[0].step_s)
        floor = statistics.median(floor_s)
        print(f"\nplain step (median of {len(copies[0].step_s)}): {plain * 1e3:.0f} ms")
        print(f"floor: clone of parameters + optimizer state ({floor_bytes / 2**20:.0f} MiB): "
              f"{floor * 1e3:.0f} ms = {floor / plain:.2f} x plain step")
        for c in copies[1:]:
            snap = statistics.median(c.end_snap_s)
            other = statistics.median(c.end_plain_s)
            cost = snap - other
            print(f"\n{c.name}: end_step on a snapshot step {snap * 1e3:.0f} ms, on another step {other * 1e3:.0f} ms "
                  f"(medians of {len(c.end_snap_s)} / {len(c.end_plain_s)})")
            print(f"  snapshot holds the step {cost * 1e3:.0f} ms = {cost / plain:.2f} x plain step "
                  f"= {cost / floor:.2f} x the clone floor")
            grown = (c.rss["after"] - c.rss["before"]) / 2**20
            if c.backend is None:
                print(f"  host memory per snapshot: {c.snapshot_bytes / 2**20:.0f} MiB of tensors; "
                      f"RSS grew {grown:.0f} MiB over the first snapshot")
            else:
                written = (c.rss["written"] - c.rss["before"]) / 2**20
                write = statistics.median(c.write_s)
                during = statistics.median(c.step_during_write_s) if c.step_during_write_s else float("nan")
                steps = statistics.median(c.step_s)
                staged = statistics.median(c.save_s)
                print(f"  of which DcpSnapshots.save (get_state_dict, the staging copy, starting the write): "
                      f"{staged * 1e3:.0f} ms = {staged / floor:.2f} x the clone floor; the rest of end_step "
                      f"runs beside the starting write thread")
                print(f"  async write (end_step to the write's completion): median {write * 1e3:.0f} ms "
                      f"= {write / plain:.2f} x plain step (all: {', '.join(f'{w:.2f}' for w in c.write_s)} s)")
                print(f"  its own steps: {steps * 1e3:.0f} ms with no write in flight, {during * 1e3:.0f} ms with one "
                      f"({len(c.step_during_write_s)} steps)")
                print(f"  RSS grew {grown:.0f} MiB over the first snapshot's end_step (the staged copy), "
                      f"{written:.0f} MiB once its write was done")
        for c in copies[1:]:
            c.agent.close()
        print(f"\nloadavg after: {open('/proc/loadavg').read().split()[:3]}")
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
