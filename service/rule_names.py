"""The names a rule may read, and the check that refuses any other naming the closest known ones.

A rule reads the report's values (``metric``, a rate's ``per``, the ``adaptive_lr`` action's and
the ``recovery`` section's ``metric``) and its per-rank vectors (``vector``, ``vectors``). The
controller's window holds exactly what the agents report (``service/window.py``; the evaluation,
``service/evaluate.py`` and ``service/rate_and_oscillation.py``, derives nothing it stores back), and an agent
reports its catalogue's metrics without labels (``trainguard.protocol.catalog``; the labelled ones,
e.g. one per layer, stay on its ``/metrics``) and the per-rank vectors of
``trainguard.protocol.rank_values``. The Prometheus recording rules of ``dashboards/rules.py`` live
in Prometheus, which the controller's rules never read. A rule on any other name would never fire.

Vectors are always checked. Metrics are checked where rules come in (``PUT /v1/rules``, the
controller's ``--rules`` file, ``trainguard rules check``): :func:`load_rules
<service.rules.load_rules>` with ``check_names=True`` puts :data:`CHECK_NAMES` in the validation
context. Rules stored before this check are loaded as they are.
"""

from __future__ import annotations

from pydantic import ValidationInfo
from pydantic_core import PydanticCustomError

from trainguard.protocol.catalog import BY_NAME
from trainguard.protocol.names import closest
from trainguard.protocol.rank_values import RULE_VECTORS

__all__ = ["RULE_METRICS", "RULE_VECTORS", "CHECK_NAMES", "metric_problem", "vector_problem", "known_metric",
           "known_vector"]

#: The report values a rule may read: the agent catalogue's metrics without labels.
RULE_METRICS: tuple[str, ...] = tuple(sorted(name for name, s in BY_NAME.items() if not s.labels))
_METRICS = frozenset(RULE_METRICS)

#: The validation context key that turns the metric check on.
CHECK_NAMES = "check_names"


def _closest(name: str, known: tuple[str, ...]) -> str:
    close = closest(name, known)
    return f"; the closest known: {', '.join(close)}" if close else ""


def metric_problem(name: str) -> str | None:
    """Why a rule cannot read ``name`` (None: it can)."""
    if name in _METRICS:
        return None
    spec = BY_NAME.get(name)
    if spec is not None:
        return (f"metric {name!r} has the label(s) {', '.join(spec.labels)}: reports carry only metrics without labels, "
                f"so a rule on it never fires{_closest(name, RULE_METRICS)}")
    return f"unknown metric {name!r}: no report carries it, so a rule on it never fires{_closest(name, RULE_METRICS)}"


def vector_problem(name: str) -> str | None:
    """Why a rule cannot read the per-rank vector ``name`` (None: it can)."""
    if name in RULE_VECTORS:
        return None
    return f"unknown per-rank vector {name!r}{_closest(name, RULE_VECTORS) or '; known: ' + ', '.join(RULE_VECTORS)}"


def known_metric(name: str, info: ValidationInfo) -> str:
    """Pydantic validator of a rule's metric name (checked when the context asks for it)."""
    if info.context and info.context.get(CHECK_NAMES):
        problem = metric_problem(name)
        if problem is not None:
            raise PydanticCustomError("unknown_metric", problem)
    return name


def known_vector(name: str) -> str:
    """Pydantic validator of a rule's per-rank vector name."""
    problem = vector_problem(name)
    if problem is not None:
        raise PydanticCustomError("unknown_vector", problem)
    return name
