"""The agent's relay to data-quality monitoring: batches from ``observe_batch`` to a ``DataMonitor``
through a ``DataFeed`` (worker thread, no sync in the step), and the monitor's values back at the
report. The monitor observes only; the cleaning filter (``QualityFilter``), which acts on data, is
apart from it (``trainer_agent/data/quality_filter.py``) and not driven by the agent."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainer_agent.config import AgentConfig

__all__ = ["DataRelay"]


class DataRelay:
    """Owns the ``DataFeed`` of ``monitor`` (built from the config when none is given)."""

    def __init__(self, monitor: Any, on_error: Callable[[str, BaseException], None]) -> None:
        from trainer_agent.data import DataFeed

        self.monitor = monitor
        self.feed = DataFeed(monitor)
        self._on_error = on_error
        self.values: dict[str, float] = {}
        """The monitor's values as of the last refresh (host floats)."""

    @classmethod
    def build(cls, monitor: Any, config: AgentConfig,
              on_error: Callable[[str, BaseException], None]) -> DataRelay | None:
        """The relay for ``monitor``, or for a monitor built from ``config.vocab_size``; None
        without either."""
        if monitor is None and config.vocab_size is not None:
            from trainer_agent.data import DataMonitor

            monitor = DataMonitor(config.vocab_size, special_ids=config.special_ids)
        return None if monitor is None else cls(monitor, on_error)

    def submit(self, input_ids: Any, attention_mask: Any) -> None:
        self.feed.submit(input_ids, attention_mask)

    def refresh(self, flush: bool = False) -> None:
        """Re-read the monitor's values; with ``flush``, after the batches submitted so far."""
        try:
            if flush:
                self.feed.flush(timeout=1.0)
            self.values = {k: float(v) for k, v in self.feed.values().items()}
        except Exception as exc:
            self._on_error("data_monitor", exc)

    def take_sketch(self) -> Any:
        """The monitor's bottom-k sketch of the sequences observed since the last call (None for
        a monitor that keeps none). Batches still queued in the feed count in the next one."""
        take = getattr(self.monitor, "take_sketch", None)
        return take() if take is not None else None

    @property
    def errors(self) -> int:
        """Bad batches (counted by the feed's worker) and batches dropped because the monitor fell
        too far behind."""
        return self.feed.errors + self.feed.dropped

    def close(self, timeout: float) -> None:
        self.feed.close(timeout)
