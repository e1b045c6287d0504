"""Prometheus series the training ranks' /metrics serve, per rank and per job, counted from the
metric catalogue (``trainguard.protocol.catalog.series_per_rank`` / ``series_per_job``; the test
``tests/agent/test_agent_exporter.py`` checks the count against what real exporters serve).

    .venv/bin/python bench/series_count.py [--param-groups 1]

Every catalogued metric counted as present (GPU health, the data monitor, the token loader, the
communication timing, a GradScaler, snapshots, the controller): an upper bound. Side by side:
a copy of the job-level values on every rank (``AgentConfig(job_metrics="all")``, what every rank
served before the catalogue had scopes) and the default (rank 0 alone serves them), for W ranks,
L layers and ``per_layer`` "rank0" (default) or "all"; the share of the copies' series that were
copies of rank 0's, and the ratio of the two.
"""

from __future__ import annotations

import argparse

from trainguard.protocol.catalog import series_per_job, series_per_rank

RANKS = (8, 512, 4096, 32768)
LAYERS = (15, 131)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--param-groups", type=int, default=1, help="optimizer param groups (LR series)")
    args = parser.parse_args()
    groups = args.param_groups
    own = series_per_rank(1, layers=0, param_groups=groups)
    job = series_per_rank(0, layers=0, param_groups=groups) - own
    print(f"each rank's own values: {own} series; the job's: {job}; per layer: "
          f"{series_per_rank(0, layers=1, param_groups=groups) - own - job} (param groups: {groups})")
    header = (f"{'ranks':>7} {'layers':>6} {'per_layer':>9} | {'copies: other rank':>18} {'per job':>11} | "
              f"{'now: other rank':>15} {'per job':>11} | {'copies share':>12} {'ratio':>7}")
    print(header)
    print("-" * len(header))
    for world in RANKS:
        for layers in LAYERS:
            for per_layer in ("rank0", "all"):
                kw = dict(layers=layers, param_groups=groups, per_layer=per_layer)
                before_rank, before_job = series_per_rank(1, job_metrics="all", **kw), series_per_job(world, job_metrics="all", **kw)
                now_rank, now_job = series_per_rank(1, **kw), series_per_job(world, **kw)
                # Every series of a rank other than 0 that is not of its own values repeats rank 0's.
                copies = (world - 1) * (before_rank - own)
                print(f"{world:>7,} {layers:>6} {per_layer:>9} | {before_rank:>18,} {before_job:>11,} | "
                      f"{now_rank:>15,} {now_job:>11,} | {copies / before_job:>11.1%} {before_job / now_job:>6.2f}x")


if __name__ == "__main__":
    main()
