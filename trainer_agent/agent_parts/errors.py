"""The agent's error log: an internal error is logged once per kind, counted in
``trainguard_agent_errors_total``, and training goes on (``trainer_agent/agent.py``); and its
warnings about the training loop, each logged once."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

from trainer_agent.report.exporter import UnknownValues

__all__ = ["ErrorLog"]

#: The agent's logger: its errors are logged under the facade's name.
log = logging.getLogger("trainer_agent.agent")


class ErrorLog:
    """Counts the agent's errors and logs the first of each kind; ``error`` is the ``on_error``
    callback every collaborator gets. Thread-safe (the /metrics thread reports errors too)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0
        self._counted_elsewhere: list[Callable[[], int]] = []
        self._logged_kinds: set[str] = set()
        self._warned: set[str] = set()
        self._unknown_values = UnknownValues(self.error)  # a value the catalogue lacks: one error each

    @property
    def count(self) -> int:
        """Every error the agent counted: those given to ``error`` and those its collaborators
        count themselves (``count_also``); the value of ``trainguard_agent_errors_total``."""
        return self._count + sum(read() for read in self._counted_elsewhere)

    def count_also(self, read: Callable[[], int]) -> None:
        """Add ``read()``, a count of errors a collaborator keeps (the data feed's bad and dropped
        batches), to ``count``."""
        self._counted_elsewhere.append(read)

    def error(self, kind: str, exc: BaseException) -> None:
        with self._lock:
            self._count += 1
            first = kind not in self._logged_kinds
            self._logged_kinds.add(kind)
        if first:
            log.warning("trainguard agent: %s failed; training goes on, further %s errors are only "
                        "counted in trainguard_agent_errors_total", kind, kind, exc_info=exc)

    def warn_once(self, kind: str, text: str) -> None:
        """Log ``text`` the first time a warning of ``kind`` is given (not an error: not counted)."""
        if self.first_warning(kind):
            log.warning("%s", text)

    def first_warning(self, kind: str) -> bool:
        """True the first time a warning of ``kind`` is asked for, False after."""
        with self._lock:
            first = kind not in self._warned
            self._warned.add(kind)
        return first

    def unknown(self, values: Mapping[str, float]) -> int:
        """The values the catalogue does not know, each counted once (``UnknownValues``)."""
        return self._unknown_values.check(values)
