"""Gradient recompute check (silent data corruption): recompute one step's gradient on the same
batch and compare it with the gradient the step produced, on every rank.

    agent = attach(model, opt, job=..., run=..., config=AgentConfig(verify_every=1000))
    for batch in loader:
        loss = loss_fn(model, batch)
        scaler.scale(loss).backward()
        agent.verify_step(batch, loss_fn)     # a no-op unless this step is due; before optimizer.step()
        scaler.step(opt); scaler.update(); opt.zero_grad()
        agent.end_step(loss)

A step is due every ``AgentConfig.verify_every`` steps (steps whose number is a multiple of it),
after ``agent.request_verify()`` (the next step, on this rank: call it on every rank), or after the
controller's ``verify`` command (the next step after the one at which every rank applied it).

**What is compared.** While a due step runs, the agent records (a) at the start of each forward
pass of the model the random number generators' states (CPU and this rank's CUDA device), and (b)
in the gradient hooks, for every parameter, ``K`` element-wise random projections of the gradient
that pass produced on this rank *before* any all-reduce (``trainer_agent/measure/fingerprint.py``: every
weight is +-1, so one element changed by ``d`` moves a projection by exactly ``d``). With several
micro-batches the last forward/backward is the one compared, so ``batch`` is the step's last
micro-batch. The loss must go through the attached model's ``forward`` (``model(...)``): a loss
computed by a method beside it runs no forward hook, and the check is refused (an agent error). ``verify_step`` then runs the forward and backward of ``loss_fn(model, batch)`` again
from the recorded RNG states (dropout draws the same mask), under DDP inside ``model.no_sync()``
(the local gradient, no all-reduce: each rank checks its own device), with the GradScaler's scale
applied as the loop did and under the autocast the step's forward ran under (when ``verify_step``
is called outside it), and compares the projections layer by layer:

    rel_diff(layer) = max_k |f_k(first) - f_k(again)| / ||g_layer(again)||

The step is a mismatch when the largest ``rel_diff`` exceeds ``AgentConfig.verify_rel_tol``.

**Tolerance: relative 1e-5, not bitwise.** On the CPU and with deterministic kernels both passes
are bit-identical (``VerifyResult.bitwise`` says so). On a GPU several kernels are not
deterministic (atomic adds in scatter/index backward, split-K matrix products, some cuDNN
algorithms): their sums are reordered from run to run and differ by a few units in the last
place, ~1e-7 relative in float32. A bitwise check would flag those; 1e-5 (the tolerance the
stability guide gives for ranks' gradients) stays 100x above that noise and still catches one
corrupted element of 1e-5 of its layer's norm.

**Training is not changed.** Weights are not touched; every parameter's ``.grad``, the module
buffers (e.g. BatchNorm statistics) and the RNG states are restored after the recompute, the
optimizer is not involved, and the agent's own step measurements ignore the recompute, so a run
with checks follows the same weights, bit for bit, as one without (tested). The cost of a check is
one forward and backward pass; its result is read once (a SYNC, on checked steps only).

**Float32 recompute (mixed precision).** ``agent.request_verify(float32=True)`` or the controller's
``verify_float32`` command (the troubleshooting experiment of an incident of unknown cause asks for
it) also recomputes the armed step with mixed precision off: the forward pre-hook records whether
the step's forward ran under ``torch.autocast`` (and in which dtype), and the recompute runs
``loss_fn`` under ``torch.autocast(enabled=False)``, from the same RNG states and with the same loss
scale, and is compared with the step's gradient in the same way. The result is
``trainguard_verify_float32_rel_diff`` and the report's per-rank ``verify_float32`` vector: rounding
stays near the format's precision on a healthy step (~1e-3 to 1e-2 for bfloat16), a large value or
inf (a float16 overflow) says the mixed-precision numerics changed the gradient. It is not measured
(NaN, logged once) when the step ran without autocast (nothing to compare: the same-precision check
covers it), when the parameters themselves are not float32 or float64 (there is no float32 copy of
the model to run), or when ``loss_fn`` enters autocast itself, which an outer
``autocast(enabled=False)`` cannot undo: let the loop's ``with torch.autocast(...)`` wrap the call of
``loss_fn`` rather than the function itself — the same-precision recompute re-enters the autocast the
step's forward ran under, so such a ``loss_fn`` serves both checks. A float32 request never counts as
a mismatch of the same-precision check; the armed step runs both recomputes (two forward and backward
passes).

Not under sharded parameters (FSDP2, tensor parallel): a rank's gradient shards come out of a
reduce-scatter, so there is no local gradient of the whole layer to recompute.

Results: ``trainguard_verify_steps_total``, ``trainguard_verify_mismatches_total``,
``trainguard_verify_rel_diff`` (and ``trainguard_verify_float32_rel_diff``) on this rank's /metrics; the report's per-rank ``verify_mismatch``
vector (the controller's critical ``gradient_recompute_mismatch`` rule names the rank); a warning
in the log naming the layer.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from trainer_agent.measure.fingerprint import Fingerprinter, rel_diff
from trainer_agent.measure.module_hooks import add_forward_pre_hook
from trainer_agent.measure.train_parts import TrainParts

__all__ = ["VerifyResult", "VerifyTally", "GradientVerifier"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class VerifyResult:
    """One checked step on this rank."""

    step: int
    """The step checked (its number, as ``end_step`` will count it)."""
    rel_diff: float
    """Largest relative difference over the layers (0: identical projections)."""
    layer: str
    """The layer of ``rel_diff``."""
    bitwise: bool
    """Every projection of every parameter identical in both passes."""
    mismatch: bool
    """``rel_diff`` above the tolerance."""
    seconds: float
    float32_rel_diff: float = math.nan
    """The float32 recompute's largest relative difference over the layers (NaN: not asked for,
    or not measured: see the module docstring)."""
    float32_layer: str = ""
    """The layer of ``float32_rel_diff``."""


class VerifyTally:
    """The checks' results on this rank: their counts, the last results, and the largest relative
    differences since the last report (taken by it)."""

    def __init__(self) -> None:
        self.checks = 0
        self.mismatches = 0
        self.last: VerifyResult | None = None
        self.last_float32 = math.nan
        self._pending = math.nan  # rel_diff of the last check since the last report
        self._pending_float32 = math.nan

    def add(self, result: VerifyResult) -> None:
        """A check's result (of the same-precision recompute)."""
        self.checks += 1
        self.mismatches += int(result.mismatch)
        self.last = result
        self._pending = _largest(self._pending, result.rel_diff)

    def add_float32(self, value: float) -> None:
        """A float32 recompute's largest relative difference."""
        self.last_float32 = value
        self._pending_float32 = _largest(self._pending_float32, value)

    def take(self) -> float:
        """The largest ``rel_diff`` checked since the previous call (NaN: none)."""
        value, self._pending = self._pending, math.nan
        return value

    def take_float32(self) -> float:
        """The largest float32 recompute ``rel_diff`` since the previous call (NaN: none)."""
        value, self._pending_float32 = self._pending_float32, math.nan
        return value

    def values(self) -> dict[str, float]:
        out = {"trainguard_verify_steps_total": float(self.checks),
               "trainguard_verify_mismatches_total": float(self.mismatches)}
        if self.last is not None:
            out["trainguard_verify_rel_diff"] = self.last.rel_diff
        if not math.isnan(self.last_float32):
            out["trainguard_verify_float32_rel_diff"] = self.last_float32
        return out


