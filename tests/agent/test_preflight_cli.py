"""``trainguard preflight SCRIPT [args]`` (trainguard/cli/) on a real training script, in a
subprocess: it runs the script up to ``agent.preflight``, prints the table, stops before training
and exits 1 when a check failed; a script that never calls ``agent.preflight`` exits 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.control.procs import TRAINGUARD, _env

SCRIPT = '''
import sys
import torch
from torch import nn
import trainer_agent as ta

mode, marker = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
agent = ta.attach(model, opt, job="cli", run="cli-1", config=ta.AgentConfig(metrics_port=None))
scale = 1e6 if mode == "explode" else 1.0   # gradients far above 1e3
batch = (torch.randn(32, 8), torch.randn(32, 1))
loss_fn = lambda m, b: scale * (m(b[0]) - b[1]).square().mean()
try:
    if mode != "no-preflight":
        agent.preflight(batch, loss_fn, clip_grad_norm=1.0)
    for _ in range(3):   # training
        loss = loss_fn(model, batch)
        loss.backward(); opt.step(); opt.zero_grad(); agent.end_step(loss.detach())
    open(marker, "w").write("trained")
finally:
    agent.close()
'''


def _run(tmp_path: Path, *args: str, cli: bool = True) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    cmd = [TRAINGUARD, "preflight", str(script), *args] if cli else [sys.executable, str(script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(), cwd=tmp_path)


def test_a_healthy_script_passes_and_does_not_train(tmp_path) -> None:
    marker = tmp_path / "trained"
    done = _run(tmp_path, "healthy", str(marker))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["CHECK", "STATUS", "DETAIL"]
    rows = {line.split()[0]: line.split()[1] for line in lines[1:-1]}
    assert rows["nonfinite"] == "PASS" and rows["grad_values"] == "PASS" and rows["grad_clip"] == "PASS"
    assert rows["controller"] == "SKIP" and "FAIL" not in rows.values()
    assert lines[-1].startswith(f"{sum(v == 'PASS' for v in rows.values())} pass")
    assert not marker.exists()  # stopped before the first training step
    # the same script run directly trains as usual
    assert _run(tmp_path, "healthy", str(marker), cli=False).returncode == 0 and marker.read_text() == "trained"


def test_a_failed_check_exits_1_with_the_table(tmp_path) -> None:
    marker = tmp_path / "trained"
    done = _run(tmp_path, "explode", str(marker))
    assert done.returncode == 1, done.stderr
    (row,) = [line for line in done.stdout.splitlines() if line.startswith("grad_values")]
    assert row.split()[1] == "FAIL" and "1e3" in row
    assert not marker.exists()


def test_a_script_without_preflight_exits_2_before_training(tmp_path) -> None:
    marker = tmp_path / "trained"
    done = _run(tmp_path, "no-preflight", str(marker))
    assert done.returncode == 2 and "started training without calling agent.preflight" in done.stderr
    assert not marker.exists()
    missing = subprocess.run([TRAINGUARD, "preflight", str(tmp_path / "nope.py")], capture_output=True, text=True,
                             timeout=60, env=_env())
    assert missing.returncode == 2 and "no such script" in missing.stderr
