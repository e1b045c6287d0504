"""Healthy small-batch runs and a rare harder data source: automatic actions that should not happen.

Real training on the CPU (a small byte-level GPT, ``trainguard.demo.model.TinyGPT``, and a small
MLP regression, both with real torch optimizers), the agent attached with the spike guard on and a
report every step; each run's reports are replayed through the built-in rules with the
controller's recovery logic (``engine.simulate``, as ``tests/service/report_replay.py`` does). The
LR schedule is ``bench/recovery.py``'s own (``shape``: warm-up, then constant). Cases:

- ``gpt-bB``: TinyGPT (2 layers, d_model 64, 64 tokens), AdamW, batch B (2, 3 or 4).
- ``mlp-bB``: a 3-layer MLP on a fixed random teacher with noise, SGD with momentum, batch B.
- ``hard``: a one-layer GPT trained on an easy corpus with one batch in ``P`` % from a harder one
  (5, 10 and 20 %), batch 8, as in BENCHMARKS.md's third sweep of healthy run changes.

Printed per case: healthy steps, steps the agent's spike guard skipped, findings of rules that act
or make a report unhealthy (by rule), incidents opened, runs whose desired state changed (an LR
cut, a rollback), and per 10,000 steps the false actions (a skipped step, or such a finding).
``--dump FILE`` keeps every run's reports (a pickle) to replay them again without training.

    .venv/bin/python bench/healthy_small_batch.py [--seeds 6] [--steps 1000] [--cases gpt,mlp,hard] [--batches 2,3,4]
"""

from __future__ import annotations

import argparse
import collections
import pickle
import random
import sys
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trainer_agent as ta  # noqa: E402
from bench.recovery import shape  # noqa: E402
from trainguard.demo.model import ByteCorpus, TinyGPT, next_byte_loss, phrase_bytes, stdlib_source_bytes  # noqa: E402
from trainguard.protocol.wire import Report  # noqa: E402
from trainguard.service.engine import simulate  # noqa: E402
from trainguard.service.rules import default_rules_text, load_rules  # noqa: E402

RULES = load_rules(default_rules_text())


def replay(rows: list[dict[str, float]], job: str) -> list[Any]:
    """The reports of every step through the built-in rules and the recovery policy."""
    reports = [Report(job=job, step_first=int(v["trainguard_step"]), step_last=int(v["trainguard_step"]),
                      time=float(i), values={k: x for k, x in v.items() if "{" not in k}) for i, v in enumerate(rows)]
    return simulate(RULES.base, reports, world_size=1, policy=RULES.file.recovery, snapshot_keep=4)


def acting(steps: list[Any]) -> list[tuple[int, str, str]]:
    """(step, rule, summary) of findings of rules that act, or that make a report unhealthy."""
    health = set(RULES.file.recovery.health_rules)
    return [(s.step_last, f.finding.rule.name, f.finding.summary) for s in steps for f in s.fired
            if f.finding.rule.name in health or any(a.type != "notify" for a in f.finding.rule.actions)]


def _attach(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, name: str) -> Any:
    return ta.attach(model, opt, job="healthy-small-batch", run=name, lr_scheduler=sched,
                     config=ta.AgentConfig(metrics_port=None, report_every=1, skip_spikes=True))


def _train(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, agent: Any, steps: int,
           loss_of: Callable[[int], tuple[torch.Tensor, int | None]]) -> tuple[list[dict[str, float]], Any]:
    """``steps`` optimizer steps on ``loss_of(k)`` (the loss, its tokens or None); the agent's
    report after each."""
    rows = []
    for k in range(steps):
        loss, tokens = loss_of(k)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        agent.end_step(loss.detach(), tokens=tokens)
        rows.append(agent.latest())
    return rows, agent


def _byte_loss(model: nn.Module, corpus_of: Callable[[int], ByteCorpus], offset: int) -> Callable[[int], tuple[torch.Tensor, int]]:
    def loss_of(k: int) -> tuple[torch.Tensor, int]:
        ids, mask = corpus_of(k).batch(k + offset, 0)
        return next_byte_loss(model, ids, mask), ids.numel()
    return loss_of


def gpt_run(seed: int, batch: int, steps: int, corpus_bytes: bytes) -> tuple[list[dict[str, float]], Any]:
    torch.manual_seed(seed)
    model = TinyGPT(seq_len=64, d_model=64, n_layers=2, n_heads=4)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: shape("constant", k, steps))
    corpus = ByteCorpus(corpus_bytes, seq_len=64, batch_size=batch)
    agent = _attach(model, opt, sched, f"gpt-b{batch}-{seed}")
    return _train(model, opt, sched, agent, steps, _byte_loss(model, lambda k: corpus, seed * 100_000))


