"""Dynamic data cleaning: the ``QualityFilter`` acts on data (drops samples); the monitor only
observes. ``dynamic_threshold`` and ``DefaultQualityScore`` are its parts."""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from trainguard.protocol.catalog import spec
from trainer_agent.data.names import FILTERED_TOTAL
from trainer_agent.data.signals import _Hasher, _flatten
from trainer_agent.data.monitor import _base_labels

# ---------------------------------------------------------------------------------------------
# Dynamic cleaning (seed section 3.2).


def dynamic_threshold(step: float, initial: float = 0.8, final: float = 0.95,
                      decay_steps: float = 10_000) -> float:
    """The seed's cleaning threshold: ``final - (final - initial) * exp(-step / decay_steps)``.

    Starts at ``initial`` (keep more noisy data early, for robustness) and rises towards
    ``final``."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if decay_steps <= 0:
        raise ValueError(f"decay_steps must be > 0, got {decay_steps}")
    return final - (final - initial) * math.exp(-step / decay_steps)


class DefaultQualityScore:
    """The default quality score of one sample, from the data signals:

        score = (1 - special share of the sample) * (duplicate_score if duplicate else 1)

    A sample is a duplicate when its exact non-padding content occurred among the last ``window``
    samples scored. With the default ``duplicate_score=0.9`` and the seed's schedule (0.8 -> 0.95),
    duplicates are kept early in training and dropped once the threshold passes 0.9 (about step
    11,000); samples with more than 5-20% special tokens are dropped throughout.

    A sample is a token sequence (tensor, array or list) or a mapping holding ``input_ids`` (and
    optionally ``attention_mask``), as Hugging Face datasets yield them.
    """

    def __init__(self, *, special_ids: Iterable[int] = (), window: int = 10_000,
                 duplicate_score: float = 0.9, pad_id: int | None = None) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if not 0.0 <= duplicate_score <= 1.0:
            raise ValueError(f"duplicate_score must lie in [0, 1], got {duplicate_score}")
        self.special_ids = np.array(sorted({int(i) for i in special_ids}), dtype=np.int64)
        self.duplicate_score = duplicate_score
        self.pad_id = pad_id
        self._hasher = _Hasher(None, 1, 1, 1)
        self._recent: deque[int] = deque(maxlen=window)
        self._seen: Counter[int] = Counter()

    def __call__(self, sample: Any) -> float:
        if isinstance(sample, Mapping):
            batch = _flatten(sample["input_ids"], sample.get("attention_mask"), self.pad_id, None)
        else:
            batch = _flatten(sample, None, self.pad_id, None)
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


class QualityFilter:
    """Wraps an iterable dataset and drops the samples whose quality score is below the cleaning
    threshold at the current step (a sample is kept when ``score >= threshold``; a NaN score is
    dropped). Kept and dropped samples are counted in ``kept`` / ``dropped`` and exported as
    ``trainguard_data_filtered_total{decision="kept"|"dropped"}`` when a registry is given.

        filt = QualityFilter(dataset, score=DefaultQualityScore(special_ids=(0,)),
                             current_step=lambda: trainer.state.global_step, registry=registry)
        for sample in filt: ...

    ``score``: a callable sample -> float (None: ``DefaultQualityScore()``). ``current_step``: a
    callable returning the training step; None uses the attribute ``step``, which the training
    loop may set. ``schedule``: step -> threshold (default ``dynamic_threshold``).
    Count in the process that serves the metrics: DataLoader worker processes have their own copy.
    """

    def __init__(self, dataset: Iterable[Any], *, score: Callable[[Any], float] | None = None,
                 current_step: Callable[[], int] | None = None,
                 schedule: Callable[[float], float] = dynamic_threshold,
                 registry: CollectorRegistry | None = None,
                 labels: Mapping[str, str] | None = None) -> None:
        self.dataset = dataset
        self.score = score if score is not None else DefaultQualityScore()
        self.current_step = current_step
        self.schedule = schedule
        self.step = 0
        self.kept = 0
        self.dropped = 0
        self.labels = _base_labels(labels)
        if registry is not None:
            registry.register(_FilterCollector(self))

    def threshold(self) -> float:
        """The threshold at the current step."""
        step = self.current_step() if self.current_step is not None else self.step
        return self.schedule(step)

    def __iter__(self) -> Iterator[Any]:
        for sample in self.dataset:
            if float(self.score(sample)) >= self.threshold():
                self.kept += 1
                yield sample
            else:
                self.dropped += 1


class _FilterCollector(Collector):
    def __init__(self, filt: QualityFilter) -> None:
        self._filter = filt

    def collect(self) -> Iterator[CounterMetricFamily]:
        s = spec(FILTERED_TOTAL)
        family = CounterMetricFamily(s.name, s.help, labels=[*self._filter.labels, "decision"])
        base = list(self._filter.labels.values())
        family.add_metric([*base, "kept"], self._filter.kept)
        family.add_metric([*base, "dropped"], self._filter.dropped)
        yield family
