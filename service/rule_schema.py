"""What every model of a rules file shares: the frozen model base, the names a rule may read or
carry, and the error that lists a file's problems (the models themselves are :mod:`service.rule_kinds`,
:mod:`service.rule_actions` and :mod:`service.recovery_policy`)."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, StringConstraints

from trainguard.service.rule_names import known_metric, known_vector

__all__ = ["MetricName", "RuleName", "RulesError", "RulesModel", "Vector"]

#: A report value a rule reads; with ``check_names`` one no report carries is refused (``service/rule_names.py``).
MetricName = Annotated[str, StringConstraints(pattern=r"^[a-zA-Z_:][a-zA-Z0-9_:]*$"), AfterValidator(known_metric)]
RuleName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]
#: A per-rank vector a rule reads (``trainguard.protocol.rank_values.RULE_VECTORS``; any other is refused).
Vector = Annotated[str, AfterValidator(known_vector)]


class RulesError(ValueError):
    """A rules file that does not validate; ``reasons`` lists every problem."""

    def __init__(self, reasons: list[str]) -> None:
        super().__init__("invalid rules: " + "; ".join(reasons))
        self.reasons = reasons


class RulesModel(BaseModel):
    """A model of a rules file: unknown fields refused, frozen once validated."""

    model_config = ConfigDict(extra="forbid", frozen=True)
