"""(3) of ``trainer_agent/agent.py``: ``Agent.end_step``, the close of an optimizer step (its row of the
report interval, and on a report step the report built, exchanged among the ranks and copied to
the host), and what the leader does with each published report (its cross-rank part resolved,
the report sent to the controller)."""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from trainer_agent.agent_parts.attach_args import checked_end_step, is_token_count
from trainer_agent.compat import torch_private
from trainer_agent.report.pipeline import HostStep, RankVectors

__all__ = ["StepEnd"]

#: Logged once when the model trains inside ``Join`` with uneven inputs allowed.
_UNEVEN_JOIN = ("trainguard: the model trains inside torch.distributed.algorithms.Join with uneven inputs; Join "
                "shadows the model's collectives, not the agent's: the rank that runs out of inputs first leaves "
                "the others waiting in the agent's next report until the process group's timeout. Use "
                "Join(..., throw_on_early_termination=True) or even inputs (DistributedSampler(drop_last=True)).")

#: After this many ``end_step`` calls, if at least half had backward passes but no optimizer step
#: (no GradScaler skip either), the loop calls ``end_step`` per micro-batch: warned once. A GradScaler
#: not passed to ``attach`` skips a few first steps, a loop skips a rare step: never half of these.
_PER_MICRO_BATCH_STEPS = 32
_PER_MICRO_BATCH = ("trainguard: %d of the first %d end_step calls closed a step in which optimizer.step() did not run: "
                    "call end_step once per optimizer step (with gradient accumulation, after the optimizer step that "
                    "follows the last micro-batch). The agent counts every end_step as a step, so its step numbers, "
                    "report intervals and per-step values are off by the accumulation factor.")

#: Warned (``warnings.warn``) at the first ``end_step`` after ``close``: the call does nothing.
_AFTER_CLOSE = ("trainguard: end_step of run {run!r} after the agent was closed (agent.close(), or a framework "
                "callback that closed it at the end of training): the step is not measured or reported; further "
                "end_step calls of this agent are ignored without a warning.")

#: The facade's logger (``trainer_agent/agent.py``).
log = logging.getLogger("trainer_agent.agent")


