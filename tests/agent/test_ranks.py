"""RankExchange: packing of the report step's row (desired state + RANK_FIELDS + sketch) and unpacking,
single process; the 2-rank gather is exercised in test_forward_timer.py and test_agent_gather.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from trainguard.protocol.rank_values import RANK_VALUES
from trainguard.protocol.wire import DesiredState, RankValues
from trainer_agent.report.exchange import RANK_FIELDS, STATE_LEN, WIRE_VECTORS, RankExchange, decode_state, encode_state
from trainer_agent.measure.sketch import SKETCH_K, BottomK


def test_state_round_trips_bit_for_bit() -> None:
    d = DesiredState(generation=7, paused=True, lr_scale=0.1 + 0.2, checkpoint_seq=3, stop=False)
    assert decode_state(encode_state(d)) == d
    assert len(encode_state(d)) == STATE_LEN


def test_row_with_state_carries_the_leader_state_and_fields() -> None:
    ex = RankExchange(1, with_state=True)
    d = DesiredState(generation=2, lr_scale=0.25, checkpoint_seq=1, stop=True)
    fields = torch.arange(len(RANK_FIELDS), dtype=torch.float64) * 1.5
    loss_at, grad_norm_at = RANK_FIELDS.index("loss"), RANK_FIELDS.index("grad_norm")
    fields[grad_norm_at] = math.nan  # NaN survives the packing
    gathered = ex.gather(ex.pack(fields, encode_state(d)))
    assert gathered.shape == (1, STATE_LEN + len(RANK_FIELDS) + SKETCH_K)  # an empty sketch part
    assert decode_state(ex.state(gathered)) == d
    rows = RankExchange.unpack_rows(ex.fields(gathered).reshape(-1).tolist(), 1)
    assert rows["loss"] == [1.5 * loss_at] and math.isnan(rows["grad_norm"][0])
    assert rows[RANK_FIELDS[-1]] == [1.5 * (len(RANK_FIELDS) - 1)]


def test_a_non_leader_row_sends_zeros_and_a_failed_row_keeps_a_valid_state() -> None:
    ex = RankExchange(2, with_state=True)
    zeros = ex.pack(torch.ones(len(RANK_FIELDS), dtype=torch.float64), None)
    assert zeros[:STATE_LEN].view(torch.int64).tolist() == [0] * STATE_LEN
    d = DesiredState(generation=4, paused=True)
    nan = ex.nan_row(torch.device("cpu"), encode_state(d))
    assert decode_state(nan[:STATE_LEN].view(torch.int64).tolist()) == d
    assert torch.isnan(nan[STATE_LEN:]).all()


def test_rows_without_state_are_the_fields_only() -> None:
    ex = RankExchange(1, with_state=False)
    row = ex.pack(torch.zeros(len(RANK_FIELDS)), None)
    assert row.shape == (len(RANK_FIELDS),) and ex.state(row.reshape(1, -1)) is None
    with pytest.raises(ValueError, match="fields"):
        ex.pack(torch.zeros(3), None)


def test_unpack_rows_is_rank_major() -> None:
    w = len(RANK_FIELDS)
    flat = [100.0 * r + i for r in range(3) for i in range(w)]
    rows = RankExchange.unpack_rows(flat, 3)
    assert rows[RANK_FIELDS[2]] == [2.0, 102.0, 202.0]


def test_every_wire_vector_maps_to_a_rank_field() -> None:
    from trainer_agent.measure.fingerprint import findings

    assert set(WIRE_VECTORS) == set(RankValues.model_fields)
    fingerprint_vectors, _ = findings([0.0] * 8, 1, ["x"], 1e-5)
    # the leader computes data_overlap; the fingerprint comparison gives the desync vectors
    assert set(WIRE_VECTORS.values()) - {"data_overlap"} <= set(RANK_FIELDS) | set(fingerprint_vectors)
    # every fingerprint vector the leader computes is declared, with that source
    assert set(fingerprint_vectors) == {s.field for s in RANK_VALUES if s.source == "fingerprint"}
    assert [s.field for s in RANK_VALUES if s.source == "sketch"] == ["data_overlap"]


def test_extra_part_travels_between_the_fields_and_the_sketch() -> None:
    ex = RankExchange(1, with_state=True, extra_width=3)
    row = ex.pack(torch.arange(len(RANK_FIELDS), dtype=torch.float64), None, extra=torch.tensor([7.0, 8.0, 9.0]))
    gathered = ex.gather(row)
    assert ex.fields(gathered).tolist()[0] == list(map(float, range(len(RANK_FIELDS))))
    assert ex.extra(gathered).tolist() == [[7.0, 8.0, 9.0]]
    assert gathered.shape[1] == ex.width == STATE_LEN + len(RANK_FIELDS) + 3 + SKETCH_K
    assert torch.isnan(ex.extra(ex.gather(ex.nan_row(torch.device("cpu"), None)))).all()
    with pytest.raises(ValueError, match="extra part"):
        ex.pack(torch.zeros(len(RANK_FIELDS), dtype=torch.float64), None, extra=torch.zeros(2))


def test_sketches_ride_in_the_rows_and_the_leader_reads_the_overlap() -> None:
    ex = RankExchange(3, with_state=True)
    shared, other = BottomK(SKETCH_K), BottomK(SKETCH_K)
    shared.update(np.arange(1, 200, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    other.update(np.arange(500, 700, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    a = shared.take()
    d = DesiredState(generation=3, accumulation_steps=8, accumulation_lr_rule="sqrt")
    fields = torch.zeros(len(RANK_FIELDS), dtype=torch.float64)
    gathered = torch.stack([ex.pack(fields, encode_state(d), a.tolist()), ex.pack(fields, None, a.tolist()),
                            ex.pack(fields, None, other.take().tolist())])
    assert decode_state(ex.state(gathered)) == d
    sketches = ex.sketches(gathered)
    assert sketches.shape == (3, SKETCH_K)
    assert RankExchange.data_overlap(sketches.numpy()) == [1.0, 1.0, 0.0]  # ranks 0 and 1 saw the same sequences
    assert ex.fields(gathered).shape == (3, len(RANK_FIELDS))
    empty = torch.stack([ex.pack(fields, encode_state(d))] * 3)
    assert decode_state(ex.state(empty)) == d
    assert RankExchange.data_overlap(ex.sketches(empty).numpy()) is None  # no rank observed data
    assert RankExchange(3, with_state=False).sketches(ex.fields(gathered)) is None
    with pytest.raises(ValueError, match="rank"):
        RankExchange(3, with_state=True, rank=3)


def test_the_state_is_read_from_the_leaders_row_only() -> None:
    ex = RankExchange(4, with_state=True, rank=2)
    assert not ex.leader and RankExchange(4, with_state=True).leader
    d = DesiredState(generation=9, lr_scale=0.5)
    fields = torch.zeros(len(RANK_FIELDS), dtype=torch.float64)
    other = DesiredState(generation=1)  # what a non-leader row might carry: never read
    gathered = torch.stack([ex.pack(fields, encode_state(d))] + [ex.pack(fields, encode_state(other))] * 3)
    assert decode_state(ex.state(gathered)) == d
