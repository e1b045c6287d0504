"""trainguard.protocol.rank_values: the per-rank values declared once. The stored layout of every
released version is pinned here (a vector declared mid-list under an old version changes a pinned
layout and fails; one under a new version fails at import), and everything else derives from the
declarations: the wire model (names, types, descriptions, order), the agent's row and wire map,
the rules' vectors."""

from __future__ import annotations

import base64
import math
import struct

import pytest
from pydantic import ValidationError

from trainguard.protocol import rank_values as rv
from trainguard.protocol.catalog import BY_NAME
from trainguard.protocol.rank_values import (
    RANK_LAYOUT_VERSION, RANK_VALUES, RULE_VECTORS, STORED_LAYOUT, RankValues, RankValueSpec, layout, stored_layout,
)

#: Every released stored layout: bit i of a stored report's ranks_mask is names[i]. Never edit a
#: released entry; a new vector adds a version here.
PINNED: dict[int, tuple[str, ...]] = {
    1: ("step_time_s", "loss", "grad_norm", "grad_fingerprint", "param_fingerprint", "grad_desync", "param_desync",
        "forward_s", "input_wait_s", "data_overlap", "verify_mismatch", "gpu_xid"),
    2: ("step_time_s", "loss", "grad_norm", "grad_fingerprint", "param_fingerprint", "grad_desync", "param_desync",
        "forward_s", "input_wait_s", "data_overlap", "verify_mismatch", "gpu_xid", "comm_s", "comm_exposed_ratio"),
    3: ("step_time_s", "loss", "grad_norm", "grad_fingerprint", "param_fingerprint", "grad_desync", "param_desync",
        "forward_s", "input_wait_s", "data_overlap", "verify_mismatch", "gpu_xid", "comm_s", "comm_exposed_ratio",
        "verify_float32"),
}


def layout_of(specs: tuple[RankValueSpec, ...], version: int) -> tuple[str, ...]:
    since = {s.wire: s.since for s in specs if s.wire is not None}
    return tuple(n for n in stored_layout(specs) if since[n] <= version)


def _pin_problems(specs: tuple[RankValueSpec, ...]) -> list[str]:
    """How the stored layout of ``specs`` breaks the pinned ones (none: it keeps every one)."""
    names = stored_layout(specs)
    current = max(s.since for s in specs if s.wire is not None)
    problems = [] if current in PINNED or current == max(PINNED) + 1 else [f"version {current} skips a version"]
    for version, pinned in PINNED.items():
        got = layout_of(specs, version)
        if got != pinned or names[:len(pinned)] != pinned:
            problems.append(f"version {version}: {got} is not the pinned {pinned}")
    return problems


def test_every_released_layout_is_pinned_and_kept() -> None:
    assert _pin_problems(RANK_VALUES) == []
    assert RANK_LAYOUT_VERSION in PINNED, f"pin layout version {RANK_LAYOUT_VERSION} in PINNED"
    assert STORED_LAYOUT == PINNED[RANK_LAYOUT_VERSION]
    assert all(layout(v) == names for v, names in PINNED.items())


def _spec(wire: str, since: int) -> RankValueSpec:
    return RankValueSpec(wire, "1", "a new per-rank value", "row", wire=wire, rules=True, since=since)


def test_a_vector_inserted_mid_list_without_a_new_version_breaks_the_pin() -> None:
    middle = len(RANK_VALUES) // 2
    inserted = RANK_VALUES[:middle] + (_spec("new_value", 1),) + RANK_VALUES[middle:]
    problems = _pin_problems(inserted)
    assert problems[0] == f"version 1: {layout_of(inserted, 1)} is not the pinned {PINNED[1]}"
    assert "new_value" in layout_of(inserted, 1)
    # appended, but under the released version: bump it
    at_the_end = RANK_VALUES + (_spec("new_value", RANK_LAYOUT_VERSION),)
    assert [p.split(":")[0] for p in _pin_problems(at_the_end)] == [f"version {RANK_LAYOUT_VERSION}"]


def test_a_vector_of_a_new_version_goes_at_the_end_or_the_layout_is_refused() -> None:
    new = RANK_LAYOUT_VERSION + 1
    with pytest.raises(ValueError, match=f"'new_value' \\(layout version {new}\\) is declared before 'grad_fingerprint'"):
        stored_layout(RANK_VALUES[:3] + (_spec("new_value", new),) + RANK_VALUES[3:])
    appended = RANK_VALUES + (_spec("new_value", new),)
    assert stored_layout(appended) == PINNED[RANK_LAYOUT_VERSION] + ("new_value",)  # every old bit keeps its name
    assert _pin_problems(appended) == []


def test_the_wire_model_derives_from_the_declarations() -> None:
    wire = [s for s in RANK_VALUES if s.wire is not None]
    assert tuple(RankValues.model_fields) == tuple(s.wire for s in wire) == STORED_LAYOUT
    for s in wire:
        f = RankValues.model_fields[s.wire]
        assert f.description == s.description
        assert list(RankValues.model_validate_json(f'{{"{s.wire}":[0.5,"NaN"]}}').model_dump()[s.wire])[0] == 0.5
    r = RankValues(loss=[math.nan, math.inf])  # packed on the wire: float32 holds both exactly
    nan_inf = base64.b64encode(struct.pack("<2f", math.nan, math.inf)).decode()
    assert r.model_dump_json().startswith('{"step_time_s":[],"loss":{"float32":"%s"}' % nan_inf)
    timings = [s.wire for s in RANK_VALUES if s.precision == "float32"]
    assert timings == ["step_time_s", "forward_s", "input_wait_s", "comm_s", "comm_exposed_ratio", "verify_float32"]
    with pytest.raises(ValidationError):
        RankValues(not_a_vector=[1.0])


def test_declarations_are_consistent() -> None:
    assert {s.source for s in RANK_VALUES} == {"row", "fingerprint", "sketch"}
    assert all(s.metric in BY_NAME for s in RANK_VALUES if s.metric is not None)
    assert RULE_VECTORS == tuple(s.wire for s in RANK_VALUES if s.rules)
    with pytest.raises(ValueError, match="rules read only what the report carries"):
        RankValueSpec("x", "1", "d", "row", rules=True)
    with pytest.raises(ValueError, match="catalogue metric of a row value"):
        RankValueSpec("x", "1", "d", "row", metric="trainguard_no_such_metric")
    with pytest.raises(ValueError, match="duplicate wire loss"):
        rv._unique(RANK_VALUES + (RankValueSpec("loss_again", "1", "d", "row", wire="loss"),))
