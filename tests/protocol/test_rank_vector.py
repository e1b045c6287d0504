"""trainguard.protocol.rank_vector: a report's per-rank vectors packed on the wire. NaN, ±Inf and
-0.0 come back bit for bit in every form; a vector declared float64 is never rounded; a timing is
rounded to float32 only in a large job and never becomes an infinity; a malformed packed vector is
refused with what is wrong; the JSON list of older agents stays accepted."""

from __future__ import annotations

import base64
import json
import math
import random
import struct
from array import array

import pytest
from pydantic import ValidationError

from trainguard.protocol.rank_values import BY_WIRE, RankValues
from trainguard.protocol.rank_vector import FLOAT32_FROM_RANKS, MAX_RANKS, Filled, pack
from trainguard.protocol.wire import Report, dumps

SPECIAL = [math.nan, math.inf, -math.inf, -0.0, 0.0, 1.5, -2.0]


def _bits(values) -> list[bytes]:
    return [struct.pack("<d", v) for v in values]


def _round_trip(**vectors: list[float]) -> RankValues:
    report = Report(job="j", step_first=1, step_last=1, time=1.0, ranks=RankValues(**vectors))
    return Report.model_validate_json(dumps(report)).ranks


def _body(vector: object) -> str:
    return json.dumps({"job": "j", "step_first": 1, "step_last": 1, "time": 1.0, "ranks": {"loss": vector}})


@pytest.mark.parametrize("name", ["loss", "grad_fingerprint", "step_time_s"])
def test_nan_inf_and_negative_zero_come_back_bit_for_bit(name: str) -> None:
    back = getattr(_round_trip(**{name: SPECIAL}), name)
    assert isinstance(back, array) and _bits(back) == _bits(SPECIAL)
    wide = SPECIAL + [0.1]  # 0.1 needs float64: the vector goes as float64, still bit for bit
    assert _bits(getattr(_round_trip(**{name: wide}), name)) == _bits(wide)


def test_each_form_on_the_wire_is_the_documented_binary() -> None:
    body = json.loads(dumps(Report(job="j", step_first=1, step_last=1, time=1.0, ranks=RankValues(
        loss=[1.5, math.nan], grad_norm=[0.1, 0.2], grad_fingerprint=[-0.0] * 5, verify_mismatch=[math.nan] * 3))))
    ranks = body["ranks"]
    assert ranks["loss"] == {"float32": base64.b64encode(struct.pack("<2f", 1.5, math.nan)).decode()}
    assert ranks["grad_norm"] == {"float64": base64.b64encode(struct.pack("<2d", 0.1, 0.2)).decode()}
    assert ranks["grad_fingerprint"] == {"fill": -0.0, "n": 5}
    assert ranks["verify_mismatch"] == {"fill": "NaN", "n": 3}
    assert ranks["step_time_s"] == []  # absent stays absent
    back = Report.model_validate(body).ranks
    assert back.grad_fingerprint == Filled(-0.0, 5) and math.copysign(1, back.grad_fingerprint[4]) == -1
    assert len(back.verify_mismatch) == 3 and all(math.isnan(v) for v in back.verify_mismatch)


def test_zero_and_negative_zero_are_not_one_fill() -> None:
    assert pack([0.0, -0.0, 0.0]) == {"float32": base64.b64encode(struct.pack("<3f", 0.0, -0.0, 0.0)).decode()}


def test_float64_vectors_are_never_rounded() -> None:
    rng = random.Random(7)
    values = [rng.random() * 10 ** rng.randint(-300, 300) for _ in range(FLOAT32_FROM_RANKS * 2)]
    for name, spec in BY_WIRE.items():
        if spec.precision == "float64":
            assert _bits(getattr(_round_trip(**{name: values}), name)) == _bits(values), name


def test_timings_are_float32_only_in_a_large_job_and_never_overflow() -> None:
    small = [0.1 * (i + 1) for i in range(FLOAT32_FROM_RANKS - 1)]
    assert _bits(_round_trip(step_time_s=small).step_time_s) == _bits(small)  # exact below the threshold
    large = [0.1 * (i + 1) for i in range(FLOAT32_FROM_RANKS)]
    back = _round_trip(step_time_s=large).step_time_s
    assert back.typecode == "f" and list(back) == [struct.unpack("<f", struct.pack("<f", v))[0] for v in large]
    assert all(abs(b - v) <= 6e-8 * v for b, v in zip(back, large))
    huge = large[:-1] + [1e39]  # finite, beyond float32: it must not arrive as Infinity
    back = _round_trip(step_time_s=huge).step_time_s
    assert back.typecode == "d" and back[-1] == 1e39


@pytest.mark.parametrize(("vector", "message"), [
    ({"float32": "AAA"}, "'float32' is not base64"),
    ({"float64": "AAAA AAA="}, "'float64' is not base64"),
    ({"float64": base64.b64encode(b"\0" * 12).decode()}, "12 bytes: not a whole number of 8-byte values (4 trailing"),
    ({"float32": base64.b64encode(b"\0" * 6).decode()}, "(2 trailing bytes)"),
    ({"fill": 1.0}, "'n' (the number of ranks) goes with 'fill'"),
    ({"float32": "", "n": 0}, "'n' (the number of ranks) goes with 'fill'"),
    ({"fill": 1.0, "n": 2, "float64": ""}, "exactly one of 'float64', 'float32' and 'fill'"),
    ({}, "exactly one of 'float64', 'float32' and 'fill', not none"),
    ({"fill": 1.0, "n": MAX_RANKS + 1}, "less than or equal to 1000000"),
    ({"fill": 1.0, "n": -1}, "greater than or equal to 0"),
    ({"float16": ""}, "Extra inputs are not permitted"),
    ("AAAA", "Input should be an object"),
])
def test_a_malformed_packed_vector_is_refused_with_what_is_wrong(vector: object, message: str) -> None:
    with pytest.raises(ValidationError) as e:
        Report.model_validate_json(_body(vector))
    assert message in str(e.value) and "ranks.loss" in str(e.value)


def test_the_json_list_of_older_agents_is_accepted() -> None:
    ranks = Report.model_validate_json(_body([1, 2.5, "NaN", "Infinity", "-Infinity"])).ranks
    assert isinstance(ranks.loss, list) and _bits(ranks.loss) == _bits([1.0, 2.5, math.nan, math.inf, -math.inf])


def test_a_filled_vector_is_a_sequence_without_its_ranks_expanded() -> None:
    f = Filled(2.5, MAX_RANKS)
    assert len(f) == MAX_RANKS and f[0] == f[-1] == 2.5 and f[3:6] == [2.5] * 3
    with pytest.raises(IndexError):
        f[MAX_RANKS]
    with pytest.raises(ValueError, match="0..1000000 ranks"):
        Filled(1.0, MAX_RANKS + 1)
    assert sum(1 for _ in Filled(1.0, 5000)) == 5000
