"""bench/device_check.sh on a machine without a GPU: the clean message, the table when the time
budget is spent, and the CUDA tests it runs (every test skipped without a GPU)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "device_check.sh"
PARTS = ["cuda tests", "agent overhead", "fsdp2 one rank", "ops and kernels", "ddp bucket kernels",
         "fingerprint kernels", "reaction latency"]


def _run(*args: str, out: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHON": sys.executable, "OUT": str(out), **env})


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message of a machine without a GPU")
def test_without_a_gpu_it_says_so_and_exits_0(tmp_path: Path) -> None:
    done = _run(out=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("device_check: no CUDA device on this machine")
    assert list(tmp_path.iterdir()) == []


def test_a_spent_budget_leaves_every_part_unrun_in_the_table(tmp_path: Path) -> None:
    """The CPU rehearsal with no time left: no part starts, and the table (printed and written
    to $OUT/summary.txt, the one file) lists each part as not run."""
    done = _run("--cpu", out=tmp_path, DEVICE_CHECK_BUDGET_S="0")
    assert done.returncode == 0, done.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["summary.txt"]
    table = (tmp_path / "summary.txt").read_text().splitlines()
    assert table[0].startswith("device_check summary (cpu; logs in ")
    rows = [[cell.strip() for cell in line.split("|")] for line in table[2:]]
    assert [row[:3] for row in rows] == [[name, "not run (budget)", "0 s"] for name in PARTS]
    assert done.stdout.endswith("\n".join(table) + "\n")


def test_it_runs_every_test_that_needs_a_gpu() -> None:
    """Each test module holding a test skipped without CUDA is named in the script's pytest call."""
    guarded = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "tests").rglob("test_*.py")
                     if re.search(r"skipif\(\s*not torch\.cuda\.is_available\(\)", path.read_text()))
    named = set(re.findall(r"tests/[\w/]+\.py", SCRIPT.read_text()))
    assert guarded and [path for path in guarded if path not in named] == []
