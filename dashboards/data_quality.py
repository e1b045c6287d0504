"""Dashboard 2, data quality: what the model is being fed. The four data signals with their alert
thresholds drawn as red lines, throughput in tokens/s, the QualityFilter's kept/dropped samples,
how long each rank waits for its batches, and the batch size the gradient noise scale recommends.
"""

from __future__ import annotations

from grafanalib.core import Dashboard

from trainguard.dashboards.common import JOB_RUN, SEL, Band, Section, dashboard, job_level, query, right_axis, timeseries
from trainguard.dashboards.thresholds import (
    DUPLICATE_RATIO_MAX,
    INPUT_WAIT_MIN,
    LENGTH_SHIFT_P_MIN,
    SPECIAL_TOKEN_RATIO_MAX,
    TOKEN_KL_MAX,
)

UID = "trainguard-data-quality"
TITLE = "trainguard / Data quality"



def _above(limit: float) -> Band:
    """A red line at the limit."""
    return Band(((limit, "red"),))


def _signals() -> Section:
    return Section("Data signals (alert thresholds in red)", [
        timeseries(
            "Duplicate ratio",
            f"Share of sequences in the sliding window already seen in it: exact content and "
            f"MinHash near-duplicates. Alert above {DUPLICATE_RATIO_MAX:g}.",
            [
                query(f"trainguard_data_duplicate_ratio{{{SEL}}}", "exact, rank {{rank}} ({{run}})"),
                query(f"trainguard_data_near_duplicate_ratio{{{SEL}}}", "near, rank {{rank}} ({{run}})"),
            ],
            unit="percentunit", band=_above(DUPLICATE_RATIO_MAX),
        ),
        timeseries(
            "Token distribution KL divergence",
            f"KL(current window || reference) of the unigram token distribution, in nats. "
            f"Alert above {TOKEN_KL_MAX:g}.",
            [query(f"trainguard_data_token_kl_divergence{{{SEL}}}", "rank {{rank}} ({{run}})")],
            band=_above(TOKEN_KL_MAX),
        ),
        timeseries(
            "Special / control token ratio",
            f"Share of tokens that are control, special or unknown ids. Alert above "
            f"{SPECIAL_TOKEN_RATIO_MAX:g} (0.01%).",
            [query(f"trainguard_data_special_token_ratio{{{SEL}}}", "rank {{rank}} ({{run}})")],
            unit="percentunit", band=_above(SPECIAL_TOKEN_RATIO_MAX),
        ),
        timeseries(
            "Length distribution shift (KS p-value)",
            f"Two-sample Kolmogorov-Smirnov p-value between the sequence lengths of the "
            f"reference and the current window (log axis). Alert below {LENGTH_SHIFT_P_MIN:g}.",
            [query(f"trainguard_data_length_shift_pvalue{{{SEL}}}", "rank {{rank}} ({{run}})")],
            log=True, band=Band(((LENGTH_SHIFT_P_MIN, "transparent"),), base="red"),
        ),
    ])


def _throughput() -> Section:
    return Section("Throughput and filtering", [
        timeseries(
            "Tokens per second",
            "Training throughput: tokens passed to end_step per second of step time, per rank, "
            "and the job's total (sum over ranks).",
            [
                query(f"trainguard_tokens_per_second{{{SEL}}}", "rank {{rank}} ({{run}})"),
                query(f"trainguard:tokens_per_second:sum{{{JOB_RUN}}}", "total {{run}}"),
            ],
            unit="short",
        ),
        timeseries(
            "Tokens and sequences observed",
            "Non-padding tokens and sequences the data monitor observed per second.",
            [
                query(f"rate(trainguard_data_tokens_total{{{SEL}}}[$__rate_interval])",
                      "tokens/s, rank {{rank}} ({{run}})"),
                query(f"rate(trainguard_data_sequences_total{{{SEL}}}[$__rate_interval])",
                      "sequences/s, rank {{rank}} ({{run}})"),
            ],
        ),
        timeseries(
            "Filtered samples",
            "Samples per second the QualityFilter kept and dropped, summed over ranks.",
            [query(f"sum by (run, decision) "
                   f"(rate(trainguard_data_filtered_total{{{SEL}}}[$__rate_interval]))",
                   "{{decision}} ({{run}})")],
            draw="bars",
        ),
        timeseries(
            "Dropped share",
            "Share of the samples the QualityFilter dropped over the interval.",
            [query(f"sum by (run) (rate(trainguard_data_filtered_total{{{SEL}, decision=\"dropped\"}}"
                   f"[$__rate_interval])) / sum by (run) "
                   f"(rate(trainguard_data_filtered_total{{{SEL}}}[$__rate_interval]))",
                   "{{run}}")],
            unit="percentunit",
        ),
    ])


def _feeding() -> Section:
    return Section("Input pipeline and batch size", [
        timeseries(
            "Input wait per step",
            "Mean time per step each rank waited for its batch (from the end of one step to the "
            "next forward pass). One rank far above the others is held back by its data, not its "
            f"computation; the rule fires from {INPUT_WAIT_MIN * 1e3:g} ms (red line).",
            [query(f"trainguard_input_wait_seconds{{{SEL}}}", "rank {{rank}} ({{run}})")],
            unit="s", band=_above(INPUT_WAIT_MIN),
        ),
        timeseries(
            "Token loader",
            "Batches the token loader holds ready ahead of the loop (left; 0 = the loop waits) "
            "and tokens per second it delivered (right). Only with trainguard's TokenLoader.",
            [
                query(f"trainguard_input_prefetch_depth{{{SEL}}}", "ready, rank {{rank}} ({{run}})"),
                query(f"trainguard_input_tokens_per_second{{{SEL}}}", "tokens/s, rank {{rank}} ({{run}})"),
            ],
            overrides=[right_axis("tokens/s.*")],
        ),
        timeseries(
            "Batch size: current and recommended",
            "The global batch size of the step and the one the gradient noise scale recommends "
            "(its running estimate, McCandlish et al. 2018), in tokens (or micro-batches when "
            "end_step gets no token count). Recommended well above current: larger batches would "
            "still speed training up per step; well below: the extra batch is mostly wasted.",
            [
                query(job_level("trainguard_global_batch_size"), "current ({{run}})"),
                query(job_level("trainguard_recommended_batch_size"), "recommended ({{run}})"),
            ],
            log=True,
        ),
    ])


def build() -> Dashboard:
    return dashboard(
        uid=UID,
        title=TITLE,
        description=" ".join(__doc__.split()),
        tags=["data"],
        sections=[_signals(), _throughput(), _feeding()],
    )
