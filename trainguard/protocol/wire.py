"""Wire types: everything that crosses the network between the agent and the controller.

Both ``trainer_agent`` and ``service`` import this module, so it must not import torch (nor
FastAPI): only pydantic.

NaN and ±Inf are legitimate training values (a loss that turned NaN is the most important value a
report can carry), and JSON has no literal for them. Every model here serialises them as the
strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"`` (pydantic's ``ser_json_inf_nan="strings"``)
and accepts those strings — as well as the bare ``NaN``/``Infinity`` tokens Python's ``json``
module writes — when parsing. ``dumps``/``loads`` below are the only functions to use for bodies.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints, field_validator, model_serializer

from trainguard.protocol.base import MAX_INT, MAX_RANK, Int, MetricName, Name, Rank, Text, Value, WireModel
from trainguard.protocol.commands import (
    EXIT_HARDWARE_FAULT, LR_SCALE_MAX, LR_SCALE_MIN, MAX_ACCUMULATION_STEPS, AccumulationRequest, CommandRequest,
    REGISTRY, DesiredState, LrRule, LrScaleRequest,
)
from trainguard.protocol.rank_values import RankValues  # declared per value in rank_values.RANK_VALUES

__all__ = [
    "API_PREFIX",
    "EXIT_HARDWARE_FAULT",
    "MAX_INT",
    "COMMANDS",
    "DIAGNOSTIC_COMMANDS",
    "DiagnosticCommand",
    "MemoryReport",
    "QuarantineReport",
    "QuarantinedSamples",
    "MemoryOwnerEntry",
    "Command",
    "LR_SCALE_MIN",
    "LR_SCALE_MAX",
    "Name",
    "WireModel",
    "RankEndpoint",
    "RunRegistration",
    "RunRegistered",
    "RankValues",
    "DesyncLayer",
    "MAX_DESYNC_LAYERS",
    "Report",
    "ReportAccepted",
    "DesiredState",
    "Ack",
    "RunFinished",
    "PreflightCheck",
    "PreflightResult",
    "CommandRequest",
    "LrScaleRequest",
    "AccumulationRequest",
    "LrRule",
    "MAX_ACCUMULATION_STEPS",
    "Severity",
    "Int",
    "dumps",
]

API_PREFIX = "/v1"

# -- the command vocabulary -------------------------------------------------------------------
#: What an operator, a rule or Alertmanager can ask of a run, each in one spelling (the command
#: registry, :mod:`trainguard.protocol.commands`, declares each once). The same words are
#: Alertmanager's ``trainguard_action`` label values and the controller's action metric labels;
#: only URLs and CLI subcommands write them with dashes (``POST /v1/runs/{run}/lr-scale``).
Command = str
COMMANDS: tuple[str, ...] = tuple(c.name for c in REGISTRY if c.operator and c.kind == "control")
#: Commands that ask the agent for a diagnosis instead of acting on training: ``memory_trace``
#: (attribute memory kept alive across steps to layers or the loop, a few steps) and ``verify``
#: (recompute one step's gradient on every rank and compare it with the one the step produced).
DiagnosticCommand = str
DIAGNOSTIC_COMMANDS: tuple[str, ...] = tuple(c.name for c in REGISTRY if c.operator and c.kind == "diagnostic")


#: A node's name as a rank registers it: a host name's characters, at most 253 of them.
NODE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$"
NodeName = Annotated[str, StringConstraints(pattern=NODE_PATTERN, strict=True)]


class RankEndpoint(WireModel):
    """Where Prometheus scrapes one rank's ``/metrics``, and the node the rank runs on.

    ``node`` is optional both ways: an agent older than the field sends none, and a ``node`` of None
    is left out of the JSON, so that a controller older than the field (which refuses fields it
    does not know) takes the registration of an agent that could not name its node; an agent whose
    registration such a controller refuses for ``node`` registers again without it
    (``trainer_agent/report/older_controller.py``)."""

    rank: Rank = Field(description="Global rank.")
    local_rank: Rank = Field(description="Rank within its node.")
    host: str = Field(min_length=1, max_length=253, description="Host name or IP address.")
    port: Int = Field(ge=1, le=65535, description="Port of the rank's /metrics endpoint.")
    node: NodeName | None = Field(default=None, description=(
        "The node the rank runs on, as the agent names it (TRAINGUARD_NODE_NAME, else NODE_NAME, else SLURMD_NODENAME, "
        "else the host name): letters, digits, '-', '_' and '.', at most 253 characters. Named in hardware "
        "incidents and in the alerts that name ranks; absent from older agents' registrations and when unknown."))

    @model_serializer(mode="wrap")
    def _without_unknown_node(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        if isinstance(out, dict) and out.get("node", "") is None:
            del out["node"]
        return out


#: Deepest nesting of lists and objects in a registration's ``config``.
MAX_CONFIG_DEPTH = 32


def _depth(value: Any) -> int:
    """Nesting depth of lists and dicts in ``value`` (iterative: the input may be very deep)."""
    deepest, todo = 0, [(value, 0)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, dict):
            v = list(v.values())
        if isinstance(v, list):
            deepest = max(deepest, d + 1)
            if deepest > MAX_CONFIG_DEPTH:
                return deepest
            todo.extend((x, d + 1) for x in v)
    return deepest


class RunRegistration(WireModel):
    """``POST /v1/runs``: register (or re-register, after a restart) a run."""

    job: Name
    run: Name
    world_size: Int = Field(ge=1, le=MAX_RANK + 1)
    ranks: list[RankEndpoint] = Field(default_factory=list, max_length=MAX_RANK + 1)
    agent_version: Text = Field(default="", max_length=64)
    config: dict[str, Any] = Field(default_factory=dict)

    @field_validator("config")
    @classmethod
    def _config_shallow(cls, config: dict[str, Any]) -> dict[str, Any]:
        # Deeper JSON is accepted by the parser but overflows the recursion of every later
        # encoder (the run's status page answered 500 for good).
        if _depth(config) > MAX_CONFIG_DEPTH:
            raise ValueError(f"config is nested more than {MAX_CONFIG_DEPTH} levels deep")
        return config

    @field_validator("ranks")
    @classmethod
    def _ranks_unique(cls, ranks: list[RankEndpoint]) -> list[RankEndpoint]:
        seen = [r.rank for r in ranks]
        if len(seen) != len(set(seen)):
            raise ValueError("rank numbers in 'ranks' must be unique")
        return ranks


class RunRegistered(WireModel):
    """Answer to a registration: the run's current desired state (kept across restarts)."""

    job: str
    run: str
    desired: DesiredState
    applied: DesiredState | None = Field(
        default=None, description="The desired state the run's processes last applied (acknowledged or reported), "
        "when the run registers again: a request of 'desired' with a newer sequence number was taken by no process "
        "(a checkpoint requested while the job was down). None: a new run, or not known.")


