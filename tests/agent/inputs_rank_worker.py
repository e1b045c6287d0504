"""One gloo rank of tests/agent/test_inputs_distributed.py. Run as a script:

    RANK=r WORLD_SIZE=n DIST_INIT_METHOD=file:///tmp/x/store python inputs_rank_worker.py '<json>'

Trains a tiny next-token model under DDP on batches of a ``TokenLoader`` over the shards in
``cfg["shards"]``, with an agent reporting to ``cfg["controller"]``. ``sampler_rank`` (default: the
process's rank) is the rank the loader is configured with: the same value on every rank reproduces
the shared-seed failure (every rank reads the same data). ``slow_rank`` sleeps ``slow_s`` in its
loader before every batch (a data-slow rank). With ``accumulate`` the run lets the controller set
its accumulation steps (its own: 2) and trains, ``agent.accumulation_steps`` micro-batches per step,
until 10 steps have run with 8 (at most ``steps``); it logs (step, micro-batches, LR used) per
step. Writes ``out/<run>-rank<r>.json``.
"""

from __future__ import annotations

import json
from datetime import timedelta
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import trainer_agent as ta  # noqa: E402
from trainer_agent.dataset import TokenBatches, TokenLoader  # noqa: E402

torch.set_num_threads(1)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=os.environ.get("DIST_INIT_METHOD", "env://"), rank=rank,
                            world_size=world, timeout=timedelta(seconds=180))
    vocab = cfg["vocab"]
    sampler_rank = cfg.get("sampler_rank", rank)
    loader = TokenLoader(TokenBatches(cfg["shards"], batch_size=4, seq_len=16, seed=cfg.get("seed", 0),
                                      rank=sampler_rank, world_size=world), num_workers=0, prefetch=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(vocab, 16), torch.nn.Linear(16, vocab))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    accumulate = bool(cfg.get("accumulate"))
    agent = ta.attach(ddp, opt, job="data-job", run=cfg["run"], controller=cfg["controller"], loader=loader,
                      config=ta.AgentConfig(report_every=5, sync_every=5, vocab_size=vocab),
                      accumulation_steps=2 if accumulate else None)
    used_lr: list[float] = []
    opt.register_step_pre_hook(lambda o, a, k: used_lr.append(o.param_groups[0]["lr"]))  # after the agent's
    slow = rank == cfg.get("slow_rank", -1)
    waits, steps = [], []
    def endless():  # epoch after epoch
        while True:
            yield from loader

    it = endless()
    with_eight = 0
    for step in range(cfg["steps"]):
        if slow:
            time.sleep(cfg["slow_s"])  # the loader of this rank is slow
        micro = agent.accumulation_steps or 1
        tokens = 0
        for _ in range(micro):
            batch = next(it)
            ids, mask = batch["input_ids"], batch["attention_mask"]
            agent.observe_batch(ids, mask)
            logits = ddp(ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1), reduction="none")
            loss = (loss * mask[:, 1:].reshape(-1)).sum() / mask[:, 1:].sum() / micro
            loss.backward()
            tokens += batch["tokens"]
        opt.step()
        opt.zero_grad()
        agent.end_step(loss.detach(), tokens=tokens)
        steps.append([step + 1, micro, used_lr[-1]])
        waits.append(agent.latest().get("trainguard_input_wait_seconds", float("nan")))
        if accumulate:
            with_eight = with_eight + 1 if micro == 8 else 0
            if with_eight == 10:  # every rank reaches this at the same step
                break
    out = {"rank": rank, "rank_values": agent.rank_values, "waits": waits, "steps": steps,
           "history": [[h.generation, h.step, h.accumulation_steps] for h in agent.control.history]}
    agent.close()
    del ddp
    dist.destroy_process_group()
    Path(cfg["out"], f"{cfg['run']}-rank{rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
