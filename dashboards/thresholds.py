"""The stability thresholds as the controller's default rules (``service/default_rules.yaml``) state
them: the one source for the dashboards' threshold lines and the generated Prometheus rules, so
alerting in Prometheus and in the controller cannot drift apart."""

from __future__ import annotations

from typing import Any

from trainguard.service.rules import ADAPTIVE_FALLBACK_FACTOR, AdaptiveLrAction, LrScaleAction, default_rules_text, load_rules

__all__ = [
    "GRAD_NORM_LIMIT",
    "GRAD_NORM_RISE",
    "GRAD_NORM_SPIKE_RATIO",
    "GRAD_NORM_SPIKE_MIN_HISTORY",
    "LR_FACTOR",
    "DUPLICATE_RATIO_MAX",
    "TOKEN_KL_MAX",
    "SPECIAL_TOKEN_RATIO_MAX",
    "LENGTH_SHIFT_P_MIN",
    "STRAGGLER_RATIO",
    "INPUT_WAIT_MIN",
    "COMM_EXPOSED_RATIO_MAX",
    "DESYNC_REL_TOL",
    "ABSENCE",
]

_RULES: dict[str, Any] = {r.name: r for r in load_rules(default_rules_text()).base}


def _lr_factor(rule: Any) -> float:
    """The rule's LR factor; for ``adaptive_lr`` the factor it falls back to without a measurement
    (Prometheus cannot compute the adaptive scale: its alerts ask for that factor)."""
    (factor,) = {a.factor if isinstance(a, LrScaleAction) else ADAPTIVE_FALLBACK_FACTOR for a in rule.actions
                 if (isinstance(a, LrScaleAction) and a.factor is not None) or isinstance(a, AdaptiveLrAction)}
    return float(factor)


#: The stability guide, 6.1 checklist: gradient values should stay below 1e3 (rule ``grad_norm_high``).
GRAD_NORM_LIMIT = float(_RULES["grad_norm_high"].value)
#: A crossing of GRAD_NORM_LIMIT is a rise to this multiple of the norm's level (rule ``grad_norm_high``).
GRAD_NORM_RISE = float(_RULES["grad_norm_high"].crossing_rise)
#: Gradient-norm spike: the norm over its rolling median (rule ``grad_norm_spike``).
GRAD_NORM_SPIKE_RATIO = float(_RULES["grad_norm_spike"].ratio)
#: Earlier values a gradient-norm spike is judged against, at least (rule ``grad_norm_spike``).
GRAD_NORM_SPIKE_MIN_HISTORY = int(_RULES["grad_norm_spike"].min_history)
#: Factor an ``lr_scale`` action multiplies the run's current lr_scale by (both gradient rules).
LR_FACTOR = _lr_factor(_RULES["grad_norm_spike"])
assert LR_FACTOR == _lr_factor(_RULES["grad_norm_high"]), "the gradient rules disagree on the LR factor"
#: The stability guide, 3.1: duplicate text above 5% warns (rule ``data_duplicate_ratio``).
DUPLICATE_RATIO_MAX = float(_RULES["data_duplicate_ratio"].value)
#: The stability guide, 3.1: token-distribution KL divergence above 0.1 alerts (rule ``data_token_kl``).
TOKEN_KL_MAX = float(_RULES["data_token_kl"].value)
#: The stability guide, 3.1: control/special characters above 0.01% (rule ``data_special_token_ratio``).
SPECIAL_TOKEN_RATIO_MAX = float(_RULES["data_special_token_ratio"].value)
#: The stability guide, 3.1: length-distribution shift when the window test gives p < 0.05 (``data_length_shift``).
LENGTH_SHIFT_P_MIN = float(_RULES["data_length_shift"].value)
#: Straggler: a rank's time over the median of the other ranks' (the ratio of rule ``step_time_straggler``;
#: the Prometheus alert and the ranks dashboard apply it to the forward time).
STRAGGLER_RATIO = float(_RULES["step_time_straggler"].ratio)
#: Forward passes shorter than this (seconds) are not judged by the straggler rule: at that scale
#: scheduling alone can double one rank's forward (rule ``forward_time_straggler``).
FORWARD_MIN = float(_RULES["forward_time_straggler"].min_value)
#: A rank waiting for its batch at least this long per step (and well above the other ranks' median) is
#: held back by its data (rule ``input_wait_straggler``), seconds.
INPUT_WAIT_MIN = float(_RULES["input_wait_straggler"].min_value)
#: Share of the step a rank may wait for the gradient all-reduce after backward (rule ``comm_exposed``).
COMM_EXPOSED_RATIO_MAX = float(_RULES["comm_exposed"].value)
#: Relative difference across the replicas above which ranks disagree (rules ``grad_desync``, ``param_desync``).
DESYNC_REL_TOL = float(_RULES["grad_desync"].rel_tol)
assert DESYNC_REL_TOL == float(_RULES["param_desync"].rel_tol), "the desync rules disagree on the tolerance"
#: No progress for this long means the run is hung (rule ``run_silent``), as a PromQL duration.
_silent_s = int(_RULES["run_silent"].seconds)
ABSENCE = f"{_silent_s // 60}m" if _silent_s % 60 == 0 else f"{_silent_s}s"
