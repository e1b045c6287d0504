"""The agent's cost per training step in instructions: a figure a busy machine does not move.

CPU time per step (``bench/agent_overhead.py``, ``bench/agent_scale.py``) swings by 2x and more on a
shared machine, more than two versions of the agent differ. This benchmark runs a small training
loop under valgrind's callgrind, which counts the instructions the process executes whatever else
runs beside it, so two versions of the agent compare within a percent on any machine.

Each configuration trains the same model (a 4-block MLP of 24 parameter tensors, AdamW, one thread)
under callgrind with instrumentation off while Python starts, torch loads and ``--warm-up`` steps
run (the agent's first reports, its buffers); then instrumentation is switched on
(``callgrind_control -i on``), ``--steps`` steps are counted (ordinary and report steps together,
one report per 10 steps: the agent's default configuration, no controller) and the count is
dumped. The same loop without the agent gives the model's own step, and each configuration's agent
cost is its figure minus that one.

    .venv/bin/python bench/agent_instructions.py                     # this checkout
    .venv/bin/python bench/agent_instructions.py --config now= --config then@/tmp/old-source

A configuration is ``LABEL[@SOURCE]``: SOURCE is a folder whose ``trainer_agent`` and ``trainguard``
are put first on ``PYTHONPATH`` (e.g. ``git archive REV trainer_agent trainguard | tar -x -C
/tmp/old-source``), run with this checkout's Python. Needs valgrind (Debian: ``valgrind``).
Instructions are not time (cache misses and the machine's load are not counted): use it to
compare versions of the agent, ``agent_overhead.py`` for what a step costs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from callgrind_dump import dumped_instructions  # noqa: E402

_LOOP = r"""
import sys, torch
torch.set_num_threads(1)
torch.manual_seed(0)
warm_up, steps, with_agent = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "agent"
model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(256, 512), torch.nn.GELU(),
                                                              torch.nn.Linear(512, 256), torch.nn.LayerNorm(256))])
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
agent = None
if with_agent:
    import trainer_agent as ta
    agent = ta.attach(model, opt, job="bench", run="bench-instructions", config=ta.AgentConfig(metrics_port=None))
x, y = torch.randn(32, 256), torch.randn(32, 256)

def step():
    loss = (model(x) - y).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    if agent is not None:
        agent.end_step(loss)

for n in (warm_up, steps):
    for _ in range(n):
        step()
    print("ready", flush=True)  # the parent switches the count on (after the warm-up) and dumps it (after the steps)
    sys.stdin.readline()
if agent is not None:
    agent.close()
"""


def _per_step(source: Path | None, warm_up: int, steps: int, with_agent: bool) -> float:
    """Instructions per step of ``steps`` steps after ``warm_up``, under callgrind."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0")
    if source is not None:
        env["PYTHONPATH"] = f"{source}{os.pathsep}{env.get('PYTHONPATH', '')}"
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/callgrind.out"
        proc = subprocess.Popen(["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
                                 sys.executable, "-c", _LOOP, str(warm_up), str(steps), "agent" if with_agent else "plain"],
                                env=env, cwd=tmp, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)
        assert proc.stdin is not None and proc.stdout is not None
        try:
            for control in (["-i", "on"], ["-d"]):
                if proc.stdout.readline().strip() != "ready":
                    raise SystemExit(f"the training loop stopped (exit {proc.wait()})")
                subprocess.run(["callgrind_control", *control, str(proc.pid)], check=True, capture_output=True)
                proc.stdin.write("go\n")
                proc.stdin.flush()
            proc.wait(600)
        finally:
            if proc.poll() is None:
                proc.kill()
        return dumped_instructions(out) / steps


def _config(text: str) -> tuple[str, Path | None]:
    label, _, source = text.partition("@")
    label = label.rstrip("=")
    source = source.rstrip("=")
    if not label:
        raise argparse.ArgumentTypeError(f"a configuration is LABEL[@SOURCE], got {text!r}")
    return label, (Path(source).resolve() if source else None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=_config, action="append", default=[],
                   help="LABEL[@SOURCE] (default: this checkout only)")
    p.add_argument("--warm-up", type=int, default=20, help="steps before counting (the agent's first reports)")
    p.add_argument("--steps", type=int, default=100, help="steps counted")
    args = p.parse_args()
    if shutil.which("valgrind") is None:
        sys.exit("agent_instructions: needs valgrind (Debian: apt-get install valgrind)")
    configs = args.config or [("this", None)]
    print(f"agent instructions per step: {args.steps} steps counted after {args.warm_up}, report_every=10, "
          "4-block MLP (24 tensors), AdamW, one thread", flush=True)
    plain = _per_step(None, args.warm_up, args.steps, False)
    print(f"  {'no agent':<16} {plain / 1e6:9.3f} M instructions/step (the model's own step)", flush=True)
    costs = []
    for label, source in configs:
        cost = _per_step(source, args.warm_up, args.steps, True) - plain
        costs.append(cost)
        print(f"  {label:<16} {cost / 1e6:9.3f} M instructions/step for the agent ({cost / plain:.1%} of the step; "
              f"{source or 'this checkout'})", flush=True)
    if len(costs) > 1:
        print("summary (ratio to the first configuration):")
        for (label, _), cost in zip(configs, costs):
            print(f"  {label:<16} {cost / costs[0]:.3f}x")


if __name__ == "__main__":
    main()