def mlp_run(seed: int, batch: int, steps: int) -> tuple[list[dict[str, float]], Any]:
    torch.manual_seed(seed)
    teacher = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: shape("constant", k, steps))
    g = torch.Generator().manual_seed(seed + 7)

    def loss_of(k: int) -> tuple[torch.Tensor, None]:
        x = torch.randn(batch, 32, generator=g)
        with torch.no_grad():
            y = teacher(x) + 0.1 * torch.randn(batch, 4, generator=g)
        return nn.functional.mse_loss(model(x), y), None

    return _train(model, opt, sched, _attach(model, opt, sched, f"mlp-b{batch}-{seed}"), steps, loss_of)


def hard_run(seed: int, share: float, steps: int, hard_bytes: bytes) -> tuple[list[dict[str, float]], Any]:
    """BENCHMARKS.md's rare harder source: one batch in 1/share from the library source."""
    torch.manual_seed(seed)
    model = TinyGPT(seq_len=32, d_model=32, n_layers=1, n_heads=2)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    easy = ByteCorpus(phrase_bytes(1 << 18), seq_len=32, batch_size=8)
    hard = ByteCorpus(hard_bytes, seq_len=32, batch_size=8)
    pick = random.Random(seed + 3)
    agent = _attach(model, opt, None, f"hard-{share}-{seed}")
    return _train(model, opt, None, agent, steps, _byte_loss(model, lambda k: hard if pick.random() < share else easy, 0))


def judge(name: str, rows: list[dict[str, float]], agent: Any, tally: dict[str, collections.Counter],
          dump: dict[str, list[dict[str, float]]] | None = None) -> None:
    """Replays the run's reports and adds what acted to the case's tally (``tally[case]``); the
    reports go to ``dump[name]`` too when given."""
    if dump is not None:
        dump[name] = rows
    skipped = dict(agent.control.skip.skipped_by_reason)
    agent.close(1.0)
    steps = replay(rows, name)
    found = acting(steps)
    cut = sum(1 for s in steps if s.desired.lr_scale < 1.0 or s.desired.generation)
    incidents = {i["id"] for s in steps for i in s.incidents}
    case = name.rsplit("-", 1)[0]
    t = tally[case]
    t["runs"] += 1
    t["steps"] += len(rows)
    t["skipped"] += skipped.get("spike", 0)
    t["findings"] += len(found)
    t["runs_cut"] += cut > 0
    t["incidents"] += len(incidents)
    for _, rule, _ in found:
        t[f"rule:{rule}"] += 1
    for step, rule, summary in found:
        print(f"  {name} step {step} {rule}: {summary[:160]}", file=sys.stderr, flush=True)
    if skipped.get("spike"):
        print(f"  {name}: {skipped['spike']} steps skipped by the spike guard", file=sys.stderr, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=6)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--hard-steps", type=int, default=300)
    p.add_argument("--cases", default="gpt,mlp,hard")
    p.add_argument("--batches", default="2,3,4", help="batch sizes of the gpt and mlp cases")
    p.add_argument("--dump", default="", help="write every run's reports to this file (pickle: run -> reports)")
    args = p.parse_args()
    torch.set_num_threads(1)
    cases = set(args.cases.split(","))
    source = stdlib_source_bytes(1 << 20)
    tally: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    dump: dict[str, list[dict[str, float]]] | None = {} if args.dump else None
    t0 = time.monotonic()
    for batch in (int(b) for b in args.batches.split(",")):
        for seed in range(args.seeds):
            if "gpt" in cases:
                judge(f"gpt-b{batch}-{seed}", *gpt_run(seed, batch, args.steps, source), tally, dump)
            if "mlp" in cases:
                judge(f"mlp-b{batch}-{seed}", *mlp_run(seed, batch, args.steps), tally, dump)
    if "hard" in cases:
        for share in (0.05, 0.1, 0.2):
            for seed in range(4):
                judge(f"hard{int(share * 100)}-{seed}", *hard_run(seed, share, args.hard_steps, source[: 1 << 18]), tally, dump)
    if dump is not None:
        Path(args.dump).write_bytes(pickle.dumps(dump))
    print(f"{'case':<10} {'runs':>4} {'steps':>7} {'skipped':>7} {'findings':>8} {'incidents':>9} {'runs cut':>8} {'per 10k':>8}  rules")
    for case in sorted(tally):
        t = tally[case]
        rules = ", ".join(f"{k[5:]} {v}" for k, v in sorted(t.items()) if k.startswith("rule:")) or "-"
        per = 1e4 * (t["skipped"] + t["findings"]) / t["steps"]
        print(f"{case:<10} {t['runs']:>4} {t['steps']:>7} {t['skipped']:>7} {t['findings']:>8} {t['incidents']:>9} {t['runs_cut']:>8} "
              f"{per:>8.1f}  {rules}")
    print(f"per 10k = (skipped + findings) per 10,000 healthy steps; incidents = incidents opened; runs cut = runs "
          f"whose desired state changed (an LR cut, a rollback); wall {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
