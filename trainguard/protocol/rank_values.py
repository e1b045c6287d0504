"""Per-rank values, each declared once: what every rank contributes to a report step, how the
leader gets it, which of them the report carries to the controller and which rules may name.

Everything else derives from :data:`RANK_VALUES`: the wire model :class:`RankValues` (one list per
vector, index = global rank), the agent's gathered row (``trainer_agent.report.exchange.RANK_FIELDS``) and its
map to the wire (``WIRE_VECTORS``), the row values ``trainer_agent/report/pipeline.py`` puts in that row
(a catalogue metric's report value, or a getter there for the few it computes), the vectors a rule
may name (:data:`RULE_VECTORS`) and the controller's stored layout (:data:`STORED_LAYOUT`).

**The stored layout is append-only by construction.** A stored report keeps its per-rank vectors as
a bit mask (bit ``i``: ``STORED_LAYOUT[i]`` present) and the present vectors' rows, in that order.
``STORED_LAYOUT`` is the wire vectors in declaration order, and every wire vector declares the
layout version that added it (``since``); the versions must not decrease down the list, so a new
vector goes at the end with ``since`` = the current version + 1 (declaring it mid-list fails at
import), and ``tests/protocol/test_rank_values.py`` pins the names of every released version (one
declared mid-list under an old version fails there). Bit ``i`` therefore names the same vector
under every version, and the controller decodes a row of any older layout with the current one.

Adding a per-rank value: declare it here (at the end, if the report carries it); when it is not a
catalogue metric's report value, give ``trainer_agent/report/pipeline.py``'s ``ROW_GETTERS`` its getter
(import fails without one). This module must not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import create_model

from trainguard.protocol.base import WireModel
from trainguard.protocol.catalog import BY_NAME
from trainguard.protocol.rank_vector import vector_field

__all__ = [
    "RankValueSpec", "RANK_VALUES", "BY_FIELD", "BY_WIRE", "ROW_VALUES", "STORED_LAYOUT", "RANK_LAYOUT_VERSION",
    "RULE_VECTORS", "RankValues", "stored_layout", "layout",
]

Source = Literal["row", "fingerprint", "sketch"]


@dataclass(frozen=True, slots=True)
class RankValueSpec:
    """One per-rank value."""

    field: str
    """The agent's name for it: the key of ``Agent.rank_values`` (and a column of the gathered row
    when ``source`` is ``row``)."""
    unit: str
    """Unit in words ("1" for dimensionless ratios)."""
    description: str
    """What it is, per rank; the wire field's description."""
    source: Source
    """How the leader has it: ``row``, each rank's own value, a column of the report step's
    gathered row; ``fingerprint``, the leader's comparison of the ranks' gradient and parameter
    fingerprints (``trainer_agent/measure/fingerprint.py``); ``sketch``, the leader's estimate from the
    ranks' data sketches (``trainer_agent/measure/sketch.py``)."""
    wire: str | None = None
    """The report's vector (a :class:`RankValues` field); None: the agent keeps it for itself."""
    metric: str | None = None
    """``row`` values: the catalogue metric whose report value on the rank is its row value (NaN
    when the report lacks it); None: ``trainer_agent/report/pipeline.py`` computes it (``ROW_GETTERS``)."""
    rules: bool = False
    """Whether rules may name the vector (``cross_rank``, ``desync``, ``nonfinite``'s vectors)."""
    since: int = 1
    """The stored layout version that added the wire vector."""
    precision: Literal["float64", "float32"] = "float64"
    """What the report must keep of it: ``float64``, every value exactly (fingerprints and the
    differences rules compare with a tolerance); ``float32``, 7 significant digits are enough
    (timings), so a large job sends it as float32 (:mod:`trainguard.protocol.rank_vector`)."""

    def __post_init__(self) -> None:
        if self.metric is not None and (self.source != "row" or self.metric not in BY_NAME):
            raise ValueError(f"rank value {self.field!r}: 'metric' is a catalogue metric of a row value")
        if self.rules and self.wire is None:
            raise ValueError(f"rank value {self.field!r}: rules read only what the report carries (set 'wire')")
        if self.since < 1:
            raise ValueError(f"rank value {self.field!r}: layout versions start at 1")
        if self.precision == "float32" and self.wire is None:
            raise ValueError(f"rank value {self.field!r}: 'precision' is the report's (set 'wire')")


