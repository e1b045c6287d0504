"""A value the agent reports that the metric catalogue does not know (here: a loader's misspelt
metric, the documented extension point ``watch_loader``) counts as one agent error with its name,
logged once, however often it is reported and scraped again; it is neither exported nor does the
check ever raise into the training loop. Values the agent itself reports are all known."""

from __future__ import annotations

import logging

import torch
from prometheus_client import CollectorRegistry
from torch import nn

import trainer_agent as ta
from trainer_agent.report.exporter import UnknownValues, catalogue_problem

BASE = {"job": "j", "run": "r", "rank": "0"}


class MisspeltLoader:
    """A loader of its own whose values() names a metric one letter off the catalogue's."""

    def values(self) -> dict[str, float]:
        return {"trainguard_input_prefetch_dept": 3.0, "trainguard_input_prefetch_depth": 3.0}


def _train(agent: ta.Agent, model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        loss = model(torch.randn(4, 3)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        agent.end_step(loss)


def test_an_unknown_value_counts_once_with_its_name_and_is_not_exported(caplog) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    registry = CollectorRegistry()
    agent = ta.attach(model, opt, job="j", run="r", registry=registry,
                      config=ta.AgentConfig(metrics_port=None, report_every=2))
    try:
        _train(agent, model, opt, 4)
        assert agent.latest()["trainguard_agent_errors_total"] == 0  # the agent's own values are all known
        with caplog.at_level(logging.WARNING, logger="trainer_agent"):
            agent.watch_loader(MisspeltLoader())
            _train(agent, model, opt, 4)
            for _ in range(3):
                assert agent.latest()["trainguard_agent_errors_total"] == 1
                assert registry.get_sample_value("trainguard_agent_errors_total", BASE) == 1
        assert registry.get_sample_value("trainguard_input_prefetch_dept", BASE) is None
        assert registry.get_sample_value("trainguard_input_prefetch_depth", BASE) == 3.0
        named = [r for r in caplog.records if "trainguard_input_prefetch_dept" in r.getMessage()]
        assert len(named) == 1
        assert named[0].getMessage().startswith("trainguard agent: reporting trainguard_input_prefetch_dept "
                                                "(not in the catalogue) failed; training goes on")
        assert str(named[0].exc_info[1]) == (
            "the agent reports 'trainguard_input_prefetch_dept', which the metric catalogue "
            "(trainguard.protocol.catalog) does not list (did you mean trainguard_input_prefetch_depth?): "
            "it is neither exported nor sent to the controller")
    finally:
        agent.close()


def test_each_unknown_name_is_one_error_labels_included() -> None:
    errors: list[tuple[str, str]] = []
    check = UnknownValues(lambda kind, exc: errors.append((kind, str(exc))))
    values = {"trainguard_loss": 1.0, 'trainguard_learning_rate{group="0"}': 0.1,  # known
              'trainguard_custom{a="1"}': 1.0, 'trainguard_custom{a="2"}': 2.0,  # one unknown name
              'trainguard_learning_rate{grp="0"}': 0.1,  # a known metric with a label it does not take
              "not a key{": 0.0}
    assert check.check(values) == 3 and check.check(values) == 0 and check.check({"trainguard_custom": 1.0}) == 0
    assert [kind for kind, _ in errors] == [
        "reporting not a key{ (not in the catalogue)", "reporting trainguard_custom (not in the catalogue)",
        "reporting trainguard_learning_rate{grp} (not in the catalogue)"]
    assert errors[2][1] == ("the agent reports 'trainguard_learning_rate{grp=\"0\"}', but trainguard_learning_rate "
                            "takes the labels group: it is neither exported nor sent")
    assert catalogue_problem('trainguard_learning_rate{group="3"}') is None


def test_the_check_stops_past_its_memory_bound() -> None:
    errors: list[str] = []
    check = UnknownValues(lambda kind, exc: errors.append(kind))
    check.MAX_REMEMBERED = 4
    assert check.check({f"trainguard_x{i}": 0.0 for i in range(4)}) == 4
    assert check.check({"trainguard_y": 0.0}) == 0 and len(errors) == 4
