"""What the diagnostics cost, on the CPU: the element-wise fingerprints and the triage statistics
per report, and the pre-flight once.

    .venv/bin/python bench/diagnostics_cost.py            # ~1-2 minutes

The GPT-like model of ``bench/agent_overhead.py`` (~27M parameters, 16 x 128 tokens per step)
trains with AdamW. Per round, interleaved on the same machine: one plain training step; the work a
report step adds under data parallelism for the fingerprints (``Fingerprinter.layer_values`` over
the gradients and over the parameters, and ``desync`` on two ranks' rows); the triage statistics
(``triage.grad_stats``); the comparison of sharded parameters' replicas (``desync`` with replica
groups, on 8 ranks laid out as HSDP 2 x 4, against the data-parallel comparison of the same rows;
the projections themselves cost what the data-parallel ones cost on each rank's local shards, a
fraction of the model). Medians over the rounds. The per-step cost of a report's work is its time
divided by ``report_every`` (default 10), printed as a share of the plain step. Then the pre-flight
(one forward/backward, one simulated AdamW step, every check) against the plain step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from agent_overhead import GPT  # noqa: E402

import trainer_agent as ta  # noqa: E402
from trainer_agent.measure import triage_stats as triage  # noqa: E402
from trainer_agent.measure.fingerprint import Fingerprinter, desync  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--report-every", type=int, default=ta.AgentConfig().report_every)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    vocab = 8192
    model = GPT(vocab, 512, 6, args.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, vocab, (args.batch, args.seq + 1))
    agent = ta.attach(model, opt, job="bench", run="bench-1", config=ta.AgentConfig(metrics_port=None))
    params = agent.params
    fp = Fingerprinter([p.numel() for p in params.params], params.layer_ids, len(params.layers), device=params.device)
    n = sum(p.numel() for p in params.params)

    def step() -> float:
        t0 = time.perf_counter()
        opt.zero_grad()
        model.loss(ids).backward()
        opt.step()
        return time.perf_counter() - t0

    step()
    steps, prints, stats_t, hsdp_t, dp_t = [], [], [], [], []
    # HSDP 2 x 4 on 8 ranks: ranks r and r + 4 hold the same shards (one replica group per shard).
    groups = [(torch.arange(fp.layers), torch.tensor([[r, r + 4] for r in range(4)]))]
    for _ in range(args.rounds):
        steps.append(step())
        with torch.no_grad():  # as in the agent's hooks
            t0 = time.perf_counter()
            g = fp.layer_values(params.grads())
            w = fp.layer_values(params.buckets)
            row = torch.cat([g.reshape(-1), w.reshape(-1)])
            desync(torch.stack([row, row]), fp.layers, fp.k).tolist()
            prints.append(time.perf_counter() - t0)
            rows8 = torch.stack([row] * 8)
            t0 = time.perf_counter()
            desync(rows8, fp.layers, fp.k, groups).tolist()
            hsdp_t.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            desync(rows8, fp.layers, fp.k).tolist()
            dp_t.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            triage.grad_stats(params.params, params.layer_ids, len(params.layers), params.device)[0].tolist()
            stats_t.append(time.perf_counter() - t0)
    s, f, t = statistics.median(steps), statistics.median(prints), statistics.median(stats_t)
    print(f"model: {n / 1e6:.1f}M parameters, {len(params.layers)} layers, {args.batch}x{args.seq} tokens/step, "
          f"{args.threads} thread(s), report_every={args.report_every}")
    print(f"plain step (median):                 {s * 1e3:8.1f} ms")
    print(f"fingerprints per report (median):    {f * 1e3:8.1f} ms = {f / s:.2%} of a step; "
          f"per step at report_every={args.report_every}: {f / args.report_every / s:.3%}")
    h, d = statistics.median(hsdp_t), statistics.median(dp_t)
    print(f"replica comparison, 8 ranks HSDP 2x4: {h * 1e3:8.3f} ms = {h / s:.4%} of a step "
          f"({h / d:.2f}x the data-parallel comparison of the same rows, {d * 1e3:.3f} ms)")
    print(f"triage statistics per report:        {t * 1e3:8.1f} ms = {t / s:.2%} of a step; "
          f"per step: {t / args.report_every / s:.3%}")
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    agent.preflight(ids, loss_fn=lambda m, b: m.loss(b), clip_grad_norm=1.0)
    pre = time.perf_counter() - t0
    print(f"pre-flight (once):                   {pre * 1e3:8.1f} ms = {pre / s:.2f} plain steps")
    # The same with every input-dependent check on: the loss on extreme inputs (4 more forward and
    # backward passes: a repeated token, all padding, the maximum length, the largest logits) and
    # a forward and backward in bfloat16 with the overflow hooks.
    t0 = time.perf_counter()
    report = agent.preflight(ids, loss_fn=lambda m, b: m.loss(b), clip_grad_norm=1.0, pad_id=0,
                             max_length=ids.shape[-1], amp_dtype=torch.bfloat16)
    full = time.perf_counter() - t0
    ran = [c.name for c in report.checks if c.status != "skip"]
    print(f"pre-flight, every probe (once):      {full * 1e3:8.1f} ms = {full / s:.2f} plain steps "
          f"({len(ran)} checks ran)")
    agent.close()


if __name__ == "__main__":
    main()