_R = RankValueSpec

#: Every per-rank value. The report's vectors are stored in this order (see the module docstring:
#: append new wire vectors at the end).
RANK_VALUES: tuple[RankValueSpec, ...] = (
    _R("step_duration_seconds", "seconds", "Wall time of each rank's last step before the report (seconds).",
       "row", wire="step_time_s", metric="trainguard_step_duration_seconds", rules=True, precision="float32"),
    _R("loss", "1", "Each rank's own loss at the reported step (the interval's first non-finite one, if any).",
       "row", wire="loss", metric="trainguard_loss", rules=True),
    _R("grad_norm", "1", "Each rank's global gradient norm before clipping at the reported step.",
       "row", wire="grad_norm", metric="trainguard_grad_norm", rules=True),
    _R("grad_fingerprint", "1", "Each rank's whole-model fingerprint of the gradients its optimizer applied (every "
       "layer's fixed random +-1 projection of its elements over the layer's norm, summed with fixed signs): replicas "
       "in sync agree on it bit for bit.",
       "fingerprint", wire="grad_fingerprint", rules=True),
    _R("param_fingerprint", "1", "Each rank's whole-model fingerprint of its parameters (as grad_fingerprint): "
       "replicas in sync agree on it bit for bit.", "fingerprint", wire="param_fingerprint", rules=True),
    _R("grad_desync", "1", "Per rank, the largest relative difference of any layer's gradient fingerprint from the "
       "other ranks' (difference over the layer's gradient norm; 0 in sync, inf when only some ranks are non-finite). "
       "Compared layer by layer when the ranks' whole-model fingerprints differ by more than an eighth of the "
       "agent's tolerance; below that, the whole-model fingerprints' difference.",
       "fingerprint", wire="grad_desync", rules=True),
    _R("param_desync", "1", "Per rank, the largest relative difference of any layer's parameter fingerprint from the "
       "other ranks' (difference over the layer's parameter norm; compared as grad_desync).", "fingerprint",
       wire="param_desync", rules=True),
    _R("forward_seconds", "seconds", "Wall time each rank spent inside the model's forward during the reported step, "
       "in seconds.", "row", wire="forward_s", metric="trainguard_forward_seconds", rules=True, precision="float32"),
    _R("input_wait_seconds", "seconds", "Mean time per step each rank waited for its batch over the report interval "
       "(seconds).", "row", wire="input_wait_s", metric="trainguard_input_wait_seconds", rules=True, precision="float32"),
    _R("data_overlap", "1", "Largest estimated Jaccard similarity between the sequences each rank saw in the report "
       "interval and those of another rank (0: disjoint, 1: the same data); NaN where a rank saw no data.",
       "sketch", wire="data_overlap", rules=True),
    _R("verify_mismatch", "1", "Per rank, the largest relative difference, over the layers, between the gradient a step "
       "produced and the same step's gradient recomputed on the same batch (NaN: no check in the interval).",
       "row", wire="verify_mismatch", metric="trainguard_verify_rel_diff", rules=True),
    _R("gpu_xid", "code", "Per rank, the last critical XID error code its GPU's driver reported in the interval "
       "(0: none; NaN: not watched, e.g. no GPU).", "row", wire="gpu_xid", rules=True),
    # -- kept by the agent (Agent.rank_values), not sent
    _R("micro_sq_sum", "grad_norm^2", "Sum of the squared gradient norms of the rank's micro-batches at the reported "
       "step (the gradient noise scale's small-batch term).", "row"),
    _R("micro_count", "micro-batches", "Micro-batches (backward passes) of the rank's reported step.", "row"),
    _R("nonfinite_steps_total", "steps", "Steps whose loss or gradients held a non-finite value on the rank.",
       "row", metric="trainguard_nonfinite_steps_total"),
    _R("tokens_per_second", "tokens/s", "The rank's tokens per second at the reported step.",
       "row", metric="trainguard_tokens_per_second"),
    _R("param_norm", "1", "Global L2 norm of the trainable parameters after the step, as the rank sees it.",
       "row", metric="trainguard_param_norm"),
    _R("grad_desync_layer", "layer index", "Per rank, the index of the layer whose gradient fingerprint differs most "
       "from the other ranks' (NaN when no layer was compared: the whole-model fingerprints agreed).", "fingerprint"),
    _R("param_desync_layer", "layer index", "Per rank, the index of the layer whose parameter fingerprint differs "
       "most from the other ranks' (NaN when no layer was compared).", "fingerprint"),
    # -- layout version 2
    _R("comm_seconds", "seconds", "Mean time per step each rank's DDP gradient all-reduce was in flight over the "
       "report interval (seconds; NaN where not measured: CUDA/NCCL, FSDP2, a communication hook of the user's own).",
       "row", wire="comm_s", metric="trainguard_comm_seconds", rules=True, precision="float32", since=2),
    _R("comm_exposed_ratio", "1", "Share of each rank's step time over the report interval spent waiting for gradient "
       "communication after its backward compute ended (exposed communication; NaN where not measured).",
       "row", wire="comm_exposed_ratio", metric="trainguard_comm_exposed_ratio", rules=True, precision="float32", since=2),
    # -- layout version 3
    _R("verify_float32", "1", "Per rank, the largest relative difference, over the layers, between the gradient a "
       "mixed-precision step produced and the same step recomputed in float32 (NaN: no float32 recompute in the "
       "interval, or the step ran without autocast).",
       "row", wire="verify_float32", metric="trainguard_verify_float32_rel_diff", rules=True, precision="float32",
       since=3),  # compared with a tolerance of ~0.1: float32's 7 digits are plenty
)