class DesyncLayer(WireModel):
    """A layer whose fingerprints differ across ranks (gradients or parameters)."""

    kind: Literal["grad", "param"]
    layer: Text = Field(max_length=512)
    rel_diff: Value = Field(description="A relative difference: not negative (NaN where a fingerprint is not finite).")
    ranks: list[Rank] = Field(default_factory=list, max_length=64)

    @field_validator("rel_diff")
    @classmethod
    def _not_negative(cls, rel_diff: float) -> float:
        if rel_diff < 0:  # (NaN compares False: it stays)
            raise ValueError("rel_diff is a relative difference: it cannot be negative")
        return rel_diff


#: Most desynchronised layers a report names.
MAX_DESYNC_LAYERS = 32


class Report(WireModel):
    """``POST /v1/runs/{run}/reports``: one report for the steps ``step_first..step_last``.

    ``values`` holds job-level metric values keyed by their Prometheus name (unlabelled metrics of
    the agent's catalogue, e.g. ``"trainguard_grad_norm"``), as measured on the leader at
    ``step_last``; ``ranks`` the few per-rank vectors gathered by the leader.
    """

    job: Name
    step_first: Int = Field(ge=0, le=MAX_INT)
    step_last: Int = Field(ge=0, le=MAX_INT)
    time: float = Field(strict=True, allow_inf_nan=False, description="Unix time at the leader when sent.")
    values: dict[MetricName, Value] = Field(default_factory=dict, max_length=4096)
    ranks: RankValues = Field(default_factory=RankValues)
    applied_generation: Int = Field(default=0, ge=0, le=MAX_INT)
    desync: list[DesyncLayer] = Field(
        default_factory=list, max_length=MAX_DESYNC_LAYERS,
        description="Layers whose fingerprints differ across ranks by more than the agent's tolerance, worst first.")

    @field_validator("step_last")
    @classmethod
    def _ordered(cls, step_last: int, info: Any) -> int:
        first = info.data.get("step_first")
        if first is not None and step_last < first:
            raise ValueError("step_last must be >= step_first")
        return step_last


