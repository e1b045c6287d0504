"""Report size benchmark: the body of one report and what the controller stores of it, per world
size, before (per-rank vectors as JSON lists, stored as float64 rows) and after (packed vectors,
``trainguard/protocol/rank_vector.py``; compact records, ``service/rank_store.py``), side by side.

Two report shapes per world size:

* ``job``: a data-parallel job's report: timings and input waits that differ per rank, loss and
  gradient norm computed in float32, the replicas' fingerprints in sync, no desync, no recompute
  check, no XID, no data overlap measured (what the default configuration sends);
* ``every``: every vector of distinct float64 values (the most a report can carry).

Printed per case: body bytes (old, new, ratio), stored bytes per report (the per-rank blob plus the
values' JSON, old, new, ratio), and the controller's CPU per report for what changed (parse the
body, the vectors as arrays, the stored blob; process CPU time, the median of ``--repeat`` runs:
it does not depend on how many cores are free). The default report body limit applies to both
forms: ``TRAINGUARD_MAX_BODY_BYTES`` (4 MiB), or that of the largest report of a
``TRAINGUARD_MAX_WORLD_SIZE`` run if more (11.5 MB at 32,768).

    .venv/bin/python bench/report_size.py
    .venv/bin/python bench/report_size.py --world 512 --world 4096 --repeat 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable

import numpy as np

from trainguard.protocol.rank_values import RankValues
from trainguard.protocol.wire import Report, dumps
from trainguard.service import rank_store
from trainguard.service.limits import report_body_bytes
from trainguard.service.statements import dumps_values
from trainguard.service.window import VECTORS, rank_vectors


def _report(world: int, shape: str, seed: int = 0) -> Report:
    rng = np.random.default_rng(seed)
    f32 = lambda x: x.astype(np.float32).astype(np.float64)  # noqa: E731 - a float32 computation's values
    if shape == "every":
        vectors = {name: rng.random(world) for name in RankValues.model_fields}
    else:
        step = 0.8 + 0.01 * rng.random(world)
        vectors = {
            "step_time_s": step, "forward_s": 0.3 + 0.005 * rng.random(world), "input_wait_s": 0.002 * rng.random(world),
            "comm_s": 0.1 + 0.003 * rng.random(world), "comm_exposed_ratio": 0.05 * rng.random(world),
            "loss": f32(2.0 + 0.1 * rng.random(world)), "grad_norm": f32(1.0 + 0.05 * rng.random(world)),
            "grad_fingerprint": np.full(world, 12.375001), "param_fingerprint": np.full(world, -3.1e4 + 0.1),
            "grad_desync": np.zeros(world), "param_desync": np.zeros(world), "verify_mismatch": np.full(world, np.nan),
            "gpu_xid": np.zeros(world), "data_overlap": np.full(world, np.nan),
        }
    values = {f"trainguard_metric_{i}": float(i) + 0.25 for i in range(28)}
    return Report(job="bench", step_first=1, step_last=10, time=1.0, values=values,
                  ranks=RankValues(**{k: v.tolist() for k, v in vectors.items()}))


def _cpu(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return statistics.median(times)


def _old_blob(ranks: dict[str, np.ndarray]) -> bytes:
    """What a controller stored before schema 12: the float64 rows of the present vectors."""
    return b"".join(ranks[name].tobytes() for name in VECTORS if name in ranks)


def case(world: int, shape: str, repeat: int) -> dict[str, Any]:
    report = _report(world, shape)
    old_body = json.dumps(report.model_dump(), separators=(",", ":")).encode()  # an older agent's JSON lists
    new_body = dumps(report)

    def old_path() -> None:
        parsed = Report.model_validate_json(old_body)
        _old_blob(rank_vectors(parsed.ranks))

    def new_path() -> None:
        parsed = Report.model_validate_json(new_body)
        rank_store.encode(rank_vectors(parsed.ranks), VECTORS)

    ranks = rank_vectors(Report.model_validate_json(new_body).ranks)
    vals = len(dumps_values(report.values))
    _, blob = rank_store.encode(ranks, VECTORS)
    return {
        "world": world, "shape": shape, "body_old": len(old_body), "body_new": len(new_body),
        "stored_old": vals + len(_old_blob(ranks)), "stored_new": vals + len(blob or b""),
        "cpu_old": _cpu(old_path, repeat), "cpu_new": _cpu(new_path, repeat), "limit": report_body_bytes(32_768),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, action="append", help="world sizes (default 512, 4096, 32768)")
    ap.add_argument("--repeat", type=int, default=3, help="CPU measurements per case (the median is printed)")
    args = ap.parse_args()
    worlds = args.world or [512, 4096, 32_768]
    print(f"{'ranks':>6} {'report':>6} | {'body old':>10} {'body new':>10} {'ratio':>6} | {'stored old':>10} "
          f"{'stored new':>10} {'ratio':>6} | {'CPU old ms':>10} {'CPU new ms':>10}")
    for world in worlds:
        for shape in ("job", "every"):
            r = case(world, shape, args.repeat)
            print(f"{r['world']:>6} {r['shape']:>6} | {r['body_old']:>10,} {r['body_new']:>10,} "
                  f"{r['body_old'] / r['body_new']:>5.1f}x | {r['stored_old']:>10,} {r['stored_new']:>10,} "
                  f"{r['stored_old'] / r['stored_new']:>5.0f}x | {1e3 * r['cpu_old']:>10.1f} {1e3 * r['cpu_new']:>10.1f}")
    print(f"body limit: 4,194,304 (TRAINGUARD_MAX_BODY_BYTES), {report_body_bytes(32_768):,} for reports of a "
          "TRAINGUARD_MAX_WORLD_SIZE=32768 controller")


if __name__ == "__main__":
    main()
