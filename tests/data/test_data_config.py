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


@pytest.mark.parametrize("kwargs, match", [
    ({"vocab_size": 1 << 40}, "vocab_size must be <= 4194304"),  # 24 TiB of tables: a MemoryError or the OOM killer
    ({"vocab_size": 100, "window": 10**9}, "window must be <= 16777216"),
    ({"vocab_size": 100, "shingle": 10**9}, "shingle must be <= 4096"),
    ({"vocab_size": 100, "length_reference": 10**12}, "length_reference must be <= 16777216"),
    ({"vocab_size": 100, "special_ids": "12"}, "collection of token ids"),  # not ids 1 and 2
    ({"vocab_size": 100, "special_ids": None}, "collection of token ids"),  # a TypeError
    ({"vocab_size": 100, "special_ids": [1.7]}, "integers"),  # read as id 1
    ({"vocab_size": 100, "pad_id": 1.5}, "pad_id"),  # no padding at all
    ({"vocab_size": 100, "kl_epsilon": "1e-6"}, "kl_epsilon"),  # a TypeError
])
def test_settings_of_the_wrong_kind_or_size_are_value_errors(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        DataMonitor(**kwargs)


def test_the_largest_settings_and_arrays_of_special_ids_are_taken() -> None:
    m = DataMonitor(1 << 22, special_ids=torch.tensor([0, 5]), pad_id=-100)
    assert m.config.special_ids == (0, 5)
    m.observe_batch(torch.tensor([[0, 1, -100]]))
    assert m.values()["trainguard_data_special_token_ratio"] == 0.5
    assert DataMonitor(10, special_ids=np.array([3])).config.special_ids == (3,)


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
