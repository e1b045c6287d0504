"""Data quality inside the training rank (the stability guide, section 3).

- ``monitor``: ``DataMonitor`` (observes: duplicates, token-distribution KL, special tokens,
  length shift over a sliding window) and its Prometheus collector.
- ``feed``: ``DataFeed``, which feeds a monitor from the training loop off the step.
- ``quality_filter``: ``QualityFilter`` (acts: drops samples below a dynamic quality threshold),
  ``DefaultQualityScore``, ``dynamic_threshold``.
- ``signals``: the numpy kernels (hashing, MinHash, flattening, the KS test); ``names``: the
  metric names.
"""

from __future__ import annotations

from trainer_agent.data.feed import DataFeed
from trainer_agent.data.monitor import DataMonitor, DataMonitorConfig
from trainer_agent.data.quality_filter import DefaultQualityScore, QualityFilter, dynamic_threshold, sample_identity
from trainer_agent.data.signals import ks_2samp

__all__ = [
    "DataMonitorConfig",
    "DataMonitor",
    "DataFeed",
    "DefaultQualityScore",
    "QualityFilter",
    "dynamic_threshold",
    "ks_2samp",
    "sample_identity",
]
