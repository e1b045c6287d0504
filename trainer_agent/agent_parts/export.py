"""The agent's metrics export: the ``/metrics`` server and collector, the values published by the
last report and what joins them at scrape time (the data monitor's, the snapshots', the watched
loader's, the control plane's, the verifier's, the GPU's), the batch-size advisor's running
recommendation and the agent's error count (``trainer_agent/agent.py``)."""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from prometheus_client.registry import CollectorRegistry

from trainguard.protocol.catalog import JOB, exported_scopes
from trainer_agent.agent_parts.errors import ErrorLog
from trainer_agent.measure.batch_size import BatchSizeAdvisor
from trainer_agent.config import AgentConfig
from trainer_agent.report.exporter import AgentCollector, MetricsServer
from trainer_agent.report.replica_agreement import agreement_gauges

__all__ = ["MetricsExport"]


class MetricsExport:
    """Host values only: ``current_values`` runs on the HTTP thread. ``sources``: the agent's
    parts whose values join the published ones (``data``, ``snapshots``, ``verifier``, ``reports``;
    ``control`` and ``loader`` are set once they exist)."""

    def __init__(self, config: AgentConfig, errors: ErrorLog, registry: CollectorRegistry | None, *, job: str,
                 run: str, rank: int, device: torch.device, data: Any, snapshots: Any, verifier: Any,
                 reports: Any) -> None:
        self._errors = errors
        self._lock = threading.Lock()
        self._published: dict[str, float] = {}
        self._agreement: dict[str, float] = {}  # the leader's, of the last resolved report (publish_agreement)
        self.batch_size_advisor = BatchSizeAdvisor()
        self._data, self._snapshots, self._verifier, self._reports = data, snapshots, verifier, reports
        self.control: Any = None
        self.loader: Any = None
        self.gpu = None  # GPU health via NVML, read at scrape time (trainer_agent/measure/gpu_health.py)
        if device.type == "cuda":
            from trainer_agent.measure.gpu_health import GpuHealth

            self.gpu = GpuHealth.open(device.index if device.index is not None else torch.cuda.current_device())
        self.registry = registry if registry is not None else CollectorRegistry()
        # A rank serves its own values; the job's (the same on every rank) only where the config says.
        scopes = exported_scopes(rank, job_metrics=config.job_metrics, per_layer=config.per_layer)
        #: This rank serves the job's values (the leader, or every rank with ``job_metrics="all"``):
        #: a job value read on the host per tensor is read only where it is served.
        self.serves_job = JOB in scopes
        self._collector = AgentCollector(self.scraped_values, job=job, run=run, rank=rank, scopes=scopes)
        self.server: MetricsServer | None = None

    def register(self) -> None:
        self.registry.register(self._collector)

    def serve(self, config: AgentConfig, local_rank: int) -> None:
        """Start this rank's ``/metrics`` server (``config.metrics_port`` + the local rank)."""
        if config.metrics_port is None:
            return
        port = config.metrics_port + local_rank if config.metrics_port else 0
        if port > 65535:
            raise ValueError(f"metrics_port {config.metrics_port} + local rank {local_rank} is past "
                             f"65535: choose a lower base port")
        try:
            self.server = MetricsServer(self.registry, host=config.metrics_host, port=port)
        except OSError as exc:  # e.g. the host address cannot be bound: train without /metrics, say so
            self._errors.error("metrics_server", exc)

    @property
    def url(self) -> str | None:
        return self.server.url if self.server is not None else None

    def publish(self, values: dict[str, float]) -> None:
        """A published report's values (the batch-size recommendation joins them); the data
        monitor's refreshed with them."""
        self._advise_batch_size(values)
        if self._data is not None:
            self._data.refresh()
        with self._lock:
            self._published = values

    def _advise_batch_size(self, values: dict[str, float]) -> None:
        """Feed the report's noise scale to the batch-size advisor; its running recommendation
        joins the report's values (host floats only)."""
        b = values.get("trainguard_grad_noise_scale")
        if b is not None:
            self.batch_size_advisor.update(b, values.get("trainguard_grad_variance", math.nan))
        recommended = self.batch_size_advisor.recommended()
        if not math.isnan(recommended):
            values["trainguard_recommended_batch_size"] = recommended

    def publish_agreement(self, rank_values: Mapping[str, list[float]], layer_names: Sequence[str]) -> None:
        """Leader: the replicas' agreement gauges of a resolved report (``agreement_gauges``),
        replacing the previous report's; none when it carries no fingerprint comparison."""
        gauges = agreement_gauges(rank_values, layer_names)
        with self._lock:
            self._agreement = gauges

    def scraped_values(self) -> dict[str, float]:
        """What ``/metrics`` serves: :meth:`current_values` and the agreement gauges (kept out of
        the values sent with the next report: they are an earlier report's)."""
        values = self.current_values()
        with self._lock:
            values.update(self._agreement)
        return values

    def current_values(self) -> dict[str, float]:
        """Host values only: called by the /metrics collector from the HTTP thread."""
        with self._lock:
            values = dict(self._published)
        if self._data is not None:
            values.update(self._data.values)
        if self._snapshots is not None:
            newest = self._snapshots.newest_step
            if newest is not None:
                values["trainguard_snapshot_step"] = float(newest)
            values["trainguard_rollbacks_total"] = float(self._snapshots.rollbacks)
        for kind, source in (("loader_values", self.loader), ("control_values", self.control)):
            if source is not None:
                self._read(kind, source.values, values)
        if self._verifier is not None:
            values.update(self._verifier.values())
        values.update(self._reports.worker_values())
        if self.gpu is not None:
            self._read("gpu_health", self.gpu.read, values)
        self._errors.unknown(values)  # (counted in the error log)
        values["trainguard_agent_errors_total"] = float(self._errors.count)  # last: the errors above in it
        return values

    def _read(self, kind: str, read: Any, values: dict[str, float]) -> None:
        """``values`` updated with ``read()``; a failure is an agent error."""
        try:
            values.update(read())
        except Exception as exc:
            self._errors.error(kind, exc)

    def take_xid(self) -> float:
        """The last XID error of this rank's GPU since the last report (NaN: none or no NVML)."""
        if self.gpu is None:
            return math.nan
        try:
            return self.gpu.take_xid()
        except Exception as exc:
            self._errors.error("gpu_health", exc)
            return math.nan

    def quarantine(self, client: Any, step: int) -> None:
        """A step skipped for its data: the watched loader leaves the batch's samples out from now
        on, across a resume too (``TokenLoader.quarantine_last``); the leader's ``client`` sends
        every rank's samples to the data incident."""
        quarantine = getattr(self.loader, "quarantine_last", None)
        if quarantine is not None:
            quarantine()
        located = getattr(self.loader, "located_last", None)
        if located is not None and client is not None:
            from trainguard.protocol.base import printable
            from trainguard.protocol.wire import QuarantinedSamples, QuarantineReport

            where = located()
            if where:
                client.post_quarantine(QuarantineReport(step=step, samples=[
                    QuarantinedSamples(shard=printable(shard)[-1024:], indices=idx) for shard, idx in list(where.items())[:256]]))

    def close(self, timeout: float) -> None:
        if self.server is not None:
            self.server.close(timeout)
        try:
            self.registry.unregister(self._collector)
        except KeyError:
            pass
