"""One rank of the dashboards' two-rank integration test (gloo, CPU): a small language model under
DDP with the agent attached at its defaults for a multi-rank job (job-level and per-layer series
on the leader only), a data monitor and a token loader. Run as a script:

    RANK=r WORLD_SIZE=n python training_rank.py '<json>'

The JSON gives the process group's ``init`` method, ``job``, ``run``, the ``controller`` and its
agent ``token``, the folder ``out`` and the ``seconds`` to train. The rank writes
``out/rank<r>.url`` (its /metrics address) once attached and ``out/rank<r>.json`` (its last values,
``Agent.latest()``) once trained, then serves /metrics until ``out/done`` exists (at most
``linger`` seconds) and leaves.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import trainer_agent as ta  # noqa: E402
from trainer_agent.data import DataMonitor, QualityFilter  # noqa: E402
from trainer_agent.dataset import TokenBatches, TokenLoader, write_shards  # noqa: E402

VOCAB, SEQ, BATCH = 64, 32, 8
WINDOW = 128  # sequences in the data monitor's window


class TinyLM(nn.Module):
    """Embedding, two residual MLP blocks and a tied head: per-layer metrics see ``blocks.0`` and
    ``blocks.1`` at the agent's default depth."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
                                    for _ in range(2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        for block in self.blocks:
            x = x + block(x)
        return x @ self.tok.weight.T


def _loader(out: Path, rank: int) -> TokenLoader:
    """Random token sequences (no special id 0) in this rank's own shards."""
    generator = torch.Generator().manual_seed(1 + rank)
    shards = write_shards(out / f"shards{rank}",
                          (torch.randint(1, VOCAB, (SEQ + 1,), generator=generator).numpy() for _ in range(4096)),
                          vocab_size=VOCAB, tokens_per_shard=1024 * (SEQ + 1), monitor=False)
    return TokenLoader(TokenBatches(shards, batch_size=BATCH, seq_len=SEQ + 1, seed=1 + rank), num_workers=0)


def _batches(loader: TokenLoader, registry, labels: dict[str, str]):
    """Batches of BATCH sequences that passed a QualityFilter (its counters on the agent's registry)."""
    def sequences():
        while True:
            for rows in loader:
                yield from rows["input_ids"]
    kept = iter(QualityFilter(sequences(), registry=registry, labels=labels))
    while True:
        yield torch.stack([next(kept) for _ in range(BATCH)])


def _train(agent: ta.Agent, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
           batches, seconds: float) -> None:
    """Train with a GradScaler until ``seconds`` have passed on every rank (the ranks agree on the
    last step)."""
    start = time.monotonic()
    while True:
        done = torch.tensor([float(time.monotonic() - start > seconds)])
        dist.all_reduce(done)
        if done.item() > 0:
            return
        batch = next(batches)
        agent.observe_batch(batch)
        loss = F.cross_entropy(model(batch[:, :-1]).reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        agent.end_step(loss.detach(), tokens=batch.numel())
        time.sleep(0.02)


def main() -> None:
    torch.set_num_threads(1)
    cfg = json.loads(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = Path(cfg["out"])
    dist.init_process_group("gloo", init_method=cfg["init"], rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    torch.manual_seed(0)  # the same initial weights on every rank
    model = DDP(TinyLM())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    scaler = torch.amp.GradScaler("cpu")
    monitor = DataMonitor(VOCAB, special_ids=(0,), window=WINDOW, reference_tokens=WINDOW * SEQ)
    agent = ta.attach(model, optimizer, job=cfg["job"], run=cfg["run"], data_monitor=monitor,
                      scaler=scaler, controller=cfg["controller"], token=cfg["token"],
                      config=ta.AgentConfig(report_every=1, metrics_port=0, comm_timing=True, skip_nonfinite=True,
                                            flops_per_token=6e6, peak_flops=1e12))  # MFU on a CPU
    loader = _loader(out, rank)
    agent.watch_loader(loader)
    (out / f"rank{rank}.url").write_text(agent.metrics_url)
    labels = {"job": cfg["job"], "run": cfg["run"], "rank": str(rank)}
    _train(agent, model, optimizer, scaler, _batches(loader, agent.registry, labels), cfg["seconds"])
    agent.reports.flush(timeout=30)  # the leader's cross-rank work (the replicas' agreement) done
    (out / f"rank{rank}.json").write_text(json.dumps(agent.latest()))
    deadline = time.monotonic() + cfg["linger"]
    while time.monotonic() < deadline and not (out / "done").exists():
        time.sleep(0.1)
    agent.close(timeout=5.0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
