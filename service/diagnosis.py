"""The source document's diagnosis knowledge, attached to every alert.

Section 5.1 of the seed ("Loss异常波动处理流程") gives a symptom → likely cause → remedy table and a
five-step triage procedure; section 6.1 a stability checklist; 3.1 the data-quality thresholds;
5.2 the memory traps; 5.3 the cross-rank consistency check. A rule names one entry of
:data:`DIAGNOSES` and its alerts carry that entry verbatim, with the values that triggered them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["Diagnosis", "DIAGNOSES", "LOSS_TRIAGE", "STABILITY_CHECKLIST", "diagnosis"]

#: Seed 5.1: the triage procedure for an abnormal loss, in the document's order.
LOSS_TRIAGE: tuple[str, ...] = (
    "Check gradient statistics (mean / variance / max / min).",
    "Verify the size of parameter updates (delta W should be about lr * gradient).",
    "Turn mixed precision off to check numerical stability.",
    "Check whether the data sampling distribution changed suddenly.",
    "Lower the learning rate 10x and watch how the behaviour changes.",
)

#: Seed 6.1: the checklist enforced before a large training run.
STABILITY_CHECKLIST: tuple[str, ...] = (
    "Gradient value range check (should be < 1e3).",
    "Parameter initialisation distribution check (mean / variance).",
    "Loss function boundary test (extreme inputs).",
    "Data pipeline throughput test.",
    "Overflow detection under mixed precision.",
)


@dataclass(frozen=True, slots=True)
class Diagnosis:
    """What a symptom usually means and what to do about it."""

    symptom: str
    """The symptom as the seed names it."""
    likely_causes: tuple[str, ...]
    """Likely causes, most likely first."""
    suggested_actions: tuple[str, ...]
    """What to do, in order."""
    source: str
    """Where in the seed this comes from."""

    def as_dict(self) -> dict[str, object]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


DIAGNOSES: dict[str, Diagnosis] = {
    "loss_nan": Diagnosis(
        symptom="Loss suddenly became NaN/Inf",
        likely_causes=(
            "Gradient explosion (seed 5.1), e.g. an LR schedule that does not fit the optimizer",
            "Mixed-precision overflow (FP16 moment buffers, loss scale too high)",
        ),
        suggested_actions=("Lower the learning rate", "Clip gradients harder", *LOSS_TRIAGE[2:3]),
        source="seed 5.1 symptom table, row 1; 2.3",
    ),
    "loss_oscillation": Diagnosis(
        symptom="Loss oscillates periodically",
        likely_causes=("Batch size too large",),
        suggested_actions=("Adjust the batch size dynamically", "Increase momentum"),
        source="seed 5.1 symptom table, row 2",
    ),
    "loss_plateau": Diagnosis(
        symptom="Loss does not decrease for a long time",
        likely_causes=("Learning rate too small", "Poor data quality"),
        suggested_actions=("Check the data", "Adjust the LR schedule"),
        source="seed 5.1 symptom table, row 3",
    ),
    "loss_rise_after_fall": Diagnosis(
        symptom="Loss rises suddenly after falling",
        likely_causes=("Abnormal optimizer state", "Mixed-precision problems"),
        suggested_actions=("Reset the optimizer state", "Check mixed precision", *LOSS_TRIAGE),
        source="seed 5.1 symptom table, row 4; 5.1 triage",
    ),
    "grad_explosion": Diagnosis(
        symptom="Gradient norm out of range (seed checklist: should be < 1e3) or spiking",
        likely_causes=(
            "Learning rate too high for the optimizer's state (gradient explosion precedes a NaN loss)",
            "Gradient scaling factor mismatched with the learning rate under AMP (seed 2.3)",
        ),
        suggested_actions=("Lower the learning rate", "Clip gradients harder", *LOSS_TRIAGE[:2]),
        source="seed 6.1 checklist item 1; 5.1 symptom table, row 1",
    ),
    "update_ratio": Diagnosis(
        symptom="Parameter updates too large relative to the parameters",
        likely_causes=("Learning rate too high", "Weight decay amplified at low precision (seed 2.3)"),
        suggested_actions=(LOSS_TRIAGE[1], "Lower the learning rate"),
        source="seed 5.1 triage step 2; 6.2",
    ),
    "optimizer_state": Diagnosis(
        symptom="Non-finite values in the optimizer state",
        likely_causes=("FP16 momentum buffers overflowed (seed 2.3)", "Abnormal optimizer state"),
        suggested_actions=("Reset the optimizer state", "Check mixed precision", "Raise eps (seed 2.2)"),
        source="seed 2.3; 5.1 symptom table, row 4",
    ),
    "data_quality": Diagnosis(
        symptom="Data quality out of bounds (duplicates > 5%, token KL > 0.1, control characters > 0.01%, length shift p < 0.05)",
        likely_causes=("Data pipeline or sampling distribution changed", "A shard with duplicated or corrupted text"),
        suggested_actions=("Check the data sampling distribution", "Inspect the current data shard", "Adjust the cleaning threshold"),
        source="seed 3.1; 5.1 triage step 4",
    ),
    "straggler": Diagnosis(
        symptom="One rank's step time is far above the others'",
        likely_causes=("Slow or throttled device or host", "Network congestion on one node", "Data loading bottleneck on one rank"),
        suggested_actions=("Inspect the slow rank's host", "Profile communication (NCCL vs Gloo)", "Check the data loader (prefetch 4-8x batch size, mmap)"),
        source="seed 5.3; 3.3",
    ),
    "input_bound": Diagnosis(
        symptom="One rank waits for its input data far longer than the others (data-slow, not compute-slow)",
        likely_causes=("Too few data loader workers or too little prefetch on that rank", "Slow storage or network file system on that node", "Heavy per-sample preprocessing in the training process"),
        suggested_actions=("Raise num_workers and prefetch (4-8 batches ahead)", "Read memory-mapped token shards instead of decoding text on the fly", "Check the node's disk and file-system latency"),
        source="trainguard (time each step waits for its batch, per rank)",
    ),
    "data_shared": Diagnosis(
        symptom="Ranks are reading the same data",
        likely_causes=("Every rank's sampler uses the same random seed and the same rank number", "The sampler is not sharded by rank (no DistributedSampler or equivalent)", "Data loader workers of a rank share one random state"),
        suggested_actions=("Give each rank its own shard of the data (sampler rank = the process's rank)", "Derive each worker's random seed from the base seed, epoch, rank and worker id", "Restart from the last checkpoint once fixed: the steps since saw less data than counted"),
        source="trainguard (sketches of the sequences each rank saw, compared across ranks)",
    ),
    "desync": Diagnosis(
        symptom="Ranks disagree on a gradient/parameter fingerprint (should differ by < 1e-5)",
        likely_causes=("Parameters not synchronised across ranks", "Gradients not all-reduced"),
        suggested_actions=("torch.distributed.barrier() and re-broadcast parameters", "all_reduce the gradients", "Restore from the last consistent checkpoint"),
        source="seed 5.3",
    ),
    "memory_growth": Diagnosis(
        symptom="Memory grows monotonically",
        likely_causes=("Oversized intermediate activations", "Gradient buffers not released", "Duplicated tensor copies", "Computation graph kept alive (retain_graph)"),
        suggested_actions=("Locate the leak layer by layer (seed 5.2)", "Check for tensors kept across steps"),
        source="seed 5.2",
    ),
    "hung": Diagnosis(
        symptom="No report from the run",
        likely_causes=("Job hung (a collective waiting on a dead rank)", "Job crashed or was preempted", "Network between the job and the controller"),
        suggested_actions=("Check the job's processes and logs", "Check the leader rank's connectivity to the controller"),
        source="trainguard (absence of reports)",
    ),
    "generic": Diagnosis(
        symptom="A monitored value crossed its rule",
        likely_causes=("See the triggering values",),
        suggested_actions=LOSS_TRIAGE,
        source="seed 5.1 triage",
    ),
}


def diagnosis(key: str) -> Diagnosis:
    """The diagnosis named ``key``; ``ValueError`` for an unknown key."""
    try:
        return DIAGNOSES[key]
    except KeyError:
        raise ValueError(f"unknown diagnosis {key!r}; known: {', '.join(sorted(DIAGNOSES))}") from None