class ReportAccepted(WireModel):
    """Answer to a report: the run's desired state, so that a report doubles as a poll."""

    desired: DesiredState
    alerts: list[str] = Field(default_factory=list, description="Names of rules that fired on this report.")


class Ack(WireModel):
    """``POST /v1/runs/{run}/acks``: every rank applied ``generation`` at ``step``."""

    generation: Int = Field(ge=0, le=MAX_INT)
    step: Int = Field(ge=0, le=MAX_INT)


class RunFinished(WireModel):
    """``POST /v1/runs/{run}/finish``: the run ended (the leader's ``agent.close()``); the
    controller stops expecting reports from it until it registers again."""

    step: Int = Field(ge=0, le=MAX_INT, description="The last step the run completed.")
    reason: Text = Field(default="completed", max_length=200, description="Why it ended, e.g. 'completed' or 'stopped'.")


#: Longest pre-flight a result may report (a day: it runs a few steps' worth of checks).
MAX_PREFLIGHT_SECONDS = 86_400.0
#: Most steps a memory trace may report (the agent traces a few).
MAX_TRACE_STEPS = 1_000_000


class PreflightCheck(WireModel):
    """One pre-flight check's outcome."""

    name: Text = Field(min_length=1, max_length=64)
    status: Literal["pass", "warn", "fail", "skip"]
    detail: str = Field(default="", max_length=2000)


class PreflightResult(WireModel):
    """``POST /v1/runs/{run}/preflight``: the checks run on a real batch before the first step."""

    rank: Rank = 0
    seconds: float = Field(strict=True, ge=0, le=MAX_PREFLIGHT_SECONDS, allow_inf_nan=False)
    checks: list[PreflightCheck] = Field(max_length=64)


class MemoryOwnerEntry(WireModel):
    """Who keeps memory alive across steps: a layer, or the training loop."""

    owner: Text = Field(max_length=512)
    bytes_per_step: float = Field(strict=True, ge=0, allow_inf_nan=False)
    tensors: Int = Field(ge=0, le=MAX_INT)


class MemoryReport(WireModel):
    """``POST /v1/runs/{run}/memory-report``: the result of a memory trace on one rank, worst first."""

    rank: Rank = 0
    step: Int = Field(ge=0, le=MAX_INT, description="The step at which the trace ended.")
    steps: Int = Field(ge=1, le=MAX_TRACE_STEPS, description="Steps traced.")
    owners: list[MemoryOwnerEntry] = Field(default_factory=list, max_length=32)
    device: Literal["cpu", "cuda"] = "cpu"
    allocator_growth_bytes_per_step: float | None = Field(
        default=None, strict=True, allow_inf_nan=False,
        description="CUDA: growth of torch.cuda.memory_allocated per traced step (None on the CPU).")
    layer_forward_bytes: list[MemoryOwnerEntry] = Field(
        default_factory=list, max_length=32,
        description="CUDA: bytes each module's own forward left allocated per step (saved activations and "
                    "its output), worst first; tensors is 0.")


class QuarantinedSamples(WireModel):
    """The samples of one shard that a data skip left out (``TokenLoader.quarantine``)."""

    shard: Text = Field(min_length=1, max_length=1024, description="The shard's base path, as the loader opened it.")
    indices: list[Int] = Field(max_length=65536, description="Indices of the sequences within the shard (taken "
                               "in ascending order, each once).")

    @field_validator("indices")
    @classmethod
    def _ascending(cls, indices: list[int]) -> list[int]:
        if indices and (min(indices) < 0 or max(indices) > MAX_INT):
            raise ValueError(f"indices are sequence indices within a shard: 0..{MAX_INT}")
        return sorted(set(indices))


class QuarantineReport(WireModel):
    """``POST /v1/runs/{run}/quarantine``: the samples of the batches a data skip left out, every
    rank's, by shard (the leader's loader: ``TokenLoader.located_last``); the open data incident
    names them, so an operator can take them out of the data for good."""

    step: Int = Field(ge=0, le=MAX_INT, description="The step whose batch was skipped.")
    samples: list[QuarantinedSamples] = Field(default_factory=list, max_length=256)


def dumps(model: WireModel) -> bytes:
    """Serialise a wire model to JSON bytes (NaN/Inf as strings)."""
    return model.model_dump_json().encode()


Severity = Literal["info", "warning", "critical"]