def _largest(pending: float, value: float) -> float:
    """``value``, or the larger of the two when a value is ``pending`` (not NaN)."""
    return value if math.isnan(pending) else max(pending, value)


class GradientVerifier:
    """The agent's recompute check (see the module docstring). ``parts``: the model, parameters,
    scaler, forward timer and step reader of the agent (``TrainParts``)."""

    def __init__(self, parts: TrainParts, *, every: int | None, rel_tol: float) -> None:
        params = parts.params
        self.parts = parts
        self.every = every
        self.rel_tol = rel_tol
        self.fp = Fingerprinter([p.numel() for p in params.params], params.layer_ids, len(parts.layers),
                                device=parts.device)
        self._first = torch.zeros(len(params.params), self.fp.k, dtype=torch.float64, device=parts.device)
        self.armed = False
        self.recomputing = False
        self._stepped = False
        self._rng: tuple[torch.Tensor, list[torch.Tensor] | None] | None = None
        self._handle: Any = None
        self._grads_seen = False
        self.results = VerifyTally()
        self.float32 = False  # the armed step is also recomputed in float32
        self._autocast: tuple[bool, torch.dtype] | None = None  # the armed step's forward: (autocast on, its dtype)
        self._recompute_autocast = False  # autocast was on inside the float32 recompute's forward
        self._refused: set[str] = set()  # reasons a float32 recompute was not measured, logged once each

    # ------------------------------------------------------------------ scheduling

    def arm(self, *, float32: bool = False) -> None:
        """Record the next step's forward RNG state and incoming gradients; ``float32``: also
        recompute that step with mixed precision off."""
        if float32:
            self.float32 = True
        if self.armed:
            return
        self.armed, self._stepped, self._rng, self._grads_seen = True, False, None, False
        self._handle = add_forward_pre_hook(self.parts.model, self._pre_forward)

    def disarm(self) -> None:
        self.armed = self.float32 = False
        self._rng = self._autocast = None
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def on_end_step(self, step: int) -> None:
        """After ``end_step`` of ``step``: a due step not checked is dropped; arm the next if due."""
        if self.armed:
            if self._rng is None and not self._grads_seen:
                self._stepped = False  # no pass since armed (e.g. a skipped step): the next one is checked
            else:
                self.disarm()  # a due step the loop did not check: dropped
        if self.every is not None and (step + 1) % self.every == 0:
            self.arm()

    # ------------------------------------------------------------------ hooks (armed step only)

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        kind = self.parts.device.type
        if self.recomputing:
            self._recompute_autocast = self._recompute_autocast or torch.is_autocast_enabled(kind)
            return
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        self._rng = (torch.get_rng_state(), torch.cuda.get_rng_state_all() if cuda else None)
        self._autocast = (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
        self._first.zero_()  # the last forward/backward of the step is the one compared

    def on_grad(self, index: int, grad: torch.Tensor) -> None:
        if self.armed and not self.recomputing:
            self._grads_seen = True
            self._first[index] = self.fp.project_one(index, grad)

    def after_optimizer_step(self) -> None:
        if self.armed:
            self._stepped = True

    # ------------------------------------------------------------------ the check

    @property
    def due(self) -> bool:
        return self.armed and self._rng is not None and not self._stepped

    def verify(self, batch: Any, loss_fn: Callable[[nn.Module, Any], Any] | None) -> VerifyResult | None:
        """Recompute and compare (see the module docstring); None when this step is not due."""
        if self.armed and self._stepped:
            raise ValueError("verify_step must be called after the step's backward and before optimizer.step()")
        if self.armed and self._rng is None and self._grads_seen:
            self.disarm()
            raise RuntimeError("the step had gradients but the model's forward hooks never ran: compute the loss by "
                               "calling the attached model (model(...)), not a method beside its forward, so the "
                               "random state of the pass can be replayed")
        if not self.due:
            return None
        from trainer_agent.diagnostics.preflight import forward_backward

        parts = self.parts
        t0 = time.perf_counter()
        scaler = parts.scaler
        scale = scaler.scale if scaler is not None and scaler.is_enabled() else None
        no_sync = getattr(parts.model, "no_sync", None) if parts.world_size > 1 else None
        kind = parts.device.type
        step_autocast = self._autocast
        float32 = self.float32
        self.recomputing = True
        if parts.forward is not None:
            parts.forward.excluded = True
        try:
            with no_sync() if callable(no_sync) else contextlib.nullcontext():
                again = (torch.autocast(kind, dtype=step_autocast[1])
                         if step_autocast is not None and step_autocast[0] and not torch.is_autocast_enabled(kind)
                         else contextlib.nullcontext())
                with again:  # the autocast the step's forward ran under
                    _, grads = forward_backward(parts, batch, loss_fn, replay_rng=self._rng, scale=scale)
                result = self._compare(grads, time.perf_counter() - t0)
                if float32:
                    result = self._float32(result, batch, loss_fn, scale, step_autocast)
        finally:
            self.recomputing = False
            if parts.forward is not None:
                parts.forward.excluded = False
            self.disarm()
        self.results.add(result)
        if result.mismatch:
            log.warning("trainguard: rank %d recomputed step %d and got a different gradient: layer %r differs "
                        "by %.3g of its norm (tolerance %g). Silent data corruption on this rank's device is likely.",
                        parts.rank, result.step, result.layer, result.rel_diff, self.rel_tol)
        return result

    def _float32(self, result: VerifyResult, batch: Any, loss_fn: Callable[[nn.Module, Any], Any] | None,
                 scale: Callable[[torch.Tensor], torch.Tensor] | None,
                 step_autocast: tuple[bool, torch.dtype] | None) -> VerifyResult:
        """The float32 recompute of the armed step (see the module docstring)."""
        from trainer_agent.diagnostics.preflight import forward_backward

        parts, kind = self.parts, self.parts.device.type
        low = sorted({str(p.dtype) for p in parts.params.params if p.dtype not in (torch.float32, torch.float64)})
        why = ("the step ran without autocast" if step_autocast is None or not step_autocast[0] else
               f"the parameters are {', '.join(low)}: there is no float32 copy of the model to run" if low else None)
        if why is None:
            t0 = time.perf_counter()
            self._recompute_autocast = False
            with torch.autocast(kind, enabled=False):
                _, grads = forward_backward(parts, batch, loss_fn, replay_rng=self._rng, scale=scale)
            if self._recompute_autocast:
                why = ("the loss function enters torch.autocast itself, which the recompute cannot turn off: wrap "
                       "its call in the loop's autocast instead (the same-precision check replays that autocast)")
            else:
                f32 = self._compare(grads, time.perf_counter() - t0)
                value = f32.rel_diff
                self.results.add_float32(value)
                log.info("trainguard: rank %d recomputed step %d in float32: the %s gradient differs by %.3g of "
                         "layer %r's norm", parts.rank, result.step, step_autocast[1], value, f32.layer)  # type: ignore[index]
                return replace(result, float32_rel_diff=value, float32_layer=f32.layer,
                               seconds=result.seconds + f32.seconds)
        if why not in self._refused:
            self._refused.add(why)
            log.warning("trainguard: rank %d: no float32 recompute of step %d: %s", parts.rank, result.step, why)
        return result

    @torch.no_grad()
    def _compare(self, grads: list[torch.Tensor | None], seconds: float) -> VerifyResult:
        fp, parts = self.fp, self.parts
        device = parts.device
        zero = torch.zeros((), device=device)
        again = fp.project([g if g is not None else zero for g in grads])
        sq = torch.stack([g.detach().double().square().sum() if g is not None else zero.double() for g in grads])
        layers = fp.layers
        f1 = torch.zeros(layers, fp.k, dtype=torch.float64, device=device).index_add_(0, fp.layer_ids, self._first)
        f2 = torch.zeros_like(f1).index_add_(0, fp.layer_ids, again)
        norm = torch.zeros(layers, dtype=torch.float64, device=device).index_add_(0, fp.layer_ids, sq).sqrt()
        rel = rel_diff(f1, f2, norm).amax(dim=1)
        worst, layer = rel.max(dim=0)
        # SYNC: two reads per checked step
        bitwise = torch.equal(self._first, again)
        value, where = torch.stack([worst, layer.to(torch.float64)]).tolist()
        where = int(where)
        return VerifyResult(step=parts.step() + 1, rel_diff=value, layer=parts.layers[where], bitwise=bitwise,
                            mismatch=not value <= self.rel_tol, seconds=seconds)

    # ------------------------------------------------------------------ results

    def take(self) -> float:
        """The largest ``rel_diff`` checked since the previous call (NaN: none)."""
        return self.results.take()

    def take_float32(self) -> float:
        """The largest float32 recompute ``rel_diff`` since the previous call (NaN: none)."""
        return self.results.take_float32()

    def values(self) -> dict[str, float]:
        return self.results.values()

    def close(self) -> None:
        self.disarm()
