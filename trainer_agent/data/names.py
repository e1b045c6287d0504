"""Metric names of the data monitor, checked against the catalogue."""

from __future__ import annotations

from trainguard.protocol.catalog import DATA_METRICS

DUPLICATE_RATIO = "trainguard_data_duplicate_ratio"
NEAR_DUPLICATE_RATIO = "trainguard_data_near_duplicate_ratio"
TOKEN_KL = "trainguard_data_token_kl_divergence"
SPECIAL_RATIO = "trainguard_data_special_token_ratio"
LENGTH_PVALUE = "trainguard_data_length_shift_pvalue"
TOKENS_TOTAL = "trainguard_data_tokens_total"
SEQUENCES_TOTAL = "trainguard_data_sequences_total"
FILTERED_TOTAL = "trainguard_data_filtered_total"
assert {m.name for m in DATA_METRICS} == {
    DUPLICATE_RATIO, NEAR_DUPLICATE_RATIO, TOKEN_KL, SPECIAL_RATIO, LENGTH_PVALUE,
    TOKENS_TOTAL, SEQUENCES_TOTAL, FILTERED_TOTAL,
}, "trainer_agent.data is out of step with the catalogue"
