"""Shared pytest setup. Keep torch on one intra-op thread: the CI machine has 2 cores and tests
spawn processes of their own."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

try:
    import torch

    torch.set_num_threads(1)
except ImportError:  # pragma: no cover - torch is a hard dependency
    pass
