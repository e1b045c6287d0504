"""service/statements.py's per-rank blob of a stored report: a row written under the first stored
layout (bit i of ``ranks_mask`` = ``PINNED[1][i]``, the present vectors' rows in bit order) reads
back with its vectors' names when the controller restarts, and a row of a newer layout (a bit
beyond the vectors known here) keeps the vectors known here instead of being dropped."""

from __future__ import annotations

import sqlite3

import numpy as np

from tests.protocol.test_rank_values import PINNED
from tests.service.conftest import register
from trainguard.service.window import VECTORS


def _insert(conn: sqlite3.Connection, run_id: int, seq: int, vectors: dict[int, list[float]]) -> None:
    """A report row as a controller writes it: ``vectors`` by bit, the rows in bit order."""
    mask = sum(1 << bit for bit in vectors)
    blob = b"".join(np.array(vectors[bit], dtype=np.float64).tobytes() for bit in sorted(vectors))
    conn.execute("INSERT INTO reports (run_id, seq, step_first, step_last, time, received, applied_generation, vals,"
                 " ranks_mask, ranks) VALUES (?,?,?,?,?,?,?,?,?,?)",
                 (run_id, seq, 10 * seq, 10 * seq + 9, 100.0 + seq, 100.0 + seq, 0, "{}", mask, blob))


def test_rows_of_the_first_layout_and_of_a_newer_one_decode_after_a_restart(app_factory, tmp_path) -> None:
    with app_factory() as c:
        register(c, world_size=2)
    v1 = PINNED[1]
    conn = sqlite3.connect(tmp_path / "tg.db", isolation_level=None)
    (run_id,) = conn.execute("SELECT id FROM runs WHERE run = 'run-1'").fetchone()
    _insert(conn, run_id, 1, {v1.index("loss"): [2.5, float("nan")], v1.index("gpu_xid"): [0.0, 79.0]})
    newer = len(VECTORS)  # a vector a later layout adds: unknown to this controller
    _insert(conn, run_id, 2, {v1.index("step_time_s"): [0.5, 0.75], newer: [1.0, 2.0],
                              v1.index("data_overlap"): [0.0, 1.0]})
    conn.close()
    with app_factory() as c:
        rows = c.app.state.controller.runs["run-1"].window.rank_rows()
    assert [seq for seq, _ in rows] == [1, 2]
    first, second = rows[0][1], rows[1][1]
    assert first.keys() == {"loss", "gpu_xid"} and first["gpu_xid"] == [0.0, 79.0]
    assert first["loss"][0] == 2.5 and np.isnan(first["loss"][1])
    assert second == {"step_time_s": [0.5, 0.75], "data_overlap": [0.0, 1.0]}
