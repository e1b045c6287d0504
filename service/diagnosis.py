"""What an alert means and what to do about it, attached to every alert.

The entries follow the stability guide: its section 5.1 symptom ->
likely cause -> remedy table and five-step loss triage, the 6.1 checklist, the 3.1 data-quality
thresholds, the 5.2 memory traps, the 5.3 cross-rank consistency check, and the 2.2/2.3 optimizer
and mixed-precision notes. The user-facing text explains in plain words; these comments cite. A rule names one entry of
:data:`DIAGNOSES` and its alerts carry that entry verbatim, with the values that triggered them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["Diagnosis", "DIAGNOSES", "LOSS_TRIAGE", "diagnosis"]

#: The stability guide, 5.1: the triage procedure for an abnormal loss, in the document's order.
LOSS_TRIAGE: tuple[str, ...] = (
    "Check gradient statistics (mean / variance / max / min).",
    "Verify the size of parameter updates (delta W should be about lr * gradient).",
    "Turn mixed precision off to check numerical stability.",
    "Check whether the data sampling distribution changed suddenly.",
    "Lower the learning rate 10x and watch how the behaviour changes.",
)


@dataclass(frozen=True, slots=True)
class Diagnosis:
    """What a symptom usually means and what to do about it."""

    symptom: str
    """The symptom, in the words an operator would use."""
    likely_causes: tuple[str, ...]
    """Likely causes, most likely first."""
    suggested_actions: tuple[str, ...]
    """What to do, in order."""
    source: str
    """Why this matters, in plain words (shown with the alert)."""

    def as_dict(self) -> dict[str, object]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


DIAGNOSES: dict[str, Diagnosis] = {
    "loss_nan": Diagnosis(
        symptom="Loss suddenly became NaN/Inf",
        likely_causes=(
            "Gradient explosion, e.g. an LR schedule that does not fit the optimizer",
            "Mixed-precision overflow (FP16 moment buffers, loss scale too high)",
        ),
        suggested_actions=("Lower the learning rate", "Clip gradients harder", *LOSS_TRIAGE[2:3]),
        source="A NaN loss almost always follows exploding gradients or an overflow under mixed precision; "
               "every step after it is wasted, so the run is paused.",
    ),
    "loss_oscillation": Diagnosis(
        symptom="Loss oscillates periodically",
        likely_causes=("Batch size too large", "Learning rate too high for the batch size",
                       "A periodic pattern in the data order (e.g. shards of different difficulty in turn)"),
        suggested_actions=("Adjust the batch size dynamically: down, a batch too large being the likely cause (the adaptive "
                           "batch size does not grow it while the loss oscillates)", "Increase momentum", "Lower the learning rate",
                           "Check that the data is shuffled across shards"),
        source="A loss that swings back and forth in a regular rhythm usually means the batch size is too large for the learning rate.",
    ),
    "loss_plateau": Diagnosis(
        symptom="Loss does not decrease for a long time (or rises again after falling)",
        likely_causes=("Learning rate too small", "Poor data quality",
                       "A loss that rises again after falling (the alert says it rose): an abnormal optimizer state, or "
                       "an optimizer setting changed mid-run (e.g. the weight decay), or mixed-precision problems"),
        suggested_actions=("Check the data", "Adjust the LR schedule",
                           "If the loss rose: reset the optimizer state (or roll back to the last good checkpoint) and "
                           "check mixed precision, rather than raising the LR"),
        source="A loss that stays flat usually means the model is not learning: a learning rate too small or data too poor; "
               "one that climbs back after training went well points to the optimizer's state instead.",
    ),
    "loss_rise_after_fall": Diagnosis(
        symptom="Loss rises suddenly after falling",
        likely_causes=("Abnormal optimizer state", "Mixed-precision problems"),
        suggested_actions=("Reset the optimizer state", "Check mixed precision", *LOSS_TRIAGE),
        source="A loss that climbs after training went well usually points to a corrupted optimizer state or a mixed-precision problem.",
    ),
    "grad_explosion": Diagnosis(
        symptom="Gradient norm out of range (should stay below 1e3) or spiking",
        likely_causes=(
            "Learning rate too high for the optimizer's state (gradient explosion precedes a NaN loss)",
            "Gradient scaling factor mismatched with the learning rate under AMP",
        ),
        suggested_actions=("Lower the learning rate", "Clip gradients harder", *LOSS_TRIAGE[:2]),
        source="Gradient values above 1e3, or a sudden jump over their recent median, usually precede divergence "
               "and a NaN loss.",
    ),
    "update_ratio": Diagnosis(
        symptom="Parameter updates too large relative to the parameters",
        likely_causes=("Learning rate too high",
                       "Abnormal optimizer state (e.g. Adam's second moments lost to a bad checkpoint load): the update per "
                       "unit of LR jumps with the LR and the gradient unchanged",
                       "Weight decay amplified at low precision"),
        suggested_actions=(LOSS_TRIAGE[1], "Lower the learning rate",
                           "If the LR and the gradient norm did not change: reset the optimizer state, or roll back to the "
                           "last good checkpoint"),
        source="Each step should change the weights by roughly 1e-4 to 1e-2 of their size; much more means the "
               "optimizer is overshooting.",
    ),
    "update_size_high": Diagnosis(
        symptom="The weights moved far more than the optimizer's update rule allows",
        likely_causes=(
            "Something other than the optimizer writes the weights (a second optimizer, an average written back, code "
            "editing parameters)",
            "The learning rate actually applied differs from the one the optimizer reports",
        ),
        suggested_actions=(LOSS_TRIAGE[1], "Look for code that writes parameters outside optimizer.step()"),
        source="Each step should change the weights by about the learning rate times the gradient (for Adam-like "
               "optimizers, at most about the learning rate per weight); a larger change comes from somewhere else.",
    ),
    "update_size_low": Diagnosis(
        symptom="The weights barely move compared with what the optimizer should do",
        likely_causes=(
            "An epsilon that dominates Adam's denominator (e.g. eps too large for small gradients)",
            "Frozen or masked parameters, or a learning rate that is effectively 0",
            "Gradient clipping that removes almost the whole update",
        ),
        suggested_actions=(LOSS_TRIAGE[1], "Check the optimizer's eps, the learning-rate schedule and the clipping threshold"),
        source="When the measured update is a tiny fraction of learning rate times gradient, training has quietly "
               "stopped for those weights.",
    ),
    "amp_loss_scale_collapse": Diagnosis(
        symptom="The mixed-precision loss scale collapsed to its minimum",
        likely_causes=(
            "Overflow to inf/NaN in every step under fp16, so the scaler keeps halving the scale",
            "Activations or gradients that have grown beyond the fp16 range (a diverging run)",
        ),
        suggested_actions=(
            LOSS_TRIAGE[2],
            "Switch to bf16, or keep the overflowing operations (softmax, normalisation, loss) in fp32",
            "Restore the last good checkpoint and lower the learning rate",
        ),
        source="When the loss scale falls to its floor, small gradients underflow to zero and every overflowing step is "
               "thrown away: large fp16 runs have failed exactly this way.",
    ),
    "amp_skips": Diagnosis(
        symptom="The mixed-precision loss scaler skips many steps",
        likely_causes=("Frequent inf/NaN gradients under fp16", "A loss scale growth interval that is too short"),
        suggested_actions=(
            LOSS_TRIAGE[2],
            "Use a GradScaler with init_scale 2**10 and growth_interval 2000",
            "Look for the layer whose gradients overflow (per-layer gradient maxima)",
        ),
        source="A few skipped steps are how the scaler finds its scale; a rising share of skipped steps means the "
               "model no longer fits the fp16 range and training is losing updates.",
    ),
    "optimizer_state": Diagnosis(
        symptom="Non-finite values in the optimizer state",
        likely_causes=("FP16 momentum buffers overflowed", "Abnormal optimizer state"),
        suggested_actions=("Reset the optimizer state", "Check mixed precision",
                           "Above 10B parameters, lower Adam's eps from 1e-6 to 1e-8 (a large eps stalls the updates of "
                           "the feed-forward layers)"),
        source="Once a moment buffer holds Inf or NaN, every update it touches is corrupted; under mixed precision "
               "the FP16 momentum buffers overflow most easily.",
    ),
    "data_quality": Diagnosis(
        symptom="Data quality out of bounds (duplicates > 5%, token KL > 0.1, control characters > 0.01%, length shift p < 0.05)",
        likely_causes=("Data pipeline or sampling distribution changed", "A shard with duplicated or corrupted text"),
        suggested_actions=("Check the data sampling distribution", "Inspect the current data shard", "Adjust the cleaning threshold"),
        source="Duplicated, shifted or corrupted text changes what the model learns long before the loss shows it.",
    ),
    "straggler": Diagnosis(
        symptom="A rank (or a group of ranks) takes far longer per step than the other ranks",
        likely_causes=("Slow or throttled device or host", "Network congestion on one node", "Data loading bottleneck on one rank",
                       "Several ranks slow together: a node type slower than the others, or one node's device, network or storage "
                       "shared by its ranks"),
        suggested_actions=("Inspect the slow ranks' node (the alert names it where the ranks registered their nodes)",
                           "Profile communication (NCCL vs Gloo)", "Check the data loader (prefetch 4-8x batch size, mmap)",
                           "With ranks slow together on one node type, balance the work per node or train on one type"),
        source="Every rank waits for the slowest one at each collective, so one slow rank slows the whole job.",
    ),
    "input_bound": Diagnosis(
        symptom="One rank waits for its input data far longer than the others (data-slow, not compute-slow)",
        likely_causes=("Too few data loader workers or too little prefetch on that rank", "Slow storage or network file system on that node", "Heavy per-sample preprocessing in the training process"),
        suggested_actions=("Raise num_workers and prefetch (4-8 batches ahead)", "Read memory-mapped token shards instead of decoding text on the fly", "Check the node's disk and file-system latency"),
        source="A rank that waits for its data holds every other rank at the next collective, so the whole job runs at the speed of its slowest loader.",
    ),
    "low_utilisation": Diagnosis(
        symptom="The devices do little of the model's arithmetic (low model-FLOPs utilisation)",
        likely_causes=("The input pipeline cannot keep up (too few workers, too little prefetch, slow storage)",
                       "Communication not overlapped with compute (small buckets, slow network, socket settings)",
                       "A micro-batch too small for the device, or host-side Python between kernels"),
        suggested_actions=("Compare trainguard_input_wait_seconds with the step time; raise num_workers and prefetch (4-8 batches)",
                           "Check the pre-flight's environment checks (CUDA_LAUNCH_BLOCKING=0, NCCL_NSOCKS_PERTHREAD=4, NCCL_SOCKET_NTHREADS=2, 16 MiB socket buffers)",
                           "Raise the micro-batch (with gradient accumulation to keep the global batch), or compile the model"),
        source="Every point of utilisation lost is paid for in GPU hours; a job at 65% of what its devices can do takes about 40% longer than one at 92% (0.92 / 0.65 = 1.42).",
    ),
    "comm_exposed": Diagnosis(
        symptom="Ranks wait for the gradient all-reduce after their backward pass (communication not hidden behind compute)",
        likely_causes=("Another rank is late with its gradients (the ranks named wait for it: compare the forward and input-wait times per rank)",
                       "A slow or congested network between the nodes, or the wrong transport (gloo where NCCL would serve)",
                       "Gradient buckets too large to overlap with the backward (the last bucket starts only when backward ends)"),
        suggested_actions=("Look for a straggler on the ranks dashboard: the rank that does not wait is the slow one",
                           "Check the network and the NCCL socket and thread settings at pre-flight",
                           "Lower DDP's bucket_cap_mb so that more of the all-reduce runs during backward"),
        source="Communication that runs after the backward has ended adds to every step; overlapped with backward it costs nothing.",
    ),
    "data_shared": Diagnosis(
        symptom="Ranks are reading the same data",
        likely_causes=("Every rank's sampler starts from the same random state with the same rank number", "The sampler is not sharded by rank (no DistributedSampler or equivalent)", "Data loader workers of a rank share one random state"),
        suggested_actions=("Give each rank its own shard of the data (sampler rank = the process's rank)", "Derive each worker's random state from the run's base value, the epoch, the rank and the worker id", "Restart from the last checkpoint once fixed: the steps since saw less data than counted"),
        source="Data-parallel ranks should each read their own share of the data; ranks that read the same samples train on less data than counted and overfit to it.",
    ),
    "desync": Diagnosis(
        symptom="Ranks disagree on a gradient/parameter fingerprint (should differ by < 1e-5)",
        likely_causes=("Parameters not synchronised across ranks", "Gradients not all-reduced"),
        suggested_actions=("torch.distributed.barrier() and re-broadcast parameters", "all_reduce the gradients", "Restore from the last consistent checkpoint"),
        source="Data-parallel ranks must hold the same weights; once they differ, the ranks train different models.",
    ),
    "grad_desync": Diagnosis(
        symptom="Data-parallel ranks applied different gradients (a layer's gradients differ by more than 1e-5 relative)",
        likely_causes=(
            "Silent data corruption on one device (a faulty GPU or memory computing wrong values without an error)",
            "A rank that skipped or only partly ran the gradient all-reduce (e.g. no_sync left on, a gradient "
            "written after the all-reduce, a parameter unused on some ranks)",
            "Non-deterministic operations or different kernels on the ranks (mixed hardware or library versions)",
            "Ranks that differ by design (a model averaged only every few steps, experts placed on ranks by hand): "
            "most ranks disagree at once",
        ),
        suggested_actions=(
            "Look at the named ranks and layers: the same rank again and again points at its hardware",
            "If the ranks hold different layers on purpose, declare them (AgentConfig(rank_local_params=...)) or "
            "turn the comparison off (AgentConfig(fingerprint=False))",
            "Re-run the step on the suspect rank and compare (the agent's gradient verification)",
            "Check the training loop for gradient changes after backward() on some ranks only",
            "Restore from the last checkpoint where the ranks agreed and exclude a suspect device",
        ),
        source="Under data parallelism every rank must apply the same all-reduced gradient; a rank that does "
               "not silently trains a different model, and a device that computes wrong values corrupts the run "
               "without any error.",
    ),
    "param_desync": Diagnosis(
        symptom="Data-parallel ranks hold different parameters (a layer differs by more than 1e-5 relative)",
        likely_causes=(
            "Earlier gradient differences between ranks that accumulated into the weights",
            "Silent data corruption in one device's memory",
            "Parameters changed on some ranks only (a checkpoint loaded on one rank, an in-place edit, "
            "parameters not broadcast at start)",
            "Ranks that differ by design (a model averaged only every few steps, experts placed on ranks by hand): "
            "declare them (AgentConfig(rank_local_params=...)) or turn the comparison off",
        ),
        suggested_actions=(
            "Restore every rank from the same checkpoint",
            "Broadcast the parameters from rank 0 (torch.distributed.broadcast) and watch whether they drift again",
            "If one rank drifts again, check its hardware",
        ),
        source="Data-parallel ranks must hold the same weights; once they differ, the ranks train different models "
               "and the averaged gradient no longer belongs to any of them.",
    ),
    "memory_growth": Diagnosis(
        symptom="Memory grows monotonically",
        likely_causes=("Oversized intermediate activations", "Gradient buffers not released", "Duplicated tensor copies", "Computation graph kept alive (retain_graph)"),
        suggested_actions=("Read the memory trace the agent ran when this fired (the run's memory_report: the layers or the "
                           "training loop that keep memory alive from one step to the next)",
                           "A loop that keeps losses or outputs with their graphs: keep loss.item() or loss.detach()",
                           "Check for tensors kept across steps (caches, lists of activations)"),
        source="Memory that only grows is a leak: the job runs out of memory later, often hours in.",
    ),
    "gradient_recompute_mismatch": Diagnosis(
        symptom="A rank recomputed a step's gradient on the same batch and got a different one",
        likely_causes=("Silent data corruption on that rank's GPU: a faulty arithmetic unit or memory returning wrong "
                       "values without an error",
                       "A kernel whose result depends on more than its inputs (uninitialised memory, a race)",
                       "The model reads state that changes between the two passes (a layer that counts its calls)"),
        suggested_actions=("Check the named rank's GPU: its XID errors and ECC counters, and run the vendor's diagnostics on it",
                           "Restart from the last checkpoint without the suspect device (training on it may have spread bad values "
                           "to every rank through the all-reduce)",
                           "If it repeats on other devices, look for nondeterminism in the model's own code"),
        source="The same inputs, weights and random state must give the same gradient (to about 1e-7 with "
               "nondeterministic GPU kernels); a larger difference means the hardware computed something else.",
    ),
    "gpu_xid": Diagnosis(
        symptom="The GPU driver reported a critical XID error on a rank",
        likely_causes=("79: the GPU fell off the bus (hardware, power or PCIe failure)",
                       "48: a double-bit ECC error (GPU memory returned corrupted data)",
                       "63 / 64: memory row remapping recorded / failed (the GPU memory is degrading)",
                       "94 / 95: contained / uncontained ECC error",
                       "13 / 31 / 43: a fault in the application's own kernels (illegal address, exception)",
                       "74: an NVLink error between GPUs"),
        suggested_actions=("Hardware codes (79, 48, 64, 95, 74): drain the node, restart from the last checkpoint on other GPUs",
                           "63 and 94: the driver contained the fault; reset the GPU when the job allows and watch for repeats",
                           "Application codes (13, 31, 43): look for out-of-range indices or custom kernels; run once with "
                           "CUDA_LAUNCH_BLOCKING=1 to find the failing operation"),
        source="XID errors are the driver's own report of a GPU fault; the hardware ones are followed by crashes or "
               "silently wrong results.",
    ),
    "hung": Diagnosis(
        symptom="No report from the run",
        likely_causes=("Job hung (a collective waiting on a dead rank)", "Job crashed or was preempted", "Network between the job and the controller"),
        suggested_actions=("Check the job's processes and logs", "Check the leader rank's connectivity to the controller"),
        source="A live run reports at every interval; silence means it is hung, crashed or cut off.",
    ),
    "batch_size": Diagnosis(
        symptom="The gradient variance left the band the adaptive batch size keeps it in",
        likely_causes=("Low variance: the global batch is smaller than the gradient noise allows (steps spent on a "
                       "gradient that averaging more samples would barely change)",
                       "High variance: the global batch is too small for the noise of the gradient (noisy, unstable updates)"),
        suggested_actions=("Nothing when the rule adjusted the accumulation steps: check the new steps and LR in the run's desired state",
                           "Tune the thresholds to the model: tr(Sigma) depends on its size and loss, so 0.1 and 1.0 are a starting point",
                           "Compare with the recommended batch size (trainguard_grad_noise_scale)"),
        source="Adapting the batch size to the gradient variance (grow it 1.5x while the variance is below 0.1, shrink "
               "it 1.2x while it is above 1.0) keeps training as stable as a fixed batch and takes about 15% less time.",
    ),
    "generic": Diagnosis(
        symptom="A monitored value crossed its rule",
        likely_causes=("See the triggering values",),
        suggested_actions=LOSS_TRIAGE,
        source="The standard triage for an abnormal loss, in order.",
    ),
}


def diagnosis(key: str) -> Diagnosis:
    """The diagnosis named ``key``; ``ValueError`` for an unknown key."""
    try:
        return DIAGNOSES[key]
    except KeyError:
        raise ValueError(f"unknown diagnosis {key!r}; known: {', '.join(sorted(DIAGNOSES))}") from None
