"""The CLI's reads as text (trainguard/cli/reads.py): an incident's evidence prints its numbers as
Python prints numbers, the wire's non-finite strings included (nan, inf, -inf: not quoted)."""

from __future__ import annotations

import json
import math
from typing import Any

from trainguard.cli import format_incidents


def _incident(*evidence: dict[str, Any]) -> dict[str, Any]:
    return {"id": 1, "onset_step": 4, "closed_step": None, "trigger": "rule:loss_nonfinite", "outcome": "open",
            "rungs": [], "cause": "data", "verdict": {"summary": "the batch", "evidence": list(evidence)}}


def _evidence(signal: str, value: Any, reference: Any = None) -> dict[str, Any]:
    return {"points_to": "data", "signal": signal, "value": value, "reference": reference, "detail": "read"}


def test_evidence_prints_non_finite_values_as_plain_numbers() -> None:
    # the body as the controller answers it: NaN and the infinities as the wire's strings
    body = json.loads(json.dumps([_incident(
        _evidence("trainguard_loss", "NaN"),
        _evidence("ranks.verify_mismatch", {"3": "Infinity", "5": 0.25}, 1e-06),
        _evidence("nonfinite", ["loss_nonfinite"], {"healthy": 0.001, "peak": "-Infinity"}),
        _evidence("trainguard_consecutive_skipped_steps", 5, 1),
    )]))
    lines = format_incidents(body).splitlines()[2:]
    assert lines == [
        "    data      trainguard_loss = nan: read",
        '    data      ranks.verify_mismatch = {"3": inf, "5": 0.25} (against 1e-06): read',
        '    data      nonfinite = ["loss_nonfinite"] (against {"healthy": 0.001, "peak": -inf}): read',
        "    data      trainguard_consecutive_skipped_steps = 5 (against 1): read",
    ]


def test_evidence_given_as_python_floats_prints_alike() -> None:
    # the demo formats the incidents it holds, floats and all
    (line,) = format_incidents([_incident(_evidence("trainguard_loss", math.nan, math.inf))]).splitlines()[2:]
    assert line == "    data      trainguard_loss = nan (against inf): read"
