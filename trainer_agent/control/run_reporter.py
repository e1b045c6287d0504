"""The leader's side of the control plane that talks to the controller (``trainer_agent/control/plane.py``):
the run's registration (every rank's ``/metrics`` endpoint, gathered once at start), its reports
(a published report with every rank's row) and acks, through the controller client
(``trainer_agent/report/client.py``).

A report's job-level ``trainguard_loss`` is the mean of the ranks' losses (what the frameworks log
under data parallelism), not the leader's own; a rank's NaN or Inf stays in it. Each rank's loss
stays in the report's ``ranks.loss``.
"""

from __future__ import annotations

import math
import os
import re
import socket
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlparse

import torch.distributed as dist

from trainguard.protocol.catalog import BY_NAME
from trainguard.protocol.base import printable
from trainguard.protocol.wire import MAX_DESYNC_LAYERS, DesyncLayer, RankEndpoint, RankValues, Report, RunRegistration
from trainer_agent.report.client import ControllerClient
from trainer_agent.config import AgentConfig
from trainer_agent.report.exchange import WIRE_VECTORS

__all__ = ["NODE_NAME_VARIABLES", "RunReporter", "node_name", "rank_endpoints"]


#: Where a rank's node name comes from, in order (the first set and not empty): the agent's own
#: setting, Kubernetes' usual downward-API variable (``spec.nodeName``: inside a pod the host name
#: is the pod's), SLURM's; else the host name.
NODE_NAME_VARIABLES = ("TRAINGUARD_NODE_NAME", "NODE_NAME", "SLURMD_NODENAME")
_NOT_IN_NODE_NAME = re.compile(r"[^A-Za-z0-9._-]")


def node_name(environ: Mapping[str, str] | None = None) -> str | None:
    """The name of the node this process runs on (:data:`NODE_NAME_VARIABLES`, else
    ``socket.gethostname()``) as the wire takes it (``RankEndpoint.node``): characters other
    than letters, digits, '-', '_' and '.' become '-', the first must be a letter or digit, at most
    253 are kept; None when nothing is left."""
    env = os.environ if environ is None else environ
    raw = next((env[v] for v in NODE_NAME_VARIABLES if env.get(v, "").strip()), None)
    if raw is None:
        try:
            raw = socket.gethostname()
        except OSError:
            return None
    name = _NOT_IN_NODE_NAME.sub("-", raw.strip()).lstrip("-_.")[:253]
    return name or None


def rank_endpoints(metrics_url: str | None, local_rank: int, world_size: int, group: Any) -> list[RankEndpoint]:
    """Every rank's /metrics endpoint and node, gathered on ``group`` (every rank calls this once,
    at start)."""
    mine: tuple[str, int, int, str | None] | None = None
    if metrics_url:
        parsed = urlparse(metrics_url)
        host = parsed.hostname or "127.0.0.1"
        if host in ("0.0.0.0", "::"):
            host = socket.getfqdn()
        mine = (host, int(parsed.port or 0), local_rank, node_name())
    found: list[Any] = [mine]
    if world_size > 1:
        found = [None] * world_size
        dist.all_gather_object(found, mine, group=group)
    return [
        RankEndpoint(rank=r, local_rank=e[2], host=e[0], port=e[1], node=e[3])
        for r, e in enumerate(found)
        if e is not None and e[1] > 0
    ]


class RunReporter:
    """The leader's registration and reports of run ``run`` of ``job`` through a started
    :class:`ControllerClient`. ``last_step``: the last step already reported (a restored run
    starts from its restored step)."""

    def __init__(self, cfg: AgentConfig, *, job: str, run: str, world_size: int, endpoints: list[RankEndpoint],
                 own_accumulation: int | None, transport: Any, long_poll_s: float, clock: Callable[[], float],
                 wall_clock: Callable[[], float], on_error: Callable[[str, BaseException], None], version: str,
                 last_step: int) -> None:
        self.job, self.world_size = job, world_size
        self._wall = wall_clock
        self.last_step = last_step
        registration = RunRegistration(
            job=job,
            run=run,
            world_size=world_size,
            ranks=endpoints,
            agent_version=version,
            config={"report_every": cfg.report_every, "sync_every": cfg.sync_every,
                    "skip_nonfinite": cfg.skip_nonfinite, "skip_spikes": cfg.spike_guard_on,
                    "snapshot_every": cfg.snapshot_every, "snapshot_keep": cfg.snapshot_keep,
                    **({"accumulation_steps": own_accumulation} if own_accumulation is not None else {})},
        )
        self.client = ControllerClient(
            cfg.controller,
            registration=registration,
            token=cfg.token,
            request_timeout_s=cfg.request_timeout_s,
            long_poll_s=long_poll_s,
            max_buffered_reports=cfg.max_buffered_reports,
            transport=transport,
            clock=clock,
            on_error=on_error,
        )
        self.client.start()

    def send(self, values: Mapping[str, float], rank_values: Mapping[str, list[float]], applied_generation: int) -> None:
        """Queue the report of the steps after :attr:`last_step` up to ``values``' step (nothing
        when that step was reported already, or comes from before a restore)."""
        published = int(values["trainguard_step"])
        if published <= self.last_step:
            return
        nan = [math.nan] * self.world_size
        job_values = {k: float(v) for k, v in values.items() if k in BY_NAME and not BY_NAME[k].labels}
        losses = rank_values.get("loss")
        if self.world_size > 1 and "trainguard_loss" in job_values and losses is not None and len(losses) == self.world_size:
            job_values["trainguard_loss"] = sum(losses) / len(losses)  # the mean of the ranks' (module docstring)
        report = Report(
            job=self.job,
            step_first=self.last_step + 1,
            step_last=published,
            time=self._wall(),
            values=job_values,
            ranks=RankValues(**{wire: list(rank_values.get(field, nan)) for wire, field in WIRE_VECTORS.items()}),
            applied_generation=applied_generation,
            desync=[DesyncLayer(kind=d.kind, layer=printable(d.layer)[:512], rel_diff=d.rel_diff, ranks=list(d.ranks[:64]))
                    for d in getattr(rank_values, "desync", ())[:MAX_DESYNC_LAYERS]],
        )
        self.last_step = published
        self.client.submit_report(report)
