"""trainer_agent/measure/compile_watch.py: which steps held a torch.compile compilation, with a real
torch.compile (backend ``eager``: Dynamo traces and guards as with inductor, without code generation)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from trainer_agent.compat import PrivateMemberMissing, torch_dynamo
from trainer_agent.measure.compile_watch import CompileWatch


def _no_error(kind: str, exc: BaseException) -> None:
    pytest.fail(f"{kind}: {exc}")


def test_a_step_that_compiles_is_told_from_one_that_runs_the_compiled_code() -> None:
    fn = torch.compile(lambda x: x.relu() * 3, backend="eager", dynamic=False)
    watch = CompileWatch(_no_error)
    try:
        steps = []
        for n in (2, 2, 2, 4, 4, 2, 4):  # (first call) (cached) (cached) (new shape) ... (both cached)
            fn(torch.ones(n))
            steps.append(watch.step_ended(warm_up=len(steps) == 0))
        assert steps == [True, False, False, True, False, False, False]
        assert watch.compile_steps == 1  # the first step's compilation is the warm-up's, not counted
        torch.compiler.reset()  # drops what was compiled (and every compile-end callback)
        assert watch.step_ended(warm_up=False) is True  # the step of the reset: compiled anew
        fn(torch.ones(2))
        assert watch.step_ended(warm_up=False) is True  # the callback went back in: the recompile is seen
        fn(torch.ones(2))
        assert watch.step_ended(warm_up=False) is False
        assert watch.compile_steps == 3
    finally:
        watch.remove()
    assert watch._callback not in torch_dynamo.compile_end_callbacks()
    fn(torch.ones(9))
    assert watch.step_ended(warm_up=False) is False and watch.compile_steps == 3  # closed: nothing watched


def test_a_missing_member_is_one_error_and_no_step_counts_as_compiled(monkeypatch) -> None:
    def gone() -> None:
        raise PrivateMemberMissing("gone")

    monkeypatch.setattr(torch_dynamo, "compile_end_callbacks", gone)
    errors: list[str] = []
    watch = CompileWatch(lambda kind, exc: errors.append(kind))
    fn = torch.compile(lambda x: x + 1, backend="eager", dynamic=False)
    fn(torch.ones(11))
    assert [watch.step_ended(warm_up=False) for _ in range(3)] == [False, False, False]
    assert errors == ["compile_watch"]


def test_before_torch_compile_is_used_nothing_is_imported_and_its_first_step_counts() -> None:
    """A run that never compiles does not import torch._dynamo (seconds) for the watch; the step in
    which torch.compile is first used counts as compiled (its import and first compilation), and
    the recompiles after it are seen (a fresh interpreter: this one has imported torch._dynamo)."""
    code = textwrap.dedent("""
        import sys, torch
        from trainer_agent.measure.compile_watch import CompileWatch
        watch = CompileWatch(lambda kind, exc: print("error", kind, exc))
        steps = [watch.step_ended(warm_up=False) for _ in range(2)]
        print("imported", "torch._dynamo" in sys.modules)
        fn = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
        for n in (3, 3, 5, 5):
            fn(torch.ones(n))
            steps.append(watch.step_ended(warm_up=False))
        print("steps", steps, watch.compile_steps)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, check=True).stdout
    assert out.splitlines() == ["imported False", "steps [False, False, True, False, True, False] 2"]
