"""Per-rank Prometheus export: a custom collector over values the agent already holds on the host.

``Agent.latest()`` and the exporter share one representation: a mapping from a *sample key* to a
float, where the key is the metric name, followed for labelled metrics by its extra labels in
Prometheus text syntax: ``trainguard_loss``, ``trainguard_learning_rate{group="0"}``. The collector
adds the base labels ``job``, ``run`` and ``rank`` and takes type and help text from the catalogue.
Scraping never touches a device: ``collect()`` only reads a dict.

A rank serves the metrics of the catalogue scopes it is given (``catalog.exported_scopes``): by
default every rank its own values, and only the leader (rank 0) the job's values and the per-layer
series, which the other ranks would only copy.
"""

from __future__ import annotations

import errno
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from wsgiref.simple_server import WSGIServer

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from trainguard.protocol.catalog import BASE_LABELS, BY_NAME, SCOPES, Scope, spec
from trainguard.protocol.names import closest

__all__ = ["sample_key", "parse_key", "catalogue_problem", "UnknownValues", "AgentCollector", "MetricsServer"]

log = logging.getLogger(__name__)

_KEY = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*(?:,|$)')


def sample_key(name: str, **labels: str) -> str:
    """``sample_key("trainguard_learning_rate", group="0")`` -> ``'trainguard_learning_rate{group="0"}'``."""
    if not labels:
        return name
    body = ",".join(
        f'{k}="{v.replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
        for k, v in labels.items()
    )
    return f"{name}{{{body}}}"


def parse_key(key: str) -> tuple[str, dict[str, str]]:
    """Inverse of :func:`sample_key`; ``ValueError`` for a malformed key."""
    m = _KEY.match(key)
    if m is None:
        raise ValueError(f"malformed sample key {key!r}")
    labels: dict[str, str] = {}
    body = m.group("labels")
    if body:
        pos = 0
        while pos < len(body):
            lm = _LABEL.match(body, pos)
            if lm is None:
                raise ValueError(f"malformed labels in sample key {key!r}")
            labels[lm.group(1)] = re.sub(r"\\(.)", r"\1", lm.group(2))
            pos = lm.end()
    return m.group("name"), labels


def catalogue_problem(key: str) -> tuple[str, str] | None:
    """(name, why) when the catalogue does not know the sample ``key``: a malformed key, a metric it
    does not list, or labels other than its spec's; None when it does."""
    try:
        name, labels = parse_key(key)
    except ValueError as exc:
        return key, str(exc)
    s = BY_NAME.get(name)
    if s is None:
        close = closest(name, BY_NAME)
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        return name, (f"the agent reports {name!r}, which the metric catalogue (trainguard.protocol.catalog) does "
                      f"not list{hint}: it is neither exported nor sent to the controller")
    if set(labels) != set(s.labels):
        want = ", ".join(s.labels) or "none"
        return f"{name}{{{','.join(sorted(labels))}}}", (
            f"the agent reports {key!r}, but {name} takes the labels {want}: it is neither exported nor sent")
    return None


class UnknownValues:
    """Counts each value the agent reports that the catalogue does not know as one agent error,
    with its name (``on_error(kind, exc)``, logged once), however often it is reported again; never
    raises. Thread-safe: the training loop and the ``/metrics`` thread both read the values.

    Keys already checked are remembered (a few per metric and label value); past
    :attr:`MAX_REMEMBERED` of them the check stops, once logged."""

    MAX_REMEMBERED = 65_536

    def __init__(self, on_error: Callable[[str, BaseException], None]) -> None:
        self._on_error = on_error
        self._seen: set[str] = set()
        self._reported: set[str] = set()
        self._lock = threading.Lock()

    def check(self, values: Mapping[str, float]) -> int:
        """Report the unknown values of ``values`` not reported before; returns how many."""
        if len(self._seen) >= self.MAX_REMEMBERED or self._seen.issuperset(values):
            return 0  # the usual case: every key checked before (no set built)
        fresh = values.keys() - self._seen
        problems = []
        with self._lock:
            for key in sorted(fresh - self._seen):
                self._seen.add(key)
                found = catalogue_problem(key)
                if found is not None and found[0] not in self._reported:
                    self._reported.add(found[0])
                    problems.append(found)
            full = len(self._seen) >= self.MAX_REMEMBERED
        for name, why in problems:
            self._on_error(f"reporting {name} (not in the catalogue)", ValueError(why))
        if full:
            log.warning("trainguard agent: %d distinct value names seen; values with new names are no longer "
                        "checked against the catalogue", self.MAX_REMEMBERED)
        return len(problems)


