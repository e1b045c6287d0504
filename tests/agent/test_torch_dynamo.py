"""TorchDynamo's private member (``trainer_agent/compat/torch_dynamo.py``), exercised with a real
torch.compile: the test fails when the member is gone or no longer calls its callbacks once per
compilation (the first call, a recompile after a guard failed, a reset)."""

from __future__ import annotations

import pytest
import torch

from trainer_agent.compat import torch_dynamo

pytestmark = pytest.mark.usefixtures("no_adapter_fallback")


def test_compile_end_callbacks_run_once_per_compilation() -> None:
    fn = torch.compile(lambda x: (x * 2).sin(), backend="eager", dynamic=False)  # imports torch._dynamo
    callbacks = torch_dynamo.compile_end_callbacks()
    assert isinstance(callbacks, list)
    ended: list[object] = []
    callback = ended.append
    callbacks.append(callback)
    try:
        fn(torch.ones(3))  # compiled at its first call
        fn(torch.ones(3))  # runs what was compiled
        assert len(ended) == 1
        fn(torch.ones(5))  # a new shape: the shape guard fails, compiled again
        assert len(ended) == 2
        assert torch_dynamo.compile_end_callbacks() is callbacks  # the live list, not a copy
    finally:
        callbacks.remove(callback)
    fn(torch.ones(7))
    assert len(ended) == 2  # removed: no longer called
