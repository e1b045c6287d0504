"""The agent's diagnostics: the gradient recompute check (``trainer_agent/diagnostics/verify.py``), the memory
trace (``trainer_agent/diagnostics/memory_trace.py``) and the pre-flight (``trainer_agent/diagnostics/preflight.py``), run
on the agent's ``TrainParts``, with their results sent to the controller by the leader."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from torch import nn

from trainer_agent.config import AgentConfig
from trainer_agent.diagnostics.preflight import PreflightOnly
from trainer_agent.measure.step_clock import StepClock
from trainer_agent.measure.train_parts import TrainParts

__all__ = ["Diagnostics"]

#: The diagnostics log under the facade's name (``trainer_agent/agent.py``).
log = logging.getLogger("trainer_agent.agent")


class Diagnostics:
    """``client()``: the controller's client (the leader's; None elsewhere or without a
    controller); ``on_error(kind, exc)``: the agent's error log; ``preflight_only``: under
    ``trainguard preflight``."""

    def __init__(self, parts: TrainParts, config: AgentConfig, clock: StepClock, *,
                 client: Callable[[], Any], on_error: Callable[[str, BaseException], None],
                 preflight_only: bool) -> None:
        self.parts, self.config, self.clock = parts, config, clock
        self._client, self._on_error = client, on_error
        self.preflight_only = preflight_only
        self.verifier: Any = None
        if parts.params.sharding is None:  # a rank's shards are not a replica's gradient: no recompute check
            from trainer_agent.diagnostics.verify import GradientVerifier

            self.verifier = GradientVerifier(parts, every=config.verify_every, rel_tol=config.verify_rel_tol)
            if config.verify_every == 1:
                self.verifier.arm()
        self.trace: Any = None
        #: The last memory trace's owners of retained memory, worst first (``trace_memory``).
        self.memory_report: list[Any] | None = None

    # ------------------------------------------------------------------ the recompute check

    def verify_step(self, batch: Any, loss_fn: Callable[[nn.Module, Any], Any] | None) -> Any:
        """``Agent.verify_step``: the armed step's recompute, its time counted as overhead."""
        verifier = self.verifier
        if verifier is None or not verifier.armed:
            return None
        clock = self.clock
        t0 = clock.now()
        try:
            return verifier.verify(batch, loss_fn)
        except ValueError:
            raise
        except Exception as exc:
            self._on_error("verify", exc)
            return None
        finally:
            clock.overhead += clock.now() - t0

    def diagnose(self, command: str, step: int) -> None:
        """The controller's diagnostic commands, applied at ``step`` on every rank."""
        if command in ("verify", "verify_float32"):
            if self.verifier is not None:
                self.verifier.arm(float32=command == "verify_float32")  # the next step, on every rank
        elif command == "memory_trace":
            self.trace_memory(self.config.memory_trace_steps)

    # ------------------------------------------------------------------ the memory trace

    def trace_memory(self, steps: int) -> None:
        from trainer_agent.diagnostics.memory_trace import MemoryTrace

        if self.trace is not None:
            self.trace.stop()
        self.memory_report = None
        self.trace = MemoryTrace(self.parts.model, steps, self._memory_done, device=self.parts.device)

    def end_trace_step(self) -> None:
        """At ``end_step`` while a trace runs: count the step; the trace ends after its last."""
        try:
            if self.trace.on_end_step():
                self.trace = None
        except Exception as exc:
            self._on_error("memory_trace", exc)
            self.trace.stop()
            self.trace = None

    def _memory_done(self, report: list[Any]) -> None:
        self.memory_report = report
        rank = self.parts.rank
        log.warning("trainguard memory trace (rank %d): memory kept alive across steps, per step: %s", rank,
                    "; ".join(f"{r.owner}: {r.bytes_per_step / 2**20:.2f} MiB in {r.tensors} tensor(s)"
                              for r in report[:8]) or "nothing")
        client = self._client()
        if client is not None:  # the leader: the run's status and the memory_growth alert show it
            from trainer_agent.diagnostics.memory_trace import to_wire

            client.post_memory_report(to_wire(self.trace, report, rank=rank, step=self.clock.step,
                                              cuda=self.parts.device.type == "cuda"))

    # ------------------------------------------------------------------ the pre-flight

    def preflight(self, batch: Any, loss_fn: Callable[[nn.Module, Any], Any] | None, *, metrics_url: str | None,
                  control: Any, fatal: bool | tuple[str, ...] | None, **options: Any) -> Any:
        """``Agent.preflight``: ``options`` are ``run_preflight``'s."""
        from trainer_agent.diagnostics.preflight import raise_if_fatal, run_preflight, to_wire

        config, rank = self.config, self.parts.rank
        report = run_preflight(self.parts, config, batch, loss_fn, metrics_url=metrics_url, control=control,
                               timeout=config.request_timeout_s, **options)
        client = self._client()
        if client is not None:
            why = client.post_preflight(to_wire(report, rank))
            if why is not None:
                log.warning("trainguard: the controller did not take the pre-flight result: %s", why)
        if self.preflight_only:
            raise PreflightOnly(report, rank)  # ``trainguard preflight``: the checks only
        raise_if_fatal(report, config.preflight_fatal if fatal is None else fatal)
        return report

    def close(self) -> None:
        if self.trace is not None:
            self.trace.stop()
            self.trace = None
        if self.verifier is not None:
            self.verifier.close()
