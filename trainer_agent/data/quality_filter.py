"""Dynamic data cleaning: the ``QualityFilter`` acts on data (drops samples); the monitor only
observes. ``dynamic_threshold`` and ``DefaultQualityScore`` are its parts."""

from __future__ import annotations

import hashlib
import math
import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from trainguard.protocol.catalog import spec
from trainer_agent.data.names import FILTERED_TOTAL
from trainer_agent.data.settings import check_pad_id, int_setting, is_real, token_ids
from trainer_agent.data.signals import _Hasher, _as_numpy, _flatten
from trainer_agent.data.monitor import _base_labels

# ---------------------------------------------------------------------------------------------
# Dynamic cleaning (the stability guide, section 3.2).


def dynamic_threshold(step: float, initial: float = 0.8, final: float = 0.95,
                      decay_steps: float = 10_000) -> float:
    """The cleaning threshold that rises as training goes on: ``final - (final - initial) * exp(-step / decay_steps)``.

    Starts at ``initial`` (keep more noisy data early, for robustness) and rises towards
    ``final``."""
    if not step >= 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if not decay_steps > 0:
        raise ValueError(f"decay_steps must be > 0, got {decay_steps}")
    if not (math.isfinite(initial) and math.isfinite(final)):
        raise ValueError(f"initial and final must be finite, got {initial}, {final}")
    return final - (final - initial) * math.exp(-step / decay_steps)


class DefaultQualityScore:
    """The default quality score of one sample, from the data signals:

        score = (1 - special share of the sample) * (duplicate_score if duplicate else 1)

    A sample is a duplicate when its exact non-padding content occurred among the last ``window``
    samples scored. With the default ``duplicate_score=0.9`` and the default schedule (0.8 -> 0.95),
    duplicates are kept early in training and dropped once the threshold passes 0.9 (about step
    11,000); samples with more than 5-20% special tokens are dropped throughout.

    A sample is a token sequence (tensor, array or list) or a mapping holding ``input_ids`` (and
    optionally ``attention_mask``), as Hugging Face datasets yield them.
    """

    def __init__(self, *, special_ids: Iterable[int] = (), window: int = 10_000,
                 duplicate_score: float = 0.9, pad_id: int | None = None) -> None:
        int_setting("window", window)
        if not (is_real(duplicate_score) and 0.0 <= duplicate_score <= 1.0):
            raise ValueError(f"duplicate_score must lie in [0, 1], got {duplicate_score!r}")
        check_pad_id(pad_id)
        self.special_ids = np.array(sorted(set(token_ids(special_ids))), dtype=np.int64)
        self.duplicate_score = duplicate_score
        self.pad_id = pad_id
        self._hasher = _Hasher(None, 1, 1, 1)
        self._recent: deque[int] = deque(maxlen=int(window))
        self._seen: Counter[int] = Counter()

    def __call__(self, sample: Any) -> float:
        """The sample's score; 0 for a sample without a token (empty, or all padding)."""
        if isinstance(sample, Mapping):
            batch = _flatten(sample["input_ids"], sample.get("attention_mask"), self.pad_id, None, allow_empty=True)
        else:
            batch = _flatten(sample, None, self.pad_id, None, allow_empty=True)
        if batch.flat.size == 0:
            return 0.0  # nothing to learn from: dropped at any threshold, and counted
        hashes, _ = self._hasher.digest(batch, near=False)
        score = 1.0
        if self.special_ids.size:
            score -= float(np.isin(batch.flat, self.special_ids).mean())
        for h in hashes.tolist():  # a 2-D sample is several sequences: any duplicate counts
            if self._seen[h] > 0:
                score *= self.duplicate_score
                break
        for h in hashes.tolist():
            if len(self._recent) == self._recent.maxlen:
                old = self._recent[0]
                self._seen[old] -= 1
                if self._seen[old] == 0:
                    del self._seen[old]
            self._recent.append(h)
            self._seen[h] += 1
        return score


def sample_identity(sample: Any) -> Hashable:
    """The default identity of a sample for loss feedback: its ``"id"`` when it is a mapping that
    has one, else a 64-bit hash of its token ids (a tensor, array or list, or a mapping's
    ``input_ids``)."""
    if isinstance(sample, Mapping):
        if "id" in sample:
            key = sample["id"]
            return key.item() if isinstance(key, torch.Tensor) else key
        sample = sample["input_ids"]
    ids = _as_numpy(sample, "sample")
    if ids.dtype == np.bool_ or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"a sample's token ids must be integers, got dtype {ids.dtype}")
    flat = np.ascontiguousarray(ids.reshape(-1), dtype=np.int64)
    return int.from_bytes(hashlib.blake2b(flat.tobytes(), digest_size=8).digest(), "little")


