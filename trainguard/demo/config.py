"""The demo's configuration (:class:`DemoConfig`) and what it returns (:class:`DemoResult`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from trainguard.demo.model import FaultPlan

__all__ = ["JOB", "DemoConfig", "DemoResult", "say"]

JOB = "demo"
#: The fault steps' single source: the demo's defaults are the FaultPlan's.
_FAULTS = FaultPlan()


@dataclass(kw_only=True, slots=True)
class DemoConfig:
    """Everything the demo does; the defaults are the README's demo.

    A declarative configuration (one field per knob, each with its default and its doc), kept as
    one dataclass over the ~20-attribute guideline: splitting it would split ``asdict(cfg)``, which
    the spawned ranks receive, and the one place a reader looks up a default."""

    steps: int = 150
    """Optimizer steps per rank."""
    world_size: int = 2
    """gloo ranks (processes) on this machine."""
    report_every: int = 5
    """Steps between reports to the controller (and status lines)."""
    seq_len: int = 128
    """Bytes per training sequence."""
    batch_size: int = 8
    """Sequences per rank per step."""
    lr: float = 2e-3
    """Peak AdamW learning rate."""
    burst: tuple[int, int] = _FAULTS.burst
    """Steps [start, end) with duplicated and corrupted data."""
    lr_blowup: tuple[int, int | None] = _FAULTS.lr_blowup
    """Steps [start, end) where the LR schedule overshoots by ``lr_blowup_factor`` (end None: for good)."""
    lr_blowup_factor: float = _FAULTS.lr_blowup_factor
    """How far the bad schedule overshoots."""
    nan_step: int = _FAULTS.nan_step
    """Step whose loss turns NaN on the last rank."""
    snapshot_every: int | None = 10
    """Steps between the agent's in-memory snapshots (what a rollback restores; None: none)."""
    snapshot_keep: int = 4
    """Snapshots kept per rank (spaced out: the oldest is 70 to 140 steps old)."""
    healthy_reference: bool = True
    """Also train the run without faults and without trainguard, to compare the final losses."""
    resume_after_s: float = 2.0
    """If the ladder ever pages a human (pauses the run), how long the demo, standing in for
    them, looks at it before resuming."""
    controller: str | None = None
    """URL of a running controller; None starts one on loopback."""
    agent_token: str | None = None
    """Agent token for an external controller (default: env TRAINGUARD_TOKEN)."""
    operator_token: str | None = None
    """Operator token for an external controller (default: env TRAINGUARD_OPERATOR_TOKEN); without
    one the demo cannot resume a paused run and says how to do it by hand."""
    metrics_host: str = "127.0.0.1"
    """Where the ranks serve /metrics (0.0.0.0 in a container)."""
    metrics_port: int = 0
    """Base port of the ranks' /metrics (0: free ports)."""
    prometheus: bool = False
    """Also start Prometheus (binary on PATH) with the generated configuration."""
    keep_running: bool = False
    """After the summary, keep the controller (and Prometheus) running until Ctrl-C."""
    workdir: str | None = None
    """Where the SQLite file and logs go (default: a temporary directory)."""
    run: str | None = None
    """Run id (default: demo-<time>)."""
    quiet: bool = False
    """No live output (the summary is still returned)."""
    timeout_s: float = 600.0
    """The demo gives up after this long."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.world_size < 1 or self.report_every < 1:
            raise ValueError("steps, world_size and report_every must be >= 1")
        if self.seq_len < 8 or self.batch_size < 4:
            raise ValueError("seq_len must be >= 8 and batch_size >= 4")
        if not self.lr > 0:
            raise ValueError("lr must be > 0")


@dataclass(slots=True)
class DemoResult:
    """What happened, from the controller's records."""

    run: str
    steps_completed: list[int]
    """Last step each rank completed."""
    alerts: list[dict[str, Any]] = field(default_factory=list)
    """Every alert: rule, severity, step (of the report that fired it), actions, summary."""
    actions: list[dict[str, Any]] = field(default_factory=list)
    """Every change of desired state: generation, actor, what changed, step applied on all ranks."""
    rank_logs: list[list[dict[str, Any]]] = field(default_factory=list)
    """Per rank: one entry per step (step, loss, lr used, lr_scale, paused wait)."""
    incidents: list[dict[str, Any]] = field(default_factory=list)
    """The run's incidents, oldest first: onset, the rungs of the escalation ladder, outcome."""
    healthy_losses: list[float] = field(default_factory=list)
    """Per step, the loss of the run without faults (empty without ``healthy_reference``)."""

    def final_loss(self, last: int = 10) -> float:
        """Mean loss of the last ``last`` steps, over every rank (the global batch's loss)."""
        return _tail_mean([sum(e["loss"] for e in es) / len(es) for es in zip(*self.rank_logs)], last)

    def healthy_final_loss(self, last: int = 10) -> float | None:
        return _tail_mean(self.healthy_losses, last) if self.healthy_losses else None


def _tail_mean(xs: list[float], last: int) -> float:
    tail = xs[-last:]
    return sum(tail) / len(tail) if tail else math.nan


def say(cfg: DemoConfig, msg: str) -> None:
    if not cfg.quiet:
        print(msg, flush=True)