class StepEnd:
    """``Agent``'s end of step and report publication, on what the agent holds: ``clock``,
    ``parts``, ``reports``, ``schedule``, ``hooks``, ``diagnostics``, ``export``, ``data``,
    ``snapshots``, ``control``, ``scheduled_lr``, ``errors``, ``config``, ``rank``,
    ``world_size``, ``run`` and ``_closed`` (set by ``close``)."""

    def end_step(self, loss: torch.Tensor | float | None, tokens: int | None = None) -> None:
        """Close the optimizer step: call once per optimizer step, after ``optimizer.step()``
        (with accumulation: after the step that follows the last micro-batch). ``loss`` may be a
        device tensor of one element (not read here), a float, or None: a step without a loss (a skipped batch)
        counts, and a report carries the last loss a step of its interval had (none if no step had one: a NaN
        is in one report only); ``tokens``, this rank's token count: an int, or a tensor read on report steps
        only (on CUDA a wait for the device). ``ValueError`` for what cannot be either, before the step moves.
        After ``close`` it does nothing (warned once: the loop went on after the agent closed)."""
        if self._closed_warned():
            return
        loss, tokens = checked_end_step(loss, tokens)  # ValueError for a mistake, before any state moves
        clock, control, error = self.clock, self.control, self.errors.error
        if self.snapshots is not None and self.snapshots.due(clock.step + 1):
            # Before this step's report is built: the report names the snapshot of its own step.
            try:
                skip = getattr(control, "skip", None)
                self.snapshots.take_unless_skipped(clock.step + 1, skip.skipped if skip is not None else 0)
            except Exception as exc:
                error("snapshot", exc)
        t0 = clock.now()
        agreed: list[int] | None = None
        meter, hooks, diagnostics = self.parts.meter, self.hooks, self.diagnostics
        try:
            with torch.no_grad():
                agreed = self._end_step(loss, tokens, t0)
        except Exception as exc:
            error("end_step", exc)
            agreed = self._join_exchange()
        finally:
            meter.reset()
            if hooks.forward is not None:
                hooks.forward.reset()
            clock.overhead += clock.now() - t0 + meter.overhead
            clock.overhead_total += clock.overhead
            clock.overhead = meter.overhead = 0.0
        if diagnostics.trace is not None:
            diagnostics.end_trace_step()
        if diagnostics.verifier is not None:
            try:
                diagnostics.verifier.on_end_step(clock.step)
            except Exception as exc:
                error("verify", exc)
        if control is not None:
            try:
                control.on_end_step(clock.step, agreed)
            except Exception as exc:
                error("control_end_step", exc)
        self._sync_grad_hooks()
        if hooks.input_wait is not None:
            hooks.input_wait.step_ended()  # last: a pause above is not input wait

    def _closed_warned(self) -> bool:
        """True after ``close`` (the first time, warned, pointing at the loop's ``end_step`` call)."""
        if self._closed and self.errors.first_warning("end_step_after_close"):
            warnings.warn(_AFTER_CLOSE.format(run=self.run), stacklevel=3)
        return self._closed

    def _sync_grad_hooks(self) -> None:
        """The per-parameter hooks for the next step (the verifier or the controller may have armed
        it); their time counts as the next step's."""
        clock = self.clock
        t0 = clock.now()
        try:
            self.hooks.sync_grad_hooks()
        except Exception as exc:
            self.errors.error("gradient_hook", exc)
        clock.overhead += clock.now() - t0

    def _end_step(self, loss: torch.Tensor | float | None, tokens: int | None, t0: float) -> list[int] | None:
        clock, meter, reports, scaler = self.clock, self.parts.meter, self.reports, self.parts.scaler
        st = meter.state
        clock.step += 1
        held = clock.accumulation.step_ended(st.backwards)
        if held is not None:
            self._accumulation_changed(st.backwards, *held)
        duration, clock.last_end = t0 - clock.last_end, t0
        warm_up, clock.warm_up = clock.warm_up, False
        compiles = self.hooks.compiles
        if compiles is not None and compiles.step_ended(warm_up):
            warm_up = True  # torch.compile compiled in this step: its time is the compiler's, left out too
        if self.hooks.comm is not None:
            self.hooks.comm.step_ended(duration, warm_up)
        if scaler is not None and scaler.is_enabled() and not st.stepped and st.backwards:
            clock.amp_skipped += 1  # GradScaler.step skipped optimizer.step: inf/NaN gradients
        elif not st.stepped and st.backwards:
            clock.unstepped += 1
        elif clock.found_inf is not None:  # a fused optimizer's kernel skipped it (found_inf > 0)
            skipped = (clock.found_inf > 0).to(torch.float64)
            clock.amp_fused = skipped if clock.amp_fused is None else clock.amp_fused + skipped
        clock.found_inf = None
        loss_t = self._loss_tensor(loss)  # None: a step without a loss (IntervalRows: the report's loss)
        if loss_t is not None:
            clock.loss = loss_t
        clock.row = reports.record_step(clock.step, loss_t, st.grad_share)
        reports.publish(block=False)
        if clock.step == _PER_MICRO_BATCH_STEPS and 2 * clock.unstepped >= clock.step:
            self.errors.warn_once("per_micro_batch", _PER_MICRO_BATCH % (clock.unstepped, clock.step))
        if not self.schedule.is_report(clock.step):
            return None
        if torch_private.join_allows_uneven_inputs(self.parts.model):
            self.errors.warn_once("join", _UNEVEN_JOIN)
        index = self.parts.params
        added = 0 if index.grown else index.unmeasured(self.parts.optimizer)
        if added:
            log.warning("trainguard: the optimizer holds %d trainable parameter(s) it did not hold at attach (unfrozen "
                        "since, or added with add_param_group); the gradient norm, update size and per-layer values "
                        "leave them out (an agent attached after the change measures them).", added)
        host = self._host_step(st, duration, tokens, warm_up)
        overhead = clock.overhead + meter.overhead + (clock.now() - t0)
        sketch = self._sketch() if reports.exchange.with_state else None
        agreed = reports.build(st, clock.loss, host, overhead, self._proposal(), sketch, amp_fused=clock.amp_fused)
        reports.publish(block=False)
        return agreed

    def _accumulation_changed(self, backwards: int, count: int, held: int) -> None:
        """The loop ran ``backwards`` micro-batches in this step after ``count`` for ``held`` steps: a
        change of the run's, marked as ``Agent.run_changed`` marks one (``trainer_agent/measure/accumulation_watch.py``)."""
        clock = self.clock
        log.warning("trainguard: step %d accumulated %d micro-batch(es) after %d for %d steps in a row: taken as a "
                    "change of the run (the gradient norm's level moves with it), so the spike guard and the "
                    "controller's spike rules start their baselines afresh.", clock.step, backwards, count, held)
        clock.run_changed_at, clock.run_changes = clock.step, clock.run_changes + 1

    def _loss_tensor(self, loss: torch.Tensor | float | None) -> torch.Tensor | None:
        """The step's loss as a float64 0-dim tensor on the model's device (no host read); None stays None."""
        if loss is None:
            return None
        if isinstance(loss, torch.Tensor):
            loss_t = loss.detach().to(self.parts.device, torch.float64)
            return loss_t.reshape(()) if loss_t.dim() else loss_t
        return torch.full((), float(loss), dtype=torch.float64, device=self.parts.device)  # a fill, no copy

    def _host_step(self, st: Any, duration: float, tokens: int | None, warm_up: bool) -> HostStep:
        """A report step's host values: its times (``warm_up``: the first step timed, see
        ``StepClock.warm_up``, or a step that compiled, see ``CompileWatch``), counts and the
        diagnostics' results."""
        hooks, verifier = self.hooks, self.diagnostics.verifier
        forward_s = math.nan
        if hooks.forward is not None and warm_up:
            hooks.forward.skip()
        elif hooks.forward is not None:
            forward_s = hooks.forward.take()
        wait = hooks.input_wait.take() if hooks.input_wait is not None else float("nan")
        return HostStep(self.clock.step, duration, self._token_count(tokens), forward_s, self.clock.amp_skipped,
                        input_wait=wait, micro_batches=st.backwards, world_size=self.world_size,
                        verify_mismatch=verifier.take() if verifier is not None else math.nan,
                        verify_float32=verifier.take_float32() if verifier is not None else math.nan,
                        gpu_xid=self.export.take_xid(), scheduled_lr=self.scheduled_lr.take(self.parts.optimizer),
                        comm=hooks.comm.take() if hooks.comm is not None else {},
                        trainable_elements=float(self.parts.params.trainable_elements()) if self.export.serves_job
                        else math.nan,  # a job value (the same on every rank), one read per tensor
                        optimizer_class=self.parts.optimizer_class[1],
                        run_changes=float(self.clock.run_changes), warm_up=warm_up,
                        compile_steps=float(hooks.compiles.compile_steps) if hooks.compiles is not None else math.nan)

    def _token_count(self, tokens: Any) -> float | None:
        """A report step's token count; a tensor's is read here, and one that is not a count
        (negative, NaN) is left out and counted as an error."""
        if not isinstance(tokens, torch.Tensor):
            return tokens
        count = float(tokens)
        if is_token_count(count):
            return count
        self.errors.error("tokens", ValueError(f"tokens must be a non-negative count, got {count}"))
        return None

    def _sketch(self) -> Any:
        """This rank's sketch of the sequences it observed since the last report (None without a
        data monitor); an error leaves it out (the rank's row still enters the collective)."""
        try:
            return self.data.take_sketch() if self.data is not None else None
        except Exception as exc:
            self.errors.error("data_sketch", exc)
            return None

    def _proposal(self) -> list[int] | None:
        return self.control.proposal() if self.control is not None else None

    def _join_exchange(self) -> list[int] | None:
        """After an error in ``_end_step`` on a report step: enter the step's collective with a
        NaN row if it was not entered (see ``ReportPipeline.join_exchange``)."""
        if not self.schedule.is_report(self.clock.step):
            return None
        try:
            return self.reports.join_exchange(self.clock.step, self._proposal())
        except Exception as exc:
            self.errors.error("end_step", exc)
            return None

    # ------------------------------------------------------------------ publication

    def _on_published(self, values: dict[str, float], rank_values: Mapping[str, list[float]]) -> None:
        self.export.publish(values)
        if self.rank == 0:  # the cross-rank part: off the training thread (ReportPipeline.off_thread)
            current = self.export.current_values() if self.control is not None else values
            light = (lambda: self._on_ranks(current, rank_values.light())) if isinstance(rank_values, RankVectors) else None
            self.reports.off_thread(lambda: self._on_ranks(current, rank_values), light)

    def _on_ranks(self, values: dict[str, float], rank_values: Mapping[str, list[float]]) -> None:
        """Leader: a published report's every-rank part (on the cross-rank worker with several ranks):
        resolved here, the fingerprints' comparison and its warning with it
        (``trainer_agent/report/fingerprint_rounds.py``), with or without a controller."""
        if isinstance(rank_values, RankVectors):
            rank_values.resolve()
        try:
            fp = self.reports.fingerprint
            self.export.publish_agreement(rank_values, fp.names if fp is not None else ())
        except Exception as exc:  # the gauges are not worth the report
            self.errors.error("agreement_gauges", exc)
        if self.control is not None:
            self.control.on_report(values, rank_values)
