"""Bad argument types give ValueError (the library's contract), not TypeError."""

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

import trainer_agent as ta
from trainer_agent.data import DataMonitor


@pytest.mark.parametrize("kwargs", [{"vocab_size": 10.5}, {"vocab_size": "100"}, {"vocab_size": True},
                                    {"vocab_size": 100, "window": 2.0}])
def test_non_integer_sizes_are_value_errors(kwargs) -> None:
    with pytest.raises(ValueError, match="must be an integer"):
        DataMonitor(**kwargs)


def test_numpy_integers_are_integers() -> None:
    m = DataMonitor(np.int64(16), window=np.int32(8))
    m.observe_batch(torch.tensor([[1, 2, 3]]))
    assert m.values()["trainguard_data_sequences_total"] == 1


def test_a_metrics_port_past_65535_is_a_value_error(monkeypatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "7")
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="65535"):
        ta.attach(model, opt, job="j", run="r", registry=CollectorRegistry(),
                  config=ta.AgentConfig(metrics_port=65530))
