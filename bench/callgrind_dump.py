"""Reading a callgrind count back (``bench/controller_instructions.py``, ``bench/agent_instructions.py``)."""

from __future__ import annotations

import glob
from pathlib import Path


def dumped_instructions(out: str) -> int:
    """The instructions counted in the newest dump that ``callgrind_control -d`` wrote for the
    ``--callgrind-out-file=out`` of a process (``out.1``, ``out.2``, ...)."""
    dumps = [f for f in glob.glob(out + ".*") if f.rsplit(".", 1)[1].isdigit()]
    if not dumps:
        raise SystemExit("callgrind wrote no dump")
    for line in Path(max(dumps, key=lambda f: int(f.rsplit(".", 1)[1]))).read_text(errors="replace").splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1])
    raise SystemExit("no summary line in the callgrind dump")
