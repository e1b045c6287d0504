"""Time spent in data-parallel gradient communication, and the part of it backward compute did not
hide (``trainguard_comm_seconds``, ``trainguard_comm_exposed_seconds``,
``trainguard_comm_exposed_ratio``).

How it is measured: a DDP communication hook (``DistributedDataParallel.register_comm_hook``) that
launches DDP's default all-reduce (``default_hooks.allreduce_hook``, the same work DDP does without
a hook) and takes a host timestamp at each bucket's launch and, through ``fut.then``, at its
future's completion. For one optimizer step:

- ``comm`` = the **union** of the buckets' launch -> completion intervals: the wall time during
  which at least one bucket was in flight. Not their sum: buckets overlap in flight (gloo works on
  several at once), and a sum would count those stretches twice and could exceed the step itself.
- ``exposed`` = the last completion minus the end of backward compute, clipped at 0. DDP launches
  a bucket as soon as its last gradient is accumulated and launches them in order, so the last
  launch is the moment the backward's last gradient was ready: what comes after it is
  communication the training loop waited for (DDP's end-of-backward callback blocks on every
  bucket). A step of several backward passes that all-reduce each (accumulation without
  ``no_sync``) has its exposed time measured for its last pass only (an underestimate, never more).

Per report interval the gauges are the mean per optimizer step over the interval's steps (steps
without communication, e.g. under ``no_sync``, count 0), and ``exposed_ratio`` = the interval's
exposed time over its wall time (the sum of its step durations).

The first step after attach and a step in which torch.compile compiled
(``trainer_agent/measure/compile_watch.py``) are left out, as from the step timings: their first
all-reduce waits for the slowest rank's warm-up or compilation (a rank that loads its data or
compiles a second longer shows a second of exposed communication on the others), and on the first
step the communicator's own setup. A report whose interval held only such steps (the report of the
first step) has none of these values (absent, NaN in the rank's row).

NaN, never a made-up value:
- the user registered a communication hook of their own (DDP accepts one only): the agent's
  registration fails, is logged once as an agent error, and training goes on with the user's hook;
- CUDA (NCCL): ProcessGroupNCCL marks a collective's future complete when the collective is
  enqueued on its stream, and ``then`` callbacks run on the host right away (ordered after the
  collective on the device only), so host timestamps would measure the launch, not the transfer;
- FSDP2 (``fully_shard``): its reduce-scatters run inside its own backward hooks, with no
  communication-hook interface in torch 2.13; timing them would mean the profiler on every step.

The hook costs one Python call per bucket and one per completion (DDP's default path runs in
C++); ``bench/agent_overhead.py --distributed --comm-timing`` measures it side by side. It is
opt-in (``AgentConfig.comm_timing``): DDP takes a single communication hook, so with it on, a
user's ``register_comm_hook`` after ``attach`` would raise in the user's code.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

__all__ = ["step_comm", "CommTiming", "COMM_METRICS", "MAX_BUCKETS"]

#: Bucket timestamps kept between two ``end_step`` calls at most (a loop that never calls it, or
#: runs many backward passes per step, keeps the newest ones).
MAX_BUCKETS = 4096

#: The catalogue metrics :meth:`CommTiming.take` returns.
COMM_METRICS = ("trainguard_comm_seconds", "trainguard_comm_exposed_seconds", "trainguard_comm_exposed_ratio")


def step_comm(intervals: Sequence[tuple[float, float]], backward_end: float | None = None) -> tuple[float, float]:
    """(union of the ``(launch, done)`` intervals, exposed time) of one step's buckets.

    ``backward_end``: when the last gradient was ready; None: the last launch (see the module
    docstring). ``ValueError`` for an interval that ends before it starts."""
    if not intervals:
        return 0.0, 0.0
    union, reach = 0.0, -math.inf
    for start, done in sorted(intervals):
        if done < start:
            raise ValueError(f"a bucket's communication ends ({done}) before it starts ({start})")
        if start > reach:  # a gap: a new stretch of communication
            union += done - start
            reach = done
        elif done > reach:  # overlaps the stretch in progress: extend it
            union += done - reach
            reach = done
    end = max(s for s, _ in intervals) if backward_end is None else backward_end
    return union, max(0.0, reach - end)


class CommTiming:
    """The communication hook of one DDP model and the interval's sums (see the module docstring).

    ``on_error(kind, exc)`` counts and logs the agent's errors; ``clock`` is the host clock."""

    def __init__(self, model: nn.Module, *, on_error: Callable[[str, BaseException], None],
                 clock: Callable[[], float]) -> None:
        self._clock = clock
        self._on_error = on_error
        self._bucket_times: list[tuple[float, float]] = []
        self._comm = self._exposed = self._wall = 0.0
        self._steps = 0
        #: Why the values are NaN (None while they are measured).
        self.unmeasured: str | None = self._register(model)

    def _register(self, model: nn.Module) -> str | None:
        if not isinstance(model, nn.parallel.DistributedDataParallel):
            return "not a DistributedDataParallel model (FSDP2 has no communication hook)"
        if any(p.is_cuda for p in model.parameters()):
            return "CUDA: a NCCL future completes on the host at launch"
        try:
            model.register_comm_hook(model.process_group, self._hook)
        except RuntimeError as exc:  # the user's own hook is registered (DDP takes one)
            self._on_error("comm_timing", exc)
            return "the model has a communication hook of its own"
        return None

    def _hook(self, process_group, bucket):  # type: ignore[no-untyped-def]
        # No annotations: DDP refuses a hook whose annotations are not dist.GradBucket and
        # Future[Tensor] themselves, and this module's are strings (postponed evaluation).
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        launch = self._clock()
        fut = allreduce_hook(process_group, bucket)

        def done(f: torch.futures.Future) -> torch.Tensor:
            times = self._bucket_times
            if self.unmeasured is None:
                times.append((launch, self._clock()))  # a worker thread's append: atomic
                if len(times) > MAX_BUCKETS:
                    del times[:-MAX_BUCKETS]
            return f.value()

        return fut.then(done)

    def remove(self) -> None:
        """Stop timing (the agent closes; DDP keeps the hook, which then only all-reduces)."""
        if self.unmeasured is None:
            self.unmeasured = "the agent is closed"
        self._bucket_times = []

    def step_ended(self, duration: float, warm_up: bool = False) -> None:
        """Close one optimizer step of ``duration`` seconds (DDP's backward waited for every bucket).
        ``warm_up``: the first step after attach, or one that compiled (``CompileWatch``): its
        buckets are dropped, not counted (see the module docstring)."""
        if self.unmeasured is not None:
            return
        times, self._bucket_times = self._bucket_times, []
        if warm_up:
            return
        try:
            comm, exposed = step_comm(times)
        except ValueError as exc:  # a clock that went backwards: this step is left out
            self._on_error("comm_timing", exc)
            return
        self._comm += comm
        self._exposed += exposed
        self._wall += duration
        self._steps += 1

    def take(self) -> dict[str, float]:
        """The interval's values (:data:`COMM_METRICS`), NaN when unmeasured, none when every step
        of the interval was left out (the warm-up's report); starts the next interval."""
        steps, wall = self._steps, self._wall
        if self.unmeasured is not None:
            return dict.fromkeys(COMM_METRICS, math.nan)
        if steps == 0:
            return {}
        values = {"trainguard_comm_seconds": self._comm / steps,
                  "trainguard_comm_exposed_seconds": self._exposed / steps,
                  "trainguard_comm_exposed_ratio": self._exposed / wall if wall > 0 else math.nan}
        self._comm = self._exposed = self._wall = 0.0
        self._steps = 0
        return values
