"""service/rank_store.py: a stored report's per-rank vectors in a few KB. A vector read back gives
every rule verdict the original gives (random rows with ties, stragglers, NaN/Inf, negative
values), exactly the original where the record says so (small worlds, constant vectors, a few
outliers), and the non-finite ranks always; a 4,096-rank report takes <= 32 KB in the database
(measured from the row through the real app); a 32,768-rank report is taken end to end; a report
sent again after a restart is still recognised."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tests.service.conftest import register
from trainguard.service import rank_store
from trainguard.service.evaluate_ranks import _CHECKS, _row_verdicts, cross_rank as _cross_rank
from trainguard.service.limits import report_body_bytes
from trainguard.service.rules import CrossRankRule
from trainguard.service.slow_ranks import slow_ranks
from trainguard.service.window import VECTORS, RunWindow
from trainguard.protocol.rank_values import RankValues
from trainguard.protocol.wire import Report, dumps

RULES = [
    CrossRankRule(name="spread", kind="cross_rank", vector="step_time_s", check="spread", ratio=1.5),
    CrossRankRule(name="spread_floor", kind="cross_rank", vector="step_time_s", check="spread", ratio=1.2, min_value=0.5),
    CrossRankRule(name="mismatch", kind="cross_rank", vector="grad_fingerprint", check="mismatch", rel_tol=1e-5),
    CrossRankRule(name="mismatch_exact", kind="cross_rank", vector="grad_fingerprint", check="mismatch", rel_tol=0.0),
    CrossRankRule(name="above", kind="cross_rank", vector="data_overlap", check="above", value=0.9),
]


def _rows(world: int, seed: int) -> list[np.ndarray]:
    """Rows of every shape a job produces: noise, ties, one straggler, all equal but one, NaN and
    Inf here and there, negative values, many NaN (the 2-bit map), none finite."""
    rng = np.random.default_rng(seed)
    rows = [rng.random(world), rng.choice([0.5, 0.75, 1.0], world), 1.0 + 0.01 * rng.random(world),
            np.full(world, 2.0), -rng.random(world), rng.normal(0, 1, world)]
    rows[2][rng.integers(world)] = 3.0  # a straggler
    rows[3][rng.integers(world)] = 2.0 + 1e-7  # one replica off by 5e-8
    noisy = rng.random(world)
    noisy[rng.choice(world, 5, replace=False)] = [math.nan, math.inf, -math.inf, math.nan, math.inf]
    many_nan = rng.random(world)
    many_nan[rng.choice(world, world // 3, replace=False)] = math.nan
    ties_top = np.ones(world)
    ties_top[rng.choice(world, 40, replace=False)] = 5.0  # more ranks tie on top than are kept
    return rows + [noisy, many_nan, ties_top, np.full(world, math.nan), np.where(rng.random(world) < 0.5, math.inf, math.nan)]


def _decoded(row: np.ndarray, name: str = "step_time_s") -> tuple[np.ndarray, bool]:
    mask, blob = rank_store.encode({name: row}, VECTORS)
    back = rank_store.decode(mask, blob, rank_store.FORMAT_RECORDS, len(row), VECTORS)
    return back[name], name in back.exact


@pytest.mark.parametrize("world", [300, 4096])
def test_every_verdict_on_a_stored_row_is_that_on_the_original(world: int) -> None:
    for seed in range(3):
        for row in _rows(world, seed):
            back, exact = _decoded(row)
            assert np.array_equal(np.isnan(back), np.isnan(row)) and np.array_equal(back == math.inf, row == math.inf)
            assert np.array_equal(back == -math.inf, row == -math.inf)
            if exact:
                assert back.tobytes() == row.tobytes()
            for rule in RULES:
                if rule.check == "spread":
                    assert _spread_verdict(rule, back) == _spread_verdict(rule, row), (rule.name, seed)
                    continue
                assert _CHECKS[rule.check](rule, back)[0] == _CHECKS[rule.check](rule, row)[0], (rule.name, seed)
                three = np.stack([row, row, row])
                assert _row_verdicts(rule, np.stack([back, back, row])) == _row_verdicts(rule, three), rule.name
            if np.isfinite(row).any():
                assert _slowest(back) == _slowest(row)


def _slowest(row: np.ndarray) -> int:
    return int(np.argmax(np.where(np.isfinite(row), row, -np.inf)))


def _spread_verdict(rule: CrossRankRule, row: np.ndarray) -> tuple[bool, bool]:
    """(judged, the slowest rank is slow) on one row, against the median of its other ranks."""
    found = slow_ranks(row[None], rule.ratio, rule.min_value)
    return bool(found.judged[0]), bool(np.isfinite(row).any() and found.slow[0, _slowest(row)])


def test_a_straggler_found_over_three_reports_is_found_after_two_of_them_were_read_back() -> None:
    world = 4096
    rng = np.random.default_rng(1)
    rows = [0.2 + 0.001 * rng.random(world) for _ in range(3)]
    for r in rows:
        r[77] = 0.5  # one rank 2.5x the median each time
    rule = CrossRankRule(name="straggler", kind="cross_rank", vector="step_time_s", check="spread", ratio=1.5, for_reports=3)

    def window(first_two: list[np.ndarray]) -> RunWindow:
        w = RunWindow(capacity=8, rank_capacity=8, world_size=world, created=0.0)
        for i, r in enumerate([*first_two, rows[2]]):
            w.append_raw({}, {"step_time_s": r}, i, float(i))
        return w

    original = _cross_rank(rule, window(rows[:2]), 3.0)
    stored = _cross_rank(rule, window([_decoded(r)[0] for r in rows[:2]]), 3.0)
    assert original.active is True and original.values["rank"] == 77
    # the judgement and the newest report's values alike; the median ratio over the reports read
    # back from their records within the records' precision
    assert stored.active is True and stored.values["ratio"] == pytest.approx(original.values["ratio"], rel=1e-3)
    assert {**stored.values, "ratio": 0} == {**original.values, "ratio": 0}


def test_small_worlds_and_constant_vectors_are_stored_exactly() -> None:
    rng = np.random.default_rng(2)
    small = {name: rng.normal(0, 1e3, 256) for name in VECTORS}
    small["loss"][:4] = [math.nan, math.inf, -math.inf, -0.0]
    mask, blob = rank_store.encode(small, VECTORS)
    back = rank_store.decode(mask, blob, rank_store.FORMAT_RECORDS, 256, VECTORS)
    assert back.exact == frozenset(VECTORS) and all(back[n].tobytes() == small[n].tobytes() for n in VECTORS)
    world = 4096
    few = np.full(world, 0.25)
    few[[3, 900, 4095]] = [0.5, -0.0, math.nan]
    for row in (np.full(world, -0.0), np.full(world, math.nan), few):
        got, exact = _decoded(row, "grad_fingerprint")
        assert exact and got.tobytes() == row.tobytes()


@pytest.mark.parametrize("world", [1, 2, 7, 64, 65, 256])
def test_a_small_world_stores_each_vector_in_its_shortest_exact_form(world: int) -> None:
    """Each vector of a small world is its full row (float32 when every value survives the cast,
    else float64) or, when shorter, a record listing every finite rank off the median, whatever
    the row holds; every vector decodes bit for bit. The sizes are counted here from the rows."""
    tiny = [np.random.default_rng(world).random(world), np.full(world, math.nan), np.resize([math.inf, -1.0, 2.0], world)]
    rows = (_rows(world, world) if world >= 40 else tiny) + [np.full(world, -0.0), np.full(world, 1e301), np.full(world, 0.1)]
    stragglers = np.full(world, 3.0)
    stragglers[: max(world // 8, 1)] = [math.inf, *np.arange(max(world // 8, 1) - 1, dtype=float)]
    rows.append(stragglers)
    for row in rows:
        finite = row[np.isfinite(row)]
        if len(finite):
            s = np.sort(finite)
            median = s[len(s) // 2] if len(s) % 2 else 0.5 * (s[len(s) // 2 - 1] + s[len(s) // 2])
            differ = int(np.count_nonzero(finite.view(np.uint64) != np.float64(median).view(np.uint64)))
        else:
            median, differ = math.nan, 0
        with np.errstate(over="ignore"):
            as_f4 = np.array_equal(row.astype(np.float32).astype(np.float64).view(np.uint64), row.view(np.uint64))
        full = 1 + (4 if as_f4 else 8) * world
        nonfinite = int(np.count_nonzero(~np.isfinite(row) & ~(np.isnan(row) if math.isnan(median) else False)))
        listed = 12 * differ + (2 + 5 * nonfinite if nonfinite <= rank_store.LISTED_NONFINITE else -(-world // 4))
        record = 1 + 49 + listed  # kind; background, count, 4 percentiles (8 + 4 + 32), 2 counts, flags
        record_fits = differ <= rank_store.EXACT_FINITE and abs(median) < 1e300 if len(finite) else True
        expected = record if record_fits and record < full else full
        mask, blob = rank_store.encode({"loss": row}, VECTORS)
        assert len(blob) - 20 == expected, (row[:8], differ)  # 20: the world size and the digest
        back = rank_store.decode(mask, blob, rank_store.FORMAT_RECORDS, world, VECTORS)
        assert "loss" in back.exact and back["loss"].tobytes() == row.tobytes()


def test_a_record_keeps_the_count_and_percentiles_of_the_finite_values() -> None:
    row = np.random.default_rng(5).normal(0, 1, 4096)
    row[:10] = math.nan
    mask, blob = rank_store.encode({"forward_s": row}, VECTORS)
    back = rank_store.decode(mask, blob, rank_store.FORMAT_RECORDS, 4096, VECTORS)
    count, *pct = back.percentiles["forward_s"]
    assert count == 4086 and pct == pytest.approx(np.percentile(row[10:], [5, 25, 75, 95]), rel=1e-12)


def test_rows_of_another_world_size_or_an_unknown_format_give_no_vectors() -> None:
    mask, blob = rank_store.encode({"loss": np.arange(4.0)}, VECTORS)
    assert rank_store.decode(mask, blob, rank_store.FORMAT_RECORDS, 8, VECTORS) == {}
    assert rank_store.decode(mask, blob, 7, 4, VECTORS) == {}
    assert rank_store.decode(mask, blob, rank_store.FORMAT_RECORDS, 4, VECTORS)["loss"].tolist() == [0.0, 1.0, 2.0, 3.0]


def _random_report(world: int, step: int, seed: int = 0) -> Report:
    """Every vector full of distinct values (the most a report can store), timings like a job's."""
    rng = np.random.default_rng(seed)
    vectors = {name: (0.2 + 0.01 * rng.random(world)).tolist() for name in RankValues.model_fields}
    vectors["loss"] = rng.random(world).astype(np.float32).astype(np.float64).tolist()
    vectors["loss"][5] = math.nan
    return Report(job="job-a", step_first=step, step_last=step, time=float(step), ranks=RankValues(**vectors))


