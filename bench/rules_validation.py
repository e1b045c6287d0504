"""What a rules file costs to validate, and what the limits refuse (issue 22, points 4 and 5).

Prints, side by side:

1. ``load_rules`` on files of 250, 500 and 1,000 rules (``MAX_RULES``): seconds and the ratio to
   the file half its size (linear: about 2).
2. The duplicate-name check alone on 12,000 names, as it was (``names.count`` per name: quadratic)
   and as it is (one ``Counter``).
3. An alias bomb of ~12 KB (jobs x overrides x actions): ``load_rules`` refusing it before anything
   is built, against building its expansion (``yaml.safe_load`` and validating every job's overrides,
   what the loader did before the node limit), with the peak Python allocation of each (tracemalloc).

4. ``POST /v1/rules/test`` at its limits (a controller in this process, the built-in rules): the
   largest simulation it takes at each world size (the reports x ``world_size`` at
   ``MAX_RANK_REPORTS``, every per-rank vector filled), its seconds and the process's peak RSS,
   beside the next larger one's refusal; and a world size beyond ``TRAINGUARD_MAX_WORLD_SIZE``.

Run: ``.venv/bin/python bench/rules_validation.py`` (about 45 s; the bomb's expansion is measured
on 100 jobs, a tenth of the refused file, so the comparison stays short).
"""

from __future__ import annotations

import json
import resource
import tempfile
import time
import tracemalloc
from collections import Counter
from pathlib import Path

import yaml

from trainguard.service.rule_kinds import RULE_ADAPTER
from trainguard.service.rules import MAX_NODES, RulesError, RulesFile, load_rules


def _rules(n: int) -> str:
    return "rules:\n" + "".join(
        f"  - {{name: r{i}, kind: threshold, metric: m{i % 7}, op: '>', value: {i}, actions: [notify, pause], cooldown_s: 60}}\n"
        for i in range(n))


def _bomb(jobs: int, overrides: int = 100, actions: int = 16) -> str:
    acts = "[" + ", ".join(["notify"] * actions) + "]"
    text = f"rules:\n  - {{name: r, kind: threshold, metric: m, op: '>', value: 1, actions: &A {acts}}}\n"
    text += "jobs:\n  j0: &L [&P {name: r, value: 2, actions: *A}" + ", *P" * (overrides - 1) + "]\n"
    return text + "".join(f"  j{i}: *L\n" for i in range(1, jobs))


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _peak_mib() -> float:
    """Peak Python allocation since the last call, in MiB (tracemalloc)."""
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.reset_peak()
    return peak


def main() -> None:
    print("1. load_rules by rule count (best of 3)")
    last = None
    for n in (250, 500, 1000):
        text = _rules(n)
        s = _timed(lambda: load_rules(text))
        print(f"   {n:>5} rules  {s * 1e3:8.1f} ms" + (f"   x{s / last:.2f} of half the rules" if last else ""))
        last = s

    print("2. duplicate-name check on 12,000 names")
    names = [f"r{i}" for i in range(12_000)]
    old = _timed(lambda: sorted({n for n in names if names.count(n) > 1}))
    new = _timed(lambda: sorted(n for n, c in Counter(names).items() if c > 1))
    print(f"   names.count per name {old:8.3f} s   Counter {new * 1e3:8.3f} ms   ratio {old / new:,.0f}x")

    print(f"3. alias bomb (refused beyond {MAX_NODES:,} nodes once expanded)")
    bomb = _bomb(1000)
    tracemalloc.start()
    _peak_mib()
    t = time.process_time()
    try:
        load_rules(bomb)
        raise AssertionError("the bomb was accepted")
    except RulesError:
        refused = time.process_time() - t
    print(f"   {len(bomb):,} bytes, 1,000 jobs: refused in {refused * 1e3:.1f} ms CPU, peak allocation {_peak_mib():.1f} MiB")
    small = _bomb(100)
    t = time.process_time()
    data = yaml.safe_load(small)
    file = RulesFile.model_validate(data)
    base = {r.name: r for r in file.rules}
    for patches in file.jobs.values():
        rules = dict(base)
        for patch in patches:
            rules[patch["name"]] = RULE_ADAPTER.validate_python({**rules[patch["name"]].model_dump(), **patch})
    expanded = time.process_time() - t
    print(f"   {len(small):,} bytes, 100 jobs, expanded as before: {expanded:.2f} s CPU, peak allocation {_peak_mib():.1f} MiB "
          f"(x{expanded / refused:,.0f} the refusal of the file ten times its size)")


def simulations() -> None:
    from fastapi.testclient import TestClient

    from trainguard.protocol.rank_values import RankValues
    from trainguard.service.app import create_app
    from trainguard.service.config import Settings
    from trainguard.service.routes import rules as rules_routes
    from trainguard.service.routes.rules import MAX_RANK_REPORTS

    def body(world: int, reports: int) -> bytes:
        vectors = {name: {"fill": 1.0, "n": world} for name in RankValues.model_fields}
        return json.dumps({"world_size": world, "reports": [
            {"job": "test", "step_first": i, "step_last": i, "time": float(i), "values": {"trainguard_loss": 2.0},
             "ranks": vectors} for i in range(reports)]}).encode()

    print(f"4. POST /v1/rules/test at its limits (reports x world_size <= {MAX_RANK_REPORTS:,}; the built-in rules)")
    with tempfile.TemporaryDirectory() as d, TestClient(create_app(Settings(db=Path(d) / "tg.db"))) as c:
        for world in (32_768, 4_096, 2_048):
            most = min(MAX_RANK_REPORTS // world, 10_000)
            for reports in (most, most + 1):
                t = time.perf_counter()
                r = c.post("/v1/rules/test", content=body(world, reports), headers={"content-type": "application/json"})
                took = time.perf_counter() - t
                rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
                print(f"   world_size {world:>6,} x {reports:>6,} reports: {r.status_code} in {took:6.2f} s, "
                      f"peak RSS {rss:,.0f} MiB" + ("" if r.status_code == 200 else f"  ({r.json()['detail'][:60]}...)"))
        t = time.perf_counter()
        r = c.post("/v1/rules/test", content=body(1_000_000, 10), headers={"content-type": "application/json"})
        print(f"   world_size 1,000,000 x 10 reports: {r.status_code} in {time.perf_counter() - t:.3f} s "
              f"({r.json()['detail'][:70]}...)")
    # What the same request cost before these limits (any token with the read scope could send it).
    rules_routes.MAX_RANK_REPORTS = 10**12
    try:
        with tempfile.TemporaryDirectory() as d, TestClient(create_app(Settings(db=Path(d) / "tg.db",
                                                                              max_world_size=1_000_000))) as c:
            t = time.perf_counter()
            r = c.post("/v1/rules/test", content=body(1_000_000, 10), headers={"content-type": "application/json"})
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            print(f"   without the limits, world_size 1,000,000 x 10 reports ({len(body(1_000_000, 10)):,} bytes): "
                  f"{r.status_code} in {time.perf_counter() - t:.2f} s, peak RSS {rss:,.0f} MiB")
    finally:
        rules_routes.MAX_RANK_REPORTS = MAX_RANK_REPORTS


if __name__ == "__main__":
    main()
    simulations()