class QualityFilter:
    """Wraps an iterable dataset and drops the samples whose quality score is below the cleaning
    threshold at the current step (a sample is kept when ``score >= threshold``; a NaN score is
    dropped). Kept and dropped samples are counted in ``kept`` / ``dropped`` and exported as
    ``trainguard_data_filtered_total{decision="kept"|"dropped"|"downsampled"}`` when a registry is
    given.

        filt = QualityFilter(dataset, score=DefaultQualityScore(special_ids=(0,)),
                             current_step=lambda: trainer.state.global_step, registry=registry)
        for sample in filt: ...

    ``score``: a callable sample -> float (None: ``DefaultQualityScore()``). ``current_step``: a
    callable returning the training step; None uses the attribute ``step``, which the training
    loop may set. ``schedule``: step -> threshold (default ``dynamic_threshold``).
    Count in the process that serves the metrics: DataLoader worker processes have their own copy.

    **Loss feedback** (optional; the stability guide, section 3.2: down-weight what the model has
    learned well). Give the filter the per-sample losses of the last steps::

        losses = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(dim=1)
        filt.record_losses(batch_samples, losses)     # samples (or their keys) and one loss each

    A sample is *well learned* when its last recorded loss is below the ``learned_quantile``
    quantile of the last ``loss_window`` losses recorded (over all samples); the filter then keeps
    it only with probability ``learned_keep`` (a deterministic draw from ``seed``) and counts the
    others as ``downsampled``. A sample with no recorded loss, or a non-finite one, is never
    treated as learned. Samples are identified by ``key`` (default :func:`sample_identity`); the losses
    of at most ``max_tracked`` samples are kept (least recently recorded forgotten first). Record
    losses in the process that iterates the filter (``num_workers=0``, or the worker that owns it).
    """

    def __init__(self, dataset: Iterable[Any], *, score: Callable[[Any], float] | None = None,
                 current_step: Callable[[], int] | None = None,
                 schedule: Callable[[float], float] = dynamic_threshold,
                 registry: CollectorRegistry | None = None,
                 labels: Mapping[str, str] | None = None,
                 key: Callable[[Any], Hashable] = sample_identity,
                 learned_quantile: float = 0.2, learned_keep: float = 0.25,
                 loss_window: int = 10_000, max_tracked: int = 1_000_000, seed: int = 0) -> None:
        if not (is_real(learned_quantile) and 0.0 < learned_quantile < 1.0):
            raise ValueError(f"learned_quantile must lie in (0, 1), got {learned_quantile!r}")
        if not (is_real(learned_keep) and 0.0 <= learned_keep <= 1.0):
            raise ValueError(f"learned_keep must lie in [0, 1], got {learned_keep!r}")
        for name, v in (("loss_window", loss_window), ("max_tracked", max_tracked)):
            if type(v) is not int or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        int_setting("seed", seed, least=0)
        self.dataset = dataset
        self.score = score if score is not None else DefaultQualityScore()
        self.current_step = current_step
        self.schedule = schedule
        self.step = 0
        self.kept = 0
        self.dropped = 0
        self.downsampled = 0
        self.labels = _base_labels(labels)
        self.key = key
        self.learned_quantile = learned_quantile
        self.learned_keep = learned_keep
        self.max_tracked = max_tracked
        self._losses: OrderedDict[Hashable, float] = OrderedDict()
        self._recent: deque[float] = deque(maxlen=loss_window)
        self._cutoff: float | None = None  # cached quantile; None: recompute
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()
        if registry is not None:
            registry.register(_FilterCollector(self))

    def threshold(self) -> float:
        """The threshold at the current step."""
        step = self.current_step() if self.current_step is not None else self.step
        return self.schedule(step)

    def record_losses(self, samples: Iterable[Any], losses: Any, *, keys: bool = False) -> None:
        """Record one loss per sample (``losses``: a 1-D tensor, array or list of the same length;
        a device tensor is read here, a host sync). With ``keys=True``, ``samples`` are already
        keys (see ``key``). ``ValueError`` for a length mismatch or non-numeric losses."""
        if isinstance(losses, torch.Tensor):
            losses = losses.detach().to("cpu", torch.float64).numpy()
        values = np.asarray(losses, dtype=np.float64) if not isinstance(losses, np.ndarray) else losses
        values = values.reshape(-1)  # one loss per sample: [B] or [B, 1]
        if values.dtype.kind not in "fiu":
            raise ValueError(f"losses must be numbers, got dtype {values.dtype}")
        ks = list(samples) if keys else [self.key(s) for s in samples]
        if len(ks) != values.size:
            raise ValueError(f"{len(ks)} samples but {values.size} losses")
        with self._lock:
            for k, v in zip(ks, values.astype(np.float64).tolist()):
                self._losses[k] = v
                self._losses.move_to_end(k)
                if math.isfinite(v):
                    self._recent.append(v)
            while len(self._losses) > self.max_tracked:
                self._losses.popitem(last=False)
            self._cutoff = None

    def learned_cutoff(self) -> float | None:
        """The loss below which a sample counts as well learned (None before any loss)."""
        with self._lock:
            if self._cutoff is None and self._recent:
                self._cutoff = float(np.quantile(np.fromiter(self._recent, dtype=np.float64), self.learned_quantile))
            return self._cutoff

    def _learned(self, sample: Any) -> bool:
        if not self._losses:
            return False
        cutoff = self.learned_cutoff()
        loss = self._losses.get(self.key(sample))
        return cutoff is not None and loss is not None and loss < cutoff

    def __iter__(self) -> Iterator[Any]:
        for sample in self.dataset:
            if not float(self.score(sample)) >= self.threshold():
                self.dropped += 1
            elif self._learned(sample) and not self._rng.random() < self.learned_keep:
                self.downsampled += 1
            else:
                self.kept += 1
                yield sample


class _FilterCollector(Collector):
    def __init__(self, filt: QualityFilter) -> None:
        self._filter = filt

    def collect(self) -> Iterator[CounterMetricFamily]:
        s = spec(FILTERED_TOTAL)
        family = CounterMetricFamily(s.name, s.help, labels=[*self._filter.labels, "decision"])
        base = list(self._filter.labels.values())
        family.add_metric([*base, "kept"], self._filter.kept)
        family.add_metric([*base, "dropped"], self._filter.dropped)
        family.add_metric([*base, "downsampled"], self._filter.downsampled)
        yield family
