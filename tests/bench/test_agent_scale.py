"""bench/agent_scale.py: the CUDA kernel count taken on the very steps whose operators are counted."""

from __future__ import annotations

from tests.agent.test_step_stats import _bench


def test_kernels_are_counted_on_the_counted_steps_and_a_report_step_is_among_them() -> None:
    """With a kernel counter (the profiler's on CUDA; here one that counts its calls) the report
    step keeps its place: one round of a report interval (10 steps) counts 10 plain and 10 watched
    steps, one of them a report step, and the operator counts are those of a run without the
    counter (an extra profiled step per round once put every counted step off the report step:
    the result had no report row and the script stopped with a KeyError on a GPU)."""
    scale = _bench("agent_scale")
    calls: list[int] = []

    def kernels(fn) -> int:
        fn()
        calls.append(1)
        return 7

    with_counter = scale.measure(20_000, 10, rounds=1, device="cpu", kernels=kernels)
    without = scale.measure(20_000, 10, rounds=1, device="cpu")
    assert len(calls) == 20
    assert "kernels" not in without and "report_kernels" in with_counter
    assert with_counter["kernels"] == with_counter["report_kernels"] == 0  # 7 with the agent minus 7 without
    for key in ("ops", "report_ops", "computing", "report_computing", "launches", "report_launches"):
        assert with_counter[key] == without[key], key
