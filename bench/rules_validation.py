"""What a rules file costs to validate, and what the limits refuse (issue 22, points 4 and 5).

Prints, side by side:

1. ``load_rules`` on files of 250, 500 and 1,000 rules (``MAX_RULES``): seconds and the ratio to
   the file half its size (linear: about 2).
2. The duplicate-name check alone on 12,000 names, as it was (``names.count`` per name: quadratic)
   and as it is (one ``Counter``).
3. An alias bomb of ~12 KB (jobs x overrides x actions): ``load_rules`` refusing it before anything
   is built, against building its expansion (``yaml.safe_load`` and validating every job's overrides,
   what the loader did before the node limit), with the peak Python allocation of each (tracemalloc).

Run: ``.venv/bin/python bench/rules_validation.py`` (about 30 s; the bomb's expansion is measured
on 100 jobs, a tenth of the refused file, so the comparison stays short).
"""

from __future__ import annotations

import time
import tracemalloc
from collections import Counter

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


if __name__ == "__main__":
    main()
