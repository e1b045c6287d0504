"""Recovery by cause: data and hardware faults (and a mixed-precision collapse) injected into small
training runs, the cause the controller decided before acting, and what it did.

Reuses ``bench/recovery.py``'s controller (one ``trainguard serve``, default rules, temporary
SQLite) and its schedule; each case is the same small byte-level GPT on CPU with AdamW, one
process, the agent attached with the controller and a data monitor (a window of 256 sequences,
reference from the first 8,192 tokens) that every batch goes through (``observe_batch``).

- ``dup-burst``: for 30 steps from ``--onset`` every batch is the onset's batch (duplicated data).
- ``corrupt-burst``: for 20 steps the batches are random bytes (corrupted data).
- ``poison``: one batch at the onset has its loss weighted x1e4 (a mis-scaled sample).
- ``fp16-collapse``: float16 autocast with a GradScaler; for 20 steps from the onset the loss is
  weighted x1e30, every step overflows, and the loss scale halves down to 1.
- ``hw-bitflip``: two gloo ranks (DDP); from the onset rank 1's gradient of the first layer gets one
  element's highest mantissa bit flipped, a different element on every backward pass (a device
  that computes wrong values), and every 5th step is recomputed (``verify_every=5``).

Per case: the verdict (``cause`` of the first incident), its first action (rung), the detection
lag (steps from the onset to the first action: a skipped step or an applied desired-state
change), the steps lost (skipped for data or by the spike guard, plus rolled back), the final loss
(mean of the last 20 steps) against the same case without trainguard, the lr_scale at the end, and
whether the run was paused. The hardware case reports the rank and host named and the steps from
the first failing recompute to the pause.

    .venv/bin/python bench/recovery_causes.py [--steps 300] [--onset 150] [--cases dup-burst,...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recovery import _start_controller, shape, stop_when_paused  # noqa: E402  (the recovery bench's harness)

import trainer_agent as ta  # noqa: E402
from trainguard.demo.model import ByteCorpus, TinyGPT, next_byte_loss, stdlib_source_bytes  # noqa: E402

CASES = ("dup-burst", "corrupt-burst", "poison", "fp16-collapse", "hw-bitflip")


def _batch(case: str, step: int, args: argparse.Namespace, corpus: ByteCorpus, g: torch.Generator) -> tuple:
    onset = args.onset
    if case == "dup-burst" and onset <= step < onset + 30:
        return corpus.batch(onset, 0)
    ids, mask = corpus.batch(step, 0)
    if case == "corrupt-burst" and onset <= step < onset + 20:
        ids = torch.randint(1, 256, ids.shape, generator=g)
    return ids, mask


def _weight(case: str, step: int, onset: int) -> float:
    if case == "poison" and step == onset:
        return 1e4
    if case == "fp16-collapse" and onset <= step < onset + 20:
        return 1e30
    return 1.0


def run_single(case: str, url: str | None, args: argparse.Namespace, corpus: ByteCorpus) -> dict:
    """One single-process case; ``url`` None: without trainguard."""
    torch.manual_seed(0)
    model = TinyGPT(seq_len=args.seq_len, d_model=64, n_layers=2, n_heads=4)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: shape("constant", s, args.steps))
    scaler = torch.amp.GradScaler("cpu") if case == "fp16-collapse" else None
    agent = None
    run = f"{case}-{os.getpid()}-{int(time.time() * 1000) % 10**8}"
    done, paused = threading.Event(), []
    if url is not None:
        agent = ta.attach(model, opt, job="recovery-causes", run=run, lr_scheduler=sched, controller=url, scaler=scaler,
                          data_monitor=ta.DataMonitor(256, window=256, reference_tokens=8192),
                          config=ta.AgentConfig(metrics_port=None, report_every=args.report_every,
                                                snapshot_every=50, snapshot_keep=4))
        threading.Thread(target=stop_when_paused, args=(url, run, done, paused), daemon=True).start()
    g = torch.Generator().manual_seed(7)
    losses, first_action = [], None
    for step in range(args.steps):
        ids, mask = _batch(case, step, args, corpus, g)
        if agent is not None:
            agent.observe_batch(ids, mask)
        with torch.autocast("cpu", dtype=torch.float16, enabled=scaler is not None):
            loss = next_byte_loss(model, ids, mask)
        weighted = loss * _weight(case, step, args.onset)
        before = (agent.control.skip.skipped, agent.control.applied_generation) if agent is not None else None
        if scaler is not None:
            scaler.scale(weighted).backward()
            scaler.step(opt)
            scaler.update()
        else:
            weighted.backward()
            opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(float(loss.detach()))
        if agent is None:
            continue
        agent.end_step(loss.detach())
        if first_action is None and step >= args.onset and \
                (agent.control.skip.skipped, agent.control.applied_generation) != before:
            first_action = step
        if agent.should_stop:
            break
    finite = [x for x in losses[-20:] if x == x]
    out = {"case": case, "final_loss": statistics.fmean(finite) if finite else float("nan")}
    if agent is None:
        return out
    done.set()
    history, skipped, scale = list(agent.control.history), sum(agent.control.skip.skipped_by_reason.values()), agent.control.lr_scale
    agent.close(5.0)
    incidents = list(reversed(httpx.get(f"{url}/v1/runs/{run}/incidents", timeout=10).json()["incidents"]))
    lost = skipped + sum(h.step - h.restored_step for h in history if h.restored_step is not None)
    return out | {"verdict": incidents[0]["cause"] if incidents else "-",
                  "first_rung": incidents[0]["rungs"][0]["rung"] if incidents and incidents[0]["rungs"] else "-",
                  "lag": None if first_action is None else first_action - args.onset, "lost": lost, "scale": scale,
                  "min_scale": min([h.lr_scale for h in history] or [1.0]), "paused": bool(paused),
                  "incidents": [(i["cause"], [r["rung"] for r in i["rungs"]], i["outcome"]) for i in incidents]}


def _hw_rank(rank: int, url: str, run: str, steps: int, onset: int, seq_len: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    torch.distributed.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=2,
                                         timeout=timedelta(seconds=120))
    corpus = ByteCorpus(stdlib_source_bytes(1 << 20), seq_len=seq_len, batch_size=8)
    torch.manual_seed(0)
    net = TinyGPT(seq_len=seq_len, d_model=32, n_layers=1, n_heads=2)
    passes = iter(range(1 << 40))
    state = {"step": 0}

    def flip(grad: torch.Tensor) -> torch.Tensor:  # rank 1's device from the onset: one wrong element per pass
        if rank != 1 or state["step"] < onset:
            return grad
        grad = grad.clone()
        flat = grad.view(-1)
        i = next(passes) % flat.numel()
        flat[i:i + 1].view(torch.int32).bitwise_xor_(1 << 22)
        return grad

    first = next(p for p in net.parameters() if p.dim() == 2)
    first.register_hook(flip)  # before the agent's hooks: what the step produced on that device
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    agent = ta.attach(model, opt, job="recovery-causes", run=run, controller=url,
                      config=ta.AgentConfig(metrics_port=0, metrics_host="127.0.0.1", report_every=1, verify_every=5))
    loss_fn = lambda m, b: next_byte_loss(m, *b)  # noqa: E731
    first_bad = None
    for step in range(steps):
        state["step"] = step
        batch = corpus.batch(step, rank)
        loss = loss_fn(model, batch)
        loss.backward()
        checked = agent.verify_step(batch, loss_fn)
        if checked is not None and checked.mismatch and first_bad is None:
            first_bad = checked.step
        opt.step()
        opt.zero_grad()
        agent.end_step(loss.detach())
        if agent.should_stop:
            break
    torch.save({"step": agent.step, "first_bad": first_bad,
                "checkpoint_steps": [h.step for h in agent.control.history if h.checkpoint_seq]},
               Path(out) / f"hw{rank}.pt")
    agent.close(5.0)
    torch.distributed.destroy_process_group()


def run_hardware(url: str, args: argparse.Namespace) -> dict:
    run = f"hw-bitflip-{os.getpid()}-{int(time.time() * 1000) % 10**8}"
    done, paused = threading.Event(), []
    threading.Thread(target=stop_when_paused, args=(url, run, done, paused), daemon=True).start()
    with tempfile.TemporaryDirectory() as out:
        torch.multiprocessing.start_processes(_hw_rank, args=(url, run, args.steps, args.onset, args.seq_len, out),
                                              nprocs=2, start_method="spawn")
        logs = [torch.load(Path(out) / f"hw{r}.pt") for r in range(2)]
    done.set()
    with httpx.Client(base_url=url, timeout=10) as c:
        incidents = list(reversed(c.get(f"/v1/runs/{run}/incidents").json()["incidents"]))
    inc = incidents[0] if incidents else {"cause": "-", "rungs": [], "verdict": {}}
    bad = logs[1]["first_bad"]
    return {"case": "hw-bitflip", "verdict": inc["cause"], "first_rung": inc["rungs"][0]["rung"] if inc["rungs"] else "-",
            "named": list(zip(inc["verdict"].get("ranks", []), inc["verdict"].get("hosts", []))),
            "first_bad_recompute": bad, "stopped_at": logs[0]["step"], "paused": bool(paused),
            "lag": None if bad is None else logs[0]["step"] - bad,
            "checkpointed_at": logs[0]["checkpoint_steps"][:1]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--onset", type=int, default=150)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--report-every", type=int, default=1)
    p.add_argument("--cases", default=",".join(CASES))
    args = p.parse_args()
    torch.set_num_threads(1)
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; cases are {', '.join(CASES)}")
    corpus = ByteCorpus(stdlib_source_bytes(1 << 20), seq_len=args.seq_len, batch_size=args.batch)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = _start_controller(Path(tmp) / "tg.db")
        try:
            t0 = time.monotonic()
            for case in cases:
                if case == "hw-bitflip":
                    rows.append(run_hardware(url, args))
                    continue
                with_tg = run_single(case, url, args, corpus)
                plain = run_single(case, None, args, corpus)
                rows.append(with_tg | {"plain": plain["final_loss"]})
                print(f"  {case}: {with_tg['incidents']}", file=sys.stderr, flush=True)
            wall = time.monotonic() - t0
        finally:
            proc.terminate()
            proc.wait(10)
    print(f"{'case':<14} {'verdict':<10} {'first action':<13} {'lag':>4} {'lost':>5} {'final':>7} {'plain':>7} "
          f"{'ratio':>6} {'scale':>7} {'min':>7} paused")
    for r in rows:
        if r["case"] == "hw-bitflip":
            continue
        lag = "-" if r["lag"] is None else r["lag"]
        print(f"{r['case']:<14} {r['verdict']:<10} {r['first_rung']:<13} {lag!s:>4} {r['lost']:>5} {r['final_loss']:>7.3f} "
              f"{r['plain']:>7.3f} {r['final_loss'] / r['plain']:>6.2f} {r['scale']:>7.3g} {r['min_scale']:>7.3g} "
              f"{'yes' if r['paused'] else 'no'}")
    for r in rows:
        if r["case"] == "hw-bitflip":
            print(f"\nhw-bitflip: verdict {r['verdict']}, first action {r['first_rung']}, named {r['named']}, "
                  f"first failing recompute at step {r['first_bad_recompute']}, checkpoint applied at step "
                  f"{r['checkpointed_at']}, paused at step {r['stopped_at']} ({r['lag']} steps after the recompute)")
    print(f"\nwall {wall:.0f} s; lag = steps from the onset to the first action; lost = steps skipped (data, spike "
          "guard, non-finite) + rolled back; ratio = final loss / the same case without trainguard; min = lowest "
          "lr_scale applied")


if __name__ == "__main__":
    main()
