"""bench/fsdp2_one_rank.py: each report compared with its own step and its own interval, and the
whole check run on the CPU (gloo, a world of one) as bench/device_check.sh runs it on a GPU."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

from tests.agent.test_step_stats import _bench

ROOT = Path(__file__).resolve().parents[2]


def test_a_report_is_compared_with_its_step_and_the_largest_of_its_interval() -> None:
    """Reports at steps 1, 6 and 11 (report_every 5: the first step reports): step 6's maximum is
    the largest of steps 2..6, not of 1..5 (step 1 belongs to the first report); a NaN reading is
    the worst difference there is."""
    check = _bench("fsdp2_one_rank").worst_difference
    refs = [9.0, 1.0, 2.0, 4.0, 3.0, 2.5, 1.0, 1.0, 1.0, 1.0, 1.5]
    assert check([(1, 9.0, 9.0), (6, 2.5, 4.0), (11, 1.5, 1.5)], refs) == 0.0
    assert check([(1, 9.0, 9.0), (6, 2.5, 9.0), (11, 1.5, 1.5)], refs) == 1.25  # 9 against 4
    assert check([(1, 9.0, 9.0), (6, 2.0, 4.0)], refs) == 0.2  # the norm against step 6's 2.5
    assert check([(1, math.nan, 9.0)], refs) == math.inf


def test_the_check_runs_on_the_cpu_and_passes() -> None:
    """The same program as on a GPU, on gloo: the agent's norms (the ordinary steps' from FSDP2's
    flat gradient buffers) agree with clip_grad_norm_'s, and the line device_check.sh reads."""
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "fsdp2_one_rank.py"), "--device", "cpu",
                           "--width", "32", "--blocks", "2", "--steps", "12"],
                          capture_output=True, text=True, timeout=240, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith("fsdp2 1 rank (cpu):") and "9 of 9 ordinary steps from the flat buffers" in line
