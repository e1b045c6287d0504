"""What the gradient recompute check costs, on the CPU: a checked step against a plain one.

    .venv/bin/python bench/verify_cost.py                  # ~1 minute (--d 512 --layers 6: the
                                                           # model of bench/diagnostics_cost.py)

The GPT-like model of ``bench/agent_overhead.py`` trains with AdamW under the agent. Per round,
interleaved: one step the agent does not check and one it checks (``agent.request_verify()``, then
``agent.verify_step`` after the backward: the recorded projections of the incoming gradients in the
hooks, the recompute and the comparison). Medians over the rounds. The per-step cost at
``verify_every=N`` is the difference divided by N.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from agent_overhead import GPT  # noqa: E402

import trainer_agent as ta  # noqa: E402


class LossModel(nn.Module):
    """The GPT's loss as its forward: the check replays the random state at the model's forward."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.gpt.loss(ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--every", type=int, default=1000, help="verify_every to express the cost per step at")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    vocab = 8192
    model = LossModel(GPT(vocab, args.d, args.layers, args.seq))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, vocab, (args.batch, args.seq + 1))
    agent = ta.attach(model, opt, job="bench", run="bench-1", config=ta.AgentConfig(metrics_port=None))
    n = sum(p.numel() for p in model.parameters())

    def step(check: bool) -> float:
        if check:
            agent.request_verify()
        t0 = time.perf_counter()
        loss = model(ids)
        loss.backward()
        result = agent.verify_step(ids, lambda m, b: m(b))
        assert (result is not None) == check and (result is None or result.bitwise), result
        opt.step()
        opt.zero_grad()
        agent.end_step(loss.detach())
        return time.perf_counter() - t0

    step(False)
    step(True)
    plain, checked = [], []
    for _ in range(args.rounds):
        plain.append(step(False))
        checked.append(step(True))
    p, c = statistics.median(plain), statistics.median(checked)
    print(f"model: {n / 1e6:.1f}M parameters, {args.batch}x{args.seq} tokens/step, {args.threads} thread(s)")
    print(f"plain step (median):    {p * 1e3:8.1f} ms")
    print(f"checked step (median):  {c * 1e3:8.1f} ms = {c / p:.2f}x a plain step")
    print(f"per step at verify_every={args.every}: {(c - p) / args.every / p:.3%}")
    agent.close()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main()
