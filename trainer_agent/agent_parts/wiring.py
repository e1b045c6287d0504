"""How the agent facade (``trainer_agent/agent.py``) builds its collaborators and connects them: the
snapshot store, the measurement of a step (parameter index, step meter, fingerprints), the
diagnostics, the report pipeline, and, last, the hooks, ``/metrics`` and the control plane."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from trainer_agent.agent_parts.diagnostics import Diagnostics
from trainer_agent.agent_parts.snapshot_extras import SnapshotExtras
from trainer_agent.control.snapshots import SnapshotBackend, SnapshotStore
from trainer_agent.diagnostics.preflight import PREFLIGHT_ONLY_ENV
from trainer_agent.measure import flops
from trainer_agent.measure import bucket_views, fsdp_grad_buffers
from trainer_agent.measure.fingerprint import for_ranks
from trainer_agent.measure.fingerprint_layouts import rank_local
from trainer_agent.measure.fingerprint_screen import screen_width
from trainer_agent.measure.params import ParamIndex
from trainer_agent.measure.step_stats import StepMeter
from trainer_agent.measure.train_parts import TrainParts
from trainer_agent.report.exchange import RankExchange
from trainer_agent.report.rank_agreement import require_alike
from trainer_agent.report.pipeline import ReportPipeline

__all__ = ["AgentWiring"]

#: The facade's logger (``trainer_agent/agent.py``).
log = logging.getLogger("trainer_agent.agent")


class AgentWiring:
    """``Agent``'s construction: ``_build_snapshots`` and ``_build_measurement`` (which sets
    ``parts``, ``diagnostics`` and ``reports``) run in ``Agent.__init__``, ``_start`` once the
    data relay, the export and the hooks exist. Reads what ``Agent.__init__`` set before them
    (``config``, ``job``, ``run``, ``rank``, ``world_size``, ``clock``, ``schedule``, ``errors``,
    ``lr_scheduler``, ``accumulation_base``) and ``Agent._on_published`` (``StepEnd``)."""

    def _start(self, on_checkpoint: Callable[..., Any] | None) -> None:
        """Register the hooks and the collector, serve /metrics, start the control plane."""
        config = self.config
        self.hooks.register(self.parts.model, self.parts.optimizer, self.parts.params, self.schedule, config)
        self.parts.forward = self.hooks.forward
        self.export.register()
        self.export.serve(config, self.local_rank)
        if config.controller is not None or config.skips_steps:
            # Built last: it registers this rank's /metrics endpoint, and a restarted run that the
            # controller holds paused waits in here, before its first step, with /metrics served.
            self.control = self.hooks.control = self.export.control = self._build_control(on_checkpoint)

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", self.rank if self.world_size > 1 else 0))

    def _build_snapshots(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                         backend: SnapshotBackend | None) -> SnapshotStore | None:
        cfg = self.config
        if cfg.snapshot_every is None:
            if backend is not None:
                raise ValueError("snapshot_backend needs AgentConfig(snapshot_every=N)")
            return None
        extras = SnapshotExtras(self.lr_scheduler, lambda: self.parts.scaler, self._spike_guard)
        return SnapshotStore(model, optimizer, every=cfg.snapshot_every, keep=cfg.snapshot_keep,
                             extra_state=extras.state, load_extra=extras.load, backend=backend)

    def _build_measurement(self, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: Any) -> None:
        cfg, clock = self.config, self.clock
        params = ParamIndex(model, optimizer, cfg.layer_depth)
        require_alike(params, cfg, self.world_size)  # ValueError on every rank, before anything is hooked
        if params.sparse:
            log.warning("trainguard: %s: sparse gradients (nn.Embedding or nn.EmbeddingBag with sparse=True); they "
                        "count in the gradient norm and the non-finite count, and are left out of the per-layer, "
                        "update-size and fingerprint measurements", ", ".join(params.sparse_names))
        meter = StepMeter(params, cfg, self.schedule, scaler=scaler, data_parallel=self.world_size > 1,
                          step=clock.read_step, on_error=self.errors.error, clock=clock.now)
        params.bucket_views = bucket_views.for_model(model, params) or fsdp_grad_buffers.for_index(params)
        meter.backward_pass.ddp = model if isinstance(model, nn.parallel.DistributedDataParallel) else None
        self.parts = TrainParts(model, optimizer, scaler, params, meter, self.rank, self.world_size, clock.read_step)
        fingerprint = None
        # Fingerprints compare what every rank holds in full (data parallelism), or, with sharded
        # parameters, what the placements replicate: the local shards of the ranks that differ
        # only along Replicate mesh dimensions (HSDP's replicate dimension, TP's replicated norms).
        # Plain FSDP replicates nothing: no fingerprint. Parameters that differ by design (FSDP1's
        # shards, post-local SGD, the user's rank-local layers) are left out, saying so once.
        layouts = rank_local(model, params.params, cfg.rank_local_params)  # ValueError: a bad prefix
        if cfg.fingerprint and self.world_size > 1:
            for reason in layouts.reasons:
                log.warning("trainguard: %s", reason)
            fingerprint = None if layouts.everything else for_ranks(params, self.world_size, left_out=layouts.left_out)
            meter.fingerprint = fingerprint
        #: Under ``trainguard preflight``: the script stops at its pre-flight, and never trains.
        preflight_only = os.environ.get(PREFLIGHT_ONLY_ENV, "") not in ("", "0")
        self.diagnostics = Diagnostics(self.parts, cfg, clock, client=self._client, on_error=self.errors.error,
                                       preflight_only=preflight_only)
        exchange = RankExchange(self.world_size, rank=self.rank,
                                with_state=cfg.controller is not None and self.world_size > 1,
                                extra_width=screen_width(fingerprint) if fingerprint is not None else 0)
        per_layer = cfg.per_layer == "all" or (cfg.per_layer == "rank0" and self.rank == 0)
        self.reports = ReportPipeline(params, meter, exchange, optimizer=optimizer,
                                      report_every=cfg.report_every, grad_noise=meter.grad_noise,
                                      per_layer=per_layer, clock=clock.now, fingerprint=fingerprint,
                                      desync_rel_tol=cfg.desync_rel_tol, on_published=self._on_published,
                                      on_error=self.errors.error)
        self.reports.mfu_per_token_rate = flops.mfu_per_token_rate(model, params.device, cfg.flops_per_token, cfg.peak_flops)

    def _build_control(self, on_checkpoint: Callable[..., Any] | None) -> Any:
        from trainer_agent.control.plane import ControlContext, ControlPlane

        ctx = ControlContext(job=self.job, run=self.run, rank=self.rank, world_size=self.world_size,
                             local_rank=self.local_rank, config=self.config, schedule=self.schedule,
                             optimizer=self.optimizer, metrics_url=self.metrics_url, step=self.clock.read_step,
                             grad_norm=functools.partial(self.hooks.grad_norm_before_step, self.optimizer),
                             accumulation_steps=self.accumulation_base,
                             named_parameters=self.model.named_parameters,
                             regime=self._regime,
                             lr_jumped=functools.partial(self.scheduled_lr.above_envelope, self.optimizer))
        on_rollback = self.snapshots.restore if self.snapshots is not None else None
        return ControlPlane(ctx, on_checkpoint=on_checkpoint, on_rollback=on_rollback, on_error=self.errors.error,
                            on_diagnose=self.diagnostics.diagnose, on_data_skip=self._quarantine_batch)

    def _regime(self) -> tuple[int, int]:
        """What the run trains now and how, for the spike guard: the elements that train and the
        run's changes, the marked ones and a change of its micro-batches per step in progress."""
        clock = self.clock
        return (self.parts.params.trainable_elements(),
                clock.run_changes + clock.accumulation.changes(self.parts.meter.state.backwards))

    def _adopt_scaler(self, scaler: Any) -> None:
        """A ``GradScaler`` not passed to ``attach``, found running the optimizer step
        (``AgentHooks.find_scaler``): measured with, counted and snapshotted from this step on."""
        log.warning("trainguard: a GradScaler runs this optimizer's steps but was not passed to attach(scaler=...); "
                    "from step %d on the gradients are measured unscaled, its skipped steps counted and its state "
                    "kept with the snapshots. Pass it to attach() so that the steps before are measured unscaled too.",
                    self.clock.step + 1)
        self.parts.scaler = scaler
        self.parts.meter.adopt_scaler(scaler)
        self.clock.unstepped = 0  # the steps without an optimizer step so far were this scaler's skips

    def _client(self) -> Any:
        """The controller's client: the leader's, with a controller (else None)."""
        return self.control.client if self.control is not None else None

    def _quarantine_batch(self) -> None:
        self.export.quarantine(self._client(), self.clock.step)

    def _spike_guard(self) -> Any:
        skip = getattr(self.control, "skip", None)
        return skip.guard if skip is not None else None

    def _error(self, kind: str, exc: BaseException) -> None:
        self.errors.error(kind, exc)