def test_a_4096_rank_report_is_stored_in_32_kb(app_factory, tmp_path) -> None:
    world = 4096
    with app_factory() as c:
        register(c, run="big", world_size=world)
        report = _random_report(world, 1)
        r = c.post("/v1/runs/big/reports", content=dumps(report), headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text[:300]
        row = c.app.state.controller.store.read_now(lambda conn: conn.execute(
            "SELECT length(vals), length(ranks), ranks_format FROM reports").fetchone())
        newest = c.app.state.controller.runs["big"].window.rank_history("grad_norm", 1)[-1]
        assert newest.tolist() == list(report.ranks.grad_norm)  # the rules read the full vector
    naive = len(VECTORS) * world * 8  # every vector's float64 row, as before schema 12 (458,752 bytes)
    stored = row[0] + row[1] + 7 * 8  # values, vectors, and the row's seven numbers
    assert row[2] == rank_store.FORMAT_RECORDS and stored <= 32 * 1024 < naive
    assert row[1] <= len(VECTORS) * 600


def test_a_32768_rank_report_fits_the_body_limit_with_room_and_is_taken(app_factory) -> None:
    world = 32_768
    report = _random_report(world, 1, seed=3)
    body = dumps(report)
    old_form = json.dumps(report.model_dump(), separators=(",", ":")).encode()  # an older agent's lists
    with app_factory() as c:
        settings = c.app.state.controller.settings
        # the body of the most a report can carry (every vector of distinct values), packed: within
        # the plain body limit (4 MiB) and a third of the limit reports get at this world size
        assert len(body) < settings.max_body_bytes < len(old_form) <= report_body_bytes(settings.max_world_size)
        assert len(body) < report_body_bytes(world) / 2.5
        register(c, run="big", world_size=world)
        r = c.post("/v1/runs/big/reports", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text[:300]
        old = _random_report(world, 2, seed=4)
        r = c.post("/v1/runs/big/reports", content=json.dumps(old.model_dump()).encode(),
                   headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text[:300]
        w = c.app.state.controller.runs["big"].window
        assert c.get("/v1/runs/big").json()["last_step"] == 2
        assert w.rank_history("loss", 2)[0][6:9].tolist() == list(report.ranks.loss)[6:9]
        assert math.isnan(w.rank_history("loss", 2)[0][5]) and w.rank_history("loss", 2)[1].tolist()[6:9] == old.ranks.loss[6:9]
        sent = np.array(report.ranks.step_time_s, dtype=np.float32).astype(np.float64)  # a large job's timings: float32
        assert w.rank_history("step_time_s", 2)[0].tolist() == sent.tolist()


def test_malformed_packed_vectors_are_refused_with_a_message(app_factory) -> None:
    with app_factory() as c:
        register(c, world_size=4)
        base = {"job": "job-a", "step_first": 1, "step_last": 1, "time": 1.0}
        r = c.post("/v1/runs/run-1/reports", json=base | {"ranks": {"loss": {"float64": "AAAAAAAAAAAA"}}})
        assert r.status_code == 422 and "9 bytes: not a whole number of 8-byte values" in r.json()["detail"]
        r = c.post("/v1/runs/run-1/reports", json=base | {"ranks": {"loss": {"fill": 1.0, "n": 5}}})
        assert r.status_code == 422 and r.json()["detail"] == "ranks.loss has 5 values; the run's world_size is 4"
        r = c.post("/v1/runs/run-1/reports", json=base | {"ranks": {"loss": {"fill": 1.0, "n": 4, "float32": ""}}})
        assert r.status_code == 422 and "exactly one of 'float64', 'float32' and 'fill'" in r.json()["detail"]
        r = c.post("/v1/runs/run-1/reports", json=base | {"ranks": {"loss": {"fill": "NaN", "n": 4}}})
        assert r.status_code == 200, r.text
        assert c.get("/v1/runs/run-1").json()["reports"] == 1


def test_a_report_sent_again_after_a_restart_is_recognised(app_factory) -> None:
    world = 1024
    report = _random_report(world, 1)
    with app_factory() as c:
        register(c, run="big", world_size=world)
        assert c.post("/v1/runs/big/reports", content=dumps(report)).status_code == 200
    with app_factory() as c:  # the answer was lost: the agent sends it again to the restarted controller
        st = c.app.state.controller.runs["big"]
        stored = st.last_report[4]
        assert stored.digest and stored.keys() == set(VECTORS) and "grad_norm" not in stored.exact
        # the rules have the summaries of the stored report; people see only what is exact of it
        assert st.window.rank_history("grad_norm", 1).shape == (1, world)
        assert [(seq, set(v)) for seq, v in st.window.rank_rows()] == [(1, set(stored.exact))]
        assert c.post("/v1/runs/big/reports", content=dumps(report)).status_code == 200
        assert c.get("/v1/runs/big").json()["reports"] == 1
        assert c.post("/v1/runs/big/reports", content=dumps(_random_report(world, 2))).status_code == 200
        assert c.get("/v1/runs/big").json()["reports"] == 2