def stored_layout(specs: tuple[RankValueSpec, ...]) -> tuple[str, ...]:
    """The stored order of ``specs``' wire vectors; ``ValueError`` when a vector comes before one
    of an older layout version (it would move every later bit of the stored rows)."""
    wire = [s for s in specs if s.wire is not None]
    for before, after in zip(wire, wire[1:]):
        if after.since < before.since:
            raise ValueError(f"rank value {before.wire!r} (layout version {before.since}) is declared before "
                             f"{after.wire!r} (version {after.since}): it would move the stored bit of every "
                             "vector after it; new vectors go at the end of RANK_VALUES")
    return tuple(s.wire for s in wire)  # type: ignore[misc]


def _unique(specs: tuple[RankValueSpec, ...]) -> None:
    for attr in ("field", "wire"):
        names = [getattr(s, attr) for s in specs if getattr(s, attr) is not None]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"rank values: duplicate {attr} {', '.join(dup)}")


_unique(RANK_VALUES)
BY_FIELD: dict[str, RankValueSpec] = {s.field: s for s in RANK_VALUES}
BY_WIRE: dict[str, RankValueSpec] = {s.wire: s for s in RANK_VALUES if s.wire is not None}
#: The gathered row's columns, in order.
ROW_VALUES: tuple[RankValueSpec, ...] = tuple(s for s in RANK_VALUES if s.source == "row")
#: Bit ``i`` of a stored report's ``ranks_mask`` is ``STORED_LAYOUT[i]`` (every version's).
STORED_LAYOUT: tuple[str, ...] = stored_layout(RANK_VALUES)
RANK_LAYOUT_VERSION: int = max(s.since for s in BY_WIRE.values())
#: The vectors rules may name.
RULE_VECTORS: tuple[str, ...] = tuple(name for name in STORED_LAYOUT if BY_WIRE[name].rules)


def layout(version: int) -> tuple[str, ...]:
    """The stored layout as of ``version`` (a prefix of :data:`STORED_LAYOUT`)."""
    return tuple(name for name in STORED_LAYOUT if BY_WIRE[name].since <= version)


def _vector(spec: RankValueSpec) -> Any:
    return vector_field(spec.description, float32=spec.precision == "float32")


#: Per-rank vectors of a report, index = global rank; every vector has ``world_size`` entries.
#: Each is a JSON list or packed binary on the wire (:mod:`trainguard.protocol.rank_vector`):
#: an agent sends the packed forms, older agents' lists stay accepted.
RankValues: type[WireModel] = create_model(  # type: ignore[call-overload]
    "RankValues",
    __base__=WireModel,
    __doc__="Per-rank vectors of a report, index = global rank. Every vector has ``world_size`` entries: a JSON "
            "list, or packed binary (``float64``/``float32``: base64 of the little-endian values; ``fill``/``n``: "
            "every rank the same value).",
    __module__=__name__,
    **{name: _vector(BY_WIRE[name]) for name in STORED_LAYOUT},
)
