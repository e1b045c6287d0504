"""The diagnostics a training loop asks the agent for: the pre-flight checks before the first step,
the recompute check of a step's gradient and the memory trace (``Agent`` is the facade that holds
them; the work is ``trainer_agent/agent_parts/diagnostics.py``'s)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["DiagnosticCalls"]


class DiagnosticCalls:
    """``Agent``'s diagnostic calls, on what the agent holds: ``diagnostics`` (its
    ``Diagnostics``), ``hooks``, ``control`` and ``metrics_url``."""

    def preflight(self, batch: Any, loss_fn: Callable[[nn.Module, Any], Any] | None = None, *,
                  declared_params: int | None = None, clip_grad_norm: float | None | str = "unknown",
                  fatal: bool | tuple[str, ...] | None = None, loader: Any = None,
                  amp_dtype: torch.dtype | None = None, pad_id: int | None = None,
                  max_length: int | None = None) -> Any:
        """Run the pre-flight checks on ``batch`` before the first step (``trainer_agent/diagnostics/preflight.py``):
        one forward/backward and a simulated optimizer step that leave the weights, gradients,
        optimizer state, buffers and RNG states unchanged. ``loss_fn(model, batch)`` returns the
        loss (default: ``model(batch)``, or its ``.loss``); ``declared_params``: the model size the
        optimizer checks assume; ``clip_grad_norm``: what the loop clips to (None: no clipping).
        ``loader``: the loader the loop reads (its throughput and prefetch depth are checked, its
        position restored); ``amp_dtype``: the autocast dtype the loop trains in (float16 is
        assumed with an enabled GradScaler); ``pad_id`` / ``max_length``: the padding token and the
        longest sequence, for the loss-boundary inputs (``max_length`` defaults to the model
        config's). Sends the result to the controller (rank 0) and logs it; returns a ``PreflightReport``.
        ``fatal`` (default ``config.preflight_fatal``): ``RuntimeError`` for a failed check.
        Under ``trainguard preflight`` (``$TRAINGUARD_PREFLIGHT_ONLY``) raises ``PreflightOnly``
        after the checks: the script stops there, and the command prints the table.
        ``ValueError`` for bad arguments or after the first step."""
        return self.diagnostics.preflight(batch, loss_fn, metrics_url=self.metrics_url, control=self.control,
                                          fatal=fatal, declared_params=declared_params, clip_grad_norm=clip_grad_norm,
                                          loader=loader, amp_dtype=amp_dtype, pad_id=pad_id, max_length=max_length)

    def verify_step(self, batch: Any, loss_fn: Callable[[nn.Module, Any], Any] | None = None) -> Any:
        """Call once per step after the backward pass(es) and before ``optimizer.step()``; when the
        step is due (``AgentConfig.verify_every``, ``request_verify``, the controller's ``verify``
        command) recompute its gradient on ``batch`` (the step's last micro-batch) and compare it
        with the one it produced (``trainer_agent/diagnostics/verify.py``); every rank calls it. ``loss_fn(model,
        batch)`` returns the loss the loop called ``backward`` on (inside the same autocast, divided
        by the accumulation steps if the loop does), before the GradScaler's scale (default
        ``model(batch)``, or its ``.loss``). Not under sharded parameters (always None). Returns a ``VerifyResult``, or None when the
        step is not due or the check failed (counted in ``trainguard_agent_errors_total``).
        Weights, gradients, optimizer state, buffers and the RNG stream are left as they were.
        ``ValueError`` when called after ``optimizer.step()`` of a due step."""
        return self.diagnostics.verify_step(batch, loss_fn)

    def request_verify(self, *, float32: bool = False) -> None:
        """Check the gradient of the next step whose forward pass starts after this call; call it
        on every rank at the same point of the loop. ``float32``: also recompute that step with
        mixed precision off and measure how far its gradient is from the step's
        (``trainguard_verify_float32_rel_diff``; ``trainer_agent/diagnostics/verify.py``)."""
        verifier = self.diagnostics.verifier
        if verifier is not None:
            verifier.arm(float32=float32)
            self.hooks.sync_grad_hooks()

    def trace_memory(self, steps: int = 3) -> None:
        """Attribute memory retained across steps to the layers or the training loop for the next
        ``steps`` steps (``trainer_agent/diagnostics/memory_trace.py``; expensive while it runs). The result
        goes to the log and to ``memory_report``. ``ValueError`` for a bad ``steps``; a trace
        already running is replaced."""
        self.diagnostics.trace_memory(steps)
