"""The agent's configuration: one typed object, validated when it is built.

Bad values raise ``ValueError`` here, before training starts; once attached the agent never raises
into the training loop.
"""

from __future__ import annotations

import math

import os
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit


__all__ = ["AgentConfig", "JobMetrics", "MAX_VOCAB_SIZE", "PerLayer", "UpdateRatioMode"]

PerLayer = Literal["rank0", "all", "off"]
JobMetrics = Literal["rank0", "all"]
UpdateRatioMode = Literal["report", "every", "off"]


def _env(name: str) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or None


@dataclass(frozen=True, slots=True, kw_only=True)
class SpikeGuardConfig:
    """Thresholds of :class:`SpikeGuard`."""

    window: int = 128
    """Gradient norms of the last steps taken that make the baseline."""
    min_history: int = 32
    """Steps taken before the guard may skip anything."""
    sigmas: float = 6.0
    """A spike is more than this many robust standard deviations above the median."""
    min_ratio: float = 5.0
    """... and more than this multiple of the median."""
    max_consecutive: int = 16
    """After this many skipped steps in a row the next one is taken whatever its norm."""
    min_jump: float = 2.0
    """... and more than this multiple of the largest norm of the last 3 steps taken: a norm that
    climbs step by step, however far, is the run's (a diffusion model's first hundred steps)."""
    recurring: int = 3
    """A norm at a level the last ``min_history`` steps taken rose to (at least half-way from the
    median) and came back down from this many separate times or more is the run's own level,
    taken (a second task's batches every few steps). Skipped steps never count. 0: off."""

    def __post_init__(self) -> None:
        if type(self.window) is not int or self.window < 4:
            raise ValueError(f"spike window must be an int >= 4, got {self.window!r}")
        if type(self.min_history) is not int or not 4 <= self.min_history <= self.window:
            raise ValueError(f"spike min_history must be an int in [4, window], got {self.min_history!r}")
        for name in ("sigmas", "min_ratio", "min_jump"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 1.0 <= v < math.inf:
                raise ValueError(f"spike {name} must be a finite number >= 1, got {v!r}")
        if type(self.max_consecutive) is not int or self.max_consecutive < 1:
            raise ValueError(f"spike max_consecutive must be a positive int, got {self.max_consecutive!r}")
        if type(self.recurring) is not int or self.recurring < 0:
            raise ValueError(f"spike recurring must be an int >= 0, got {self.recurring!r}")


@dataclass(kw_only=True, slots=True)
class AgentConfig:
    """How the training agent measures, exports and talks to the controller.

    A declaration of settings, one documented field each, checked in ``__post_init__``: it has
    more than 20 fields on purpose (one table a user reads top to bottom, as ``Settings`` of the
    controller), not state with behaviour."""

    report_every: int = 10
    """Steps between two host reads of the device statistics (reports), and a report at step 1
    too (a run shorter than one interval is reported). Step metrics that are only
    exported (param norm, update ratio, per-layer norms, non-finite element counts, optimizer
    state check) are computed on report steps only; per-step counters (non-finite steps, AMP
    skips) are accumulated on the device every step and read at the report. At most 1,000,000
    (the interval's rows take 16 bytes a step on the device)."""

    metrics_port: int | None = 9400
    """Base port of the rank's ``/metrics`` endpoint; the rank serves on ``metrics_port +
    local_rank``. ``0`` picks a free port; ``None`` serves nothing (the registry is still filled)."""

    metrics_host: str = "127.0.0.1"
    """Address the ``/metrics`` endpoint binds to (``0.0.0.0`` to be scraped from other hosts)."""

    layer_depth: int | None = None
    """How parameters are grouped into the layers of the per-layer metrics, fingerprints and
    desync findings. ``None``: by repeated block, a child of a ``ModuleList``/``Sequential``
    with a sibling of its class (``model.layers.3`` in a Llama, ``transformer.h.3`` in GPT-2);
    parameters outside every block by the module that holds them (``lm_head``). An int: the
    module path cut at that many components instead (``blocks.3.attn.qkv.weight`` is in layer
    ``blocks.3`` at depth 2; parameters of shallower modules use their full module path).
    See ``trainer_agent.measure.params.layer_names``."""

    per_layer: PerLayer = "rank0"
    """Which ranks export the per-layer metrics: ``"rank0"`` (bounds the series count),
    ``"all"``, or ``"off"`` (not computed at all). Under every supported layout (data
    parallelism, FSDP2, HSDP, tensor parallelism) each rank's per-layer values are the job's,
    the same as rank 0's: ``"all"`` serves a copy on every rank (L x 7 more series per rank)."""

    job_metrics: JobMetrics = "rank0"
    """Which ranks export the job-level metrics (scope ``job`` in ``trainguard.protocol.catalog``:
    the global gradient norm, the LR, the update ratio, the noise scale, the controller's state
    ...), which are the same on every rank: ``"rank0"``, the leader only (each other rank serves
    only its own values), or ``"all"``, a copy on every rank (e.g. so that they stay visible while
    rank 0's endpoint is not scraped) — except the noise scale, the gradient variance and the
    recommended batch size, which the leader alone makes from every rank's gathered values."""

    update_ratio: UpdateRatioMode = "report"
    """When the weights before the step are snapshotted for ``update_ratio``/``effective_lr``:
    ``"report"`` on report steps only (one reusable buffer, cost amortised over
    ``report_every``), ``"every"`` step, or ``"off"`` (no buffer, metrics absent). The buffer
    has the parameters' dtype: a bf16 copy would round W_before by ~4e-3 relative, more than a
    typical update. On consecutive measured steps ``||W_before||`` is taken from the last
    ``||W_after||`` when no parameter's version counter moved in between, and on the CPU the
    snapshot itself is W_after of the last step under the same condition (the update pass
    copies it there while it is in cache, which saves the next step's copy). Writes through
    ``p.data`` bypass that counter; if your loop writes weights that way between steps, use
    ``"report"`` with ``report_every >= 2``, where two measured steps are never consecutive."""

    grad_noise: bool = True
    """Estimate the gradient noise scale from micro-batch gradient norms (several backward passes
    per optimizer step) and/or data-parallel ranks. Costs one extra pass over the incoming
    gradients of the second and later backward passes of a step (every backward under DDP):
    fused, one norm call per bucket of at most 32 MiB of held gradients, where a gradient is
    accumulated into an existing ``.grad``; one norm per tensor where ``.grad`` is empty."""

    comm_timing: bool = False
    """Time DDP's gradient all-reduce per step through a communication hook the agent registers
    (``trainer_agent/measure/comm_timing.py``: ``trainguard_comm_seconds``, ``trainguard_comm_exposed_seconds``,
    ``trainguard_comm_exposed_ratio``). Opt-in: DDP takes one communication hook, so a model with
    the user's own reports NaN, and a ``register_comm_hook`` of the user's after ``attach`` would
    raise; CUDA and FSDP2 report NaN (see that module)."""

    fingerprint: bool = True
    """With several data-parallel ranks: on report steps, fingerprint every layer's gradients (in
    the optimizer's pre-hook) and parameters with random +-1 projections, carry them in the report
    step's collective and compare them across ranks (``trainer_agent/measure/fingerprint.py``). With
    sharded parameters (DTensors) only replicas are compared: ranks whose shards the placements
    say are identical (HSDP's replicate dimension, tensor parallel's replicated parameters); off
    under plain FSDP, which replicates nothing. Left out, with a warning at attach, where ranks hold
    different values by design (``trainer_agent/measure/fingerprint_layouts.py``): FSDP1's shards,
    every parameter under post-local SGD, and ``rank_local_params``."""

    rank_local_params: tuple[str, ...] = ()
    """Parameter-name prefixes (as ``model.named_parameters()`` names them, without DDP's
    ``module.`` or FSDP1's wrapper component; a prefix covers a module's parameters:
    ``"blocks.3.experts"``) of the parameters that hold different values on each rank by design,
    e.g. expert-parallel experts held as plain tensors: left out of the cross-rank fingerprints.
    A prefix that names no parameter is refused at attach (``ValueError``)."""

    triage: bool = True
    """On report steps, in the optimizer's pre-hook: per-layer gradient mean / std / max / min
    and the predicted update size (``trainer_agent/measure/triage_stats.py``; the stability guide, 5.1)."""

    preflight_fatal: bool | tuple[str, ...] = False
    """Which failed pre-flight checks (``Agent.preflight``) raise ``RuntimeError`` before
    training starts: True for every check, or a tuple of check names (e.g. ``("nonfinite",
    "ranks_agree")``); False: failures are only reported."""

    desync_rel_tol: float = 1e-5
    """Largest relative difference of a layer's fingerprints across ranks that counts as in sync
    (the difference over the layer's norm)."""

    verify_every: int | None = None
    """Recompute the gradient of every ``verify_every``-th step on the same batch and compare it
    with the one the step produced, on every rank (``trainer_agent/diagnostics/verify.py``; the loop calls
    ``agent.verify_step(batch, loss_fn)`` each step, a no-op unless due). None: only on request
    (``agent.request_verify()`` or the controller's ``verify`` command). Costs one forward and
    backward pass per checked step."""

    verify_rel_tol: float = 1e-5
    """Largest relative difference per layer between a step's gradient and its recomputation that
    counts as equal (GPU kernels that are not deterministic differ by ~1e-7)."""

    memory_trace_steps: int = 3
    """Steps a memory trace started by the controller (its ``memory_trace`` command or rule
    action) follows (``trainer_agent/diagnostics/memory_trace.py``)."""

    vocab_size: int | None = None
    """When set (and no ``data_monitor`` is given to ``attach``), the agent builds a
    ``DataMonitor(vocab_size, special_ids)`` and feeds it the batches of ``observe_batch``. At
    most 4,194,304 ids (the monitor's table takes about 23 bytes an id)."""

    special_ids: tuple[int, ...] = ()
    """Control/special/unknown token ids for the data monitor the agent builds."""

    controller: str | None = field(default_factory=lambda: _env("TRAINGUARD_CONTROLLER"))
    """Base URL of the trainguard controller (default: ``$TRAINGUARD_CONTROLLER``), or several
    separated by commas: controllers that share one database (an active one and its standbys);
    the leader talks to one and moves to the next when it fails or answers as a standby. ``None``:
    no control plane, unless ``skip_nonfinite`` asks for the local guard."""

    token: str | None = field(default_factory=lambda: _env("TRAINGUARD_TOKEN"), repr=False)
    """Bearer token of this run at the controller (default: ``$TRAINGUARD_TOKEN``)."""

    sync_every: int = 1
    """Steps between two agreements of all ranks on the controller's newest desired state."""

    skip_nonfinite: bool = False
    """Skip the optimizer update on every rank when any rank's gradients hold a NaN or Inf (its
    global gradient norm is non-finite): parameters and optimizer state stay as they were. A
    non-finite loss whose gradients are finite is not skipped (it is counted in
    ``trainguard_nonfinite_steps_total``). Costs one device read per optimizer step."""

    skip_spikes: bool | None = None
    """Skip (like a non-finite step, on every rank, at the same step) a step whose global
    gradient norm is far above its rolling window: median + 6 robust sigmas and 5x the median
    over the last 128 steps taken (``spike``; ``trainer_agent/control/spike_guard.py``), counted in
    ``trainguard_skipped_steps_total{reason="spike"}``. Implies skipping non-finite steps.
    ``None`` (default): on when a controller is configured — a controlled run has someone to
    escalate to when skipping is not enough (after ``spike.max_consecutive`` skips in a row the
    guard takes the step and the controller's rules act) — off otherwise, so that a run without
    a controller trains exactly as written. Costs one device read per optimizer step (the
    non-finite check's). Use :attr:`spike_guard_on` for the resolved value."""

    spike: SpikeGuardConfig = field(default_factory=SpikeGuardConfig)
    """Thresholds of the spike guard."""

    snapshot_every: int | None = None
    """Steps between two in-memory snapshots of the training state (model, optimizer, LR
    scheduler, GradScaler, the agent's own state) that a ``rollback`` from the controller
    restores (``trainer_agent/control/snapshots.py``). ``None``: no snapshots, a rollback is refused."""

    snapshot_keep: int = 3
    """Snapshots kept, spaced out geometrically (the newest, then gaps of up to 2, 4, 8... x
    ``snapshot_every``; ``trainguard/protocol/retention.py``): the oldest is
    ``(2**(keep-1) - 1)`` to twice that many intervals old. Choose it so that this covers an
    incident from its onset to the controller's rollback rung (detection, then the ladder's
    windows). Each costs host memory of the model's and optimizer's size (or, with
    ``snapshot_backend``, whatever the backend keeps)."""

    request_timeout_s: float = 2.0
    """Timeout of every request to the controller, in seconds (at most a day)."""

    max_buffered_reports: int = 64
    """Reports kept while the controller is unreachable; the oldest are dropped beyond this."""

    close_timeout_s: float = 5.0
    """Default deadline of ``Agent.close()`` in seconds (at most a day)."""

    flops_per_token: float | None = None
    """Model FLOPs of one token's forward and backward pass, for ``trainguard_mfu``
    (``trainer_agent/measure/flops.py``). None: ``6 N + 12 L H Q T`` from the model's config when it is a
    standard transformer (Hugging Face names; ``T`` its maximum sequence length), else no MFU."""

    peak_flops: float | None = None
    """Peak FLOP/s of one device, for ``trainguard_mfu``. None: the dense 16-bit tensor-core peak
    of the CUDA device by its name (``trainer_agent.measure.flops.PEAK_FLOPS``), none on a CPU."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """``ValueError`` naming the first setting out of its range (``attach`` checks again: the
        dataclass can be changed after it was made)."""
        for name in _POSITIVE_INTS:
            _positive_int(name, getattr(self, name))
        for name in _OPTIONAL_POSITIVE_INTS:
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        for name in _BOOLS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                spelled = ", ".join(map(repr, choices[:-1])) + f" or {choices[-1]!r}"
                raise ValueError(f"{name} must be {spelled}, got {getattr(self, name)!r}")
        for name in ("flops_per_token", "peak_flops"):
            value = getattr(self, name)
            if value is not None and not _finite(value, above=0):
                raise ValueError(f"{name} must be None or a finite number > 0, got {value!r}")
        for name in ("desync_rel_tol", "verify_rel_tol"):
            if not _finite(getattr(self, name), at_least=0):
                raise ValueError(f"{name} must be a finite number >= 0, got {getattr(self, name)!r}")
        for name in ("request_timeout_s", "close_timeout_s"):
            value = getattr(self, name)
            if not _finite(value, above=0) or value > MAX_TIMEOUT_S:
                raise ValueError(f"{name} must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], got {value!r}")
        self._check_others()

    def _check_others(self) -> None:
        """The settings of a kind of their own (and the ones normalised to tuples)."""
        if self.metrics_port is not None:
            if type(self.metrics_port) is not int or not 0 <= self.metrics_port <= 65535:
                raise ValueError(f"metrics_port must be None or an int in 0..65535, got {self.metrics_port!r}")
        if not isinstance(self.metrics_host, str) or not self.metrics_host:
            raise ValueError("metrics_host must be a non-empty string")
        if not isinstance(self.preflight_fatal, bool):
            if isinstance(self.preflight_fatal, str) or not isinstance(self.preflight_fatal, (tuple, list, set, frozenset)):
                raise ValueError(f"preflight_fatal must be a bool or a tuple of check names (e.g. ('nonfinite',)), "
                                 f"got {self.preflight_fatal!r}")
            self.preflight_fatal = tuple(self.preflight_fatal)
            if not all(isinstance(n, str) and n for n in self.preflight_fatal):
                raise ValueError(f"preflight_fatal must be a bool or check names, got {self.preflight_fatal!r}")
        if self.skip_spikes is not None and not isinstance(self.skip_spikes, bool):
            raise ValueError(f"skip_spikes must be None or a bool, got {self.skip_spikes!r}")
        if not isinstance(self.spike, SpikeGuardConfig):
            raise ValueError(f"spike must be a SpikeGuardConfig, got {type(self.spike).__name__}")
        if isinstance(self.special_ids, (str, bytes)) or not isinstance(self.special_ids, (tuple, list, set, frozenset, range)):
            raise ValueError(f"special_ids must be a tuple of token ids, got {self.special_ids!r}")
        self.special_ids = tuple(self.special_ids)
        for i in self.special_ids:
            if type(i) is not int or i < 0 or (self.vocab_size is not None and i >= self.vocab_size):
                raise ValueError(f"special_ids must be token ids in [0, vocab_size), got {i!r}")
        if isinstance(self.rank_local_params, (str, bytes)) or not isinstance(self.rank_local_params, (tuple, list)):
            raise ValueError(f"rank_local_params must be a tuple of parameter-name prefixes, got {self.rank_local_params!r}")
        self.rank_local_params = tuple(self.rank_local_params)
        for prefix in self.rank_local_params:
            if not isinstance(prefix, str) or not prefix or not prefix.isprintable() or prefix.strip(".") != prefix:
                raise ValueError(f"rank_local_params must hold parameter-name prefixes such as 'blocks.3.experts', got {prefix!r}")
        for name in ("controller", "token"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value or not value.isprintable()):
                raise ValueError(f"{name} must be None or a non-empty printable string, got a {type(value).__name__}")
        if self.controller is not None:
            controller_urls(self.controller)

    @property
    def spike_guard_on(self) -> bool:
        """``skip_spikes`` resolved: explicit, else on exactly when a controller is configured."""
        return self.skip_spikes if self.skip_spikes is not None else self.controller is not None

    @property
    def skips_steps(self) -> bool:
        """The optimizer step is wrapped to skip steps (non-finite, and spikes when guarded)."""
        return self.skip_nonfinite or self.spike_guard_on


#: The largest vocabulary a data monitor takes (``AgentConfig.vocab_size``, ``DataMonitor``): it
#: keeps about 24 bytes per token id.
MAX_VOCAB_SIZE = 1 << 22
#: The settings checked alike in ``AgentConfig.__post_init__``, by kind.
_POSITIVE_INTS = ("report_every", "sync_every", "max_buffered_reports", "memory_trace_steps", "snapshot_keep")
_OPTIONAL_POSITIVE_INTS = ("layer_depth", "verify_every", "snapshot_every", "vocab_size")
_BOOLS = ("grad_noise", "comm_timing", "triage", "fingerprint", "skip_nonfinite")
#: Upper bounds of the int settings that size what the agent allocates: a report interval's rows
#: (16 bytes a step), the data monitor's table per token id (about 23 bytes an id), the reports and
#: steps kept or traced.
_INT_LIMITS = {"report_every": 1_000_000, "vocab_size": MAX_VOCAB_SIZE, "max_buffered_reports": 100_000,
               "memory_trace_steps": 1_000_000, "snapshot_keep": 64, "sync_every": 1_000_000}
#: Longest request and close timeout (a day; ``threading`` refuses waits of about 9e9 s and more).
MAX_TIMEOUT_S = 86_400.0
_CHOICES = {"per_layer": ("rank0", "all", "off"), "job_metrics": ("rank0", "all"),
            "update_ratio": ("report", "every", "off")}


def controller_urls(value: str) -> list[str]:
    """The controller URLs of ``AgentConfig.controller``: one, or several separated by commas (an
    active controller and its standbys on one database, in any order); ``ValueError`` unless each
    is an http(s) URL."""
    urls = [u.strip().rstrip("/") for u in value.split(",")]
    for u in urls:
        if not u.startswith(("http://", "https://")) or not urlsplit(u).netloc:
            raise ValueError(f"controller URL must start with http:// or https://, got {u!r} (in {value!r})")
    if len(set(urls)) != len(urls):
        raise ValueError(f"controller URLs named twice in {value!r}")
    return urls


def _finite(value: object, *, above: float | None = None, at_least: float | None = None) -> bool:
    """A finite int or float (not a bool) above ``above`` / at least ``at_least``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    return (above is None or value > above) and (at_least is None or value >= at_least)


def _positive_int(name: str, value: object) -> None:
    most = _INT_LIMITS.get(name)
    if type(value) is not int or value < 1 or (most is not None and value > most):
        raise ValueError(f"{name} must be an int in 1..{most or 'any'}, got {value!r}")
