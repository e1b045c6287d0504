"""CUDA paths of the data monitor: batches on the device, and DataFeed.submit without a host sync.
Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from trainer_agent.data import DataFeed, DataMonitor

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(6):
        ids = torch.randint(0, 50_000, (8, 512), generator=g, dtype=torch.int64)
        ids[7] = ids[6]
        mask = torch.ones_like(ids)
        mask[0, 100 + i:] = 0
        out.append((ids, mask))
    return out


def test_cuda_batches_give_the_cpu_values():
    cpu, gpu = (DataMonitor(50_000, special_ids=(0, 1), window=20, reference_tokens=5000) for _ in range(2))
    for ids, mask in _batches():
        cpu.observe_batch(ids, mask)
        gpu.observe_batch(ids.cuda().to(torch.int32), mask.cuda().bool())
    assert gpu.values() == cpu.values()


def test_feed_submit_never_syncs_and_matches_cpu():
    cpu = DataMonitor(50_000, special_ids=(0, 1), window=20, reference_tokens=5000)
    fed = DataMonitor(50_000, special_ids=(0, 1), window=20, reference_tokens=5000)
    feed = DataFeed(fed, max_pending=64)
    device_batches = [(ids.cuda(), mask.cuda()) for ids, mask in _batches()]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising CUDA call in submit raises
    try:
        for ids, mask in device_batches:
            # Work queued on the stream before the copy: the copy must wait for it, not the host.
            ids = (ids + 0) * 1
            assert feed.submit(ids, mask)
        feed.submit(torch.full((2, 4), 60_000, device="cuda"))  # out of vocabulary: counted
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert feed.flush(timeout=30)
    for ids, mask in _batches():
        cpu.observe_batch(ids, mask)
    assert feed.errors == 1 and feed.dropped == 0
    assert fed.values() == cpu.values()
    assert feed.close(timeout=5)
