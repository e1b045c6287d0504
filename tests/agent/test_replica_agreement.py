"""The leader's agreement gauges from a report's per-rank fingerprint comparison."""

from __future__ import annotations

import math

from trainer_agent.report.replica_agreement import agreement_gauges

NAMES = ["embed", "layers.0", "layers.1"]


def test_the_largest_difference_and_the_rank_and_layer_holding_it() -> None:
    vectors = {"grad_desync": [0.0, 3e-4, 2e-3, 0.0], "grad_desync_layer": [0.0, 1.0, 2.0, 0.0],
               "param_desync": [0.0, 0.0, 0.0, 0.0], "param_desync_layer": [0.0, 0.0, 0.0, 0.0]}
    assert agreement_gauges(vectors, NAMES) == {
        "trainguard_grad_desync_rel_diff": 2e-3, 'trainguard_grad_desync_rank{worst_layer="layers.1"}': 2.0,
        # in agreement: 0, and no rank named
        "trainguard_param_desync_rel_diff": 0.0}


def test_no_comparison_gives_no_gauge() -> None:
    # one rank, a report sent without its cross-rank comparisons, or a failed vector
    assert agreement_gauges({}, NAMES) == {}
    assert agreement_gauges({"grad_desync": [], "param_desync": []}, NAMES) == {}


def test_ranks_without_a_verdict_are_left_out_and_inf_survives() -> None:
    vectors = {"grad_desync": [math.nan, 1e-6, math.inf], "grad_desync_layer": [math.nan, 0.0, 1.0],
               "param_desync": [math.nan, math.nan, math.nan], "param_desync_layer": [math.nan] * 3}
    gauges = agreement_gauges(vectors, NAMES)
    assert gauges["trainguard_grad_desync_rel_diff"] == math.inf
    assert gauges['trainguard_grad_desync_rank{worst_layer="layers.0"}'] == 2.0
    # no rank could be judged: NaN, not 0, and no rank named
    assert math.isnan(gauges.pop("trainguard_param_desync_rel_diff"))
    assert set(gauges) == {"trainguard_grad_desync_rel_diff", 'trainguard_grad_desync_rank{worst_layer="layers.0"}'}


def test_a_screen_only_comparison_names_the_rank_without_a_layer() -> None:
    # the whole-model screens differed below the detail threshold: no layer was compared
    vectors = {"param_desync": [0.0, 4e-7], "param_desync_layer": [math.nan, math.nan]}
    assert agreement_gauges(vectors, NAMES) == {"trainguard_param_desync_rel_diff": 4e-7,
                                                'trainguard_param_desync_rank{worst_layer=""}': 1.0}