class AgentCollector(Collector):
    """Yields the catalogue metrics of one rank from ``source()``, a host-side mapping of sample
    keys to values (the agent's last published report), those whose catalogue scope is in
    ``scopes`` (default: all; ``catalog.exported_scopes`` says which a rank serves). Keys whose
    metric is not in the catalogue or whose labels do not match its spec are skipped (the agent
    counts such mistakes itself)."""

    def __init__(self, source: Callable[[], Mapping[str, float]], *, job: str, run: str, rank: int,
                 scopes: frozenset[Scope] | set[Scope] = frozenset(SCOPES)) -> None:
        unknown = set(scopes) - set(SCOPES)
        if unknown:
            raise ValueError(f"unknown metric scopes {sorted(unknown)}: the catalogue's are {SCOPES}")
        self._source = source
        self._base = (job, run, str(rank))
        self.scopes = frozenset(scopes)

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        scopes = self.scopes
        for key, value in self._source().items():
            try:
                name, labels = parse_key(key)
                s = spec(name)
            except ValueError:  # counted by the agent (UnknownValues)
                continue
            if s.scope not in scopes or set(labels) != set(s.labels):
                continue
            family = families.get(name)
            if family is None:
                cls = CounterMetricFamily if s.kind == "counter" else GaugeMetricFamily
                family = cls(name, s.help, labels=[*BASE_LABELS, *s.labels], unit="")
                families[name] = family
            family.add_metric([*self._base, *(labels[k] for k in s.labels)], float(value))
        yield from families.values()


class MetricsServer:
    """``/metrics`` of one registry on ``host:port`` (port 0: a free one), shut down by ``close``.

    When ``port`` is taken (several jobs on one host asking for the same port) the server binds a
    free port instead and logs it once (``fell_back`` is then True): ``port`` and ``url`` are
    always the port actually bound, which is what the agent registers with the controller, so
    the controller's service discovery lists it."""

    def __init__(self, registry: CollectorRegistry, *, host: str, port: int) -> None:
        self.fell_back = False
        try:
            server, thread = start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            if port == 0 or exc.errno != errno.EADDRINUSE:
                raise
            server, thread = start_http_server(0, addr=host, registry=registry)
            self.fell_back = True
            log.warning("trainguard agent: metrics port %d on %s is in use (another job on this host?); "
                        "serving /metrics on port %d instead, registered with the controller as such",
                        port, host, server.server_address[1])
        self._server: WSGIServer = server
        self._thread: threading.Thread = thread
        self.host = host
        self.port: int = server.server_address[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self, timeout: float) -> None:
        """Stop serving and release the port, waiting at most ``timeout`` seconds in all.

        ``shutdown()`` waits for the serving loop's next poll (up to 0.5 s in the standard
        library), so it runs on a side thread: it sets the stop flag at once, and this returns
        within ``timeout`` whatever the poll interval."""
        deadline = time.monotonic() + max(0.0, timeout)
        stopper = threading.Thread(target=self._server.shutdown, name="trainguard-metrics-stop", daemon=True)
        stopper.start()
        self._server.server_close()  # the kernel frees the port when the loop's poll returns (<= 0.5 s)
        stopper.join(max(0.0, deadline - time.monotonic()))
        self._thread.join(max(0.0, deadline - time.monotonic()))
