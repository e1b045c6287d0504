"""trainer_agent/control/run_reporter.py: the node a rank registers (``RankEndpoint.node``): from the
agent's setting, Kubernetes' NODE_NAME or SLURM's node name, else the host name; made into what the
wire takes, so that no host name can make the controller refuse the registration."""

from __future__ import annotations

import socket

import pytest

from trainguard.protocol.wire import RankEndpoint
from trainer_agent.control.run_reporter import node_name, rank_endpoints


@pytest.mark.parametrize("environ, expect", [
    ({"TRAINGUARD_NODE_NAME": "mine", "NODE_NAME": "k8s-node", "SLURMD_NODENAME": "slurm-7"}, "mine"),
    ({"TRAINGUARD_NODE_NAME": "  ", "NODE_NAME": "k8s-node", "SLURMD_NODENAME": "slurm-7"}, "k8s-node"),
    ({"SLURMD_NODENAME": "slurm-7"}, "slurm-7"),
    ({"NODE_NAME": "gke-pool 1/node#3"}, "gke-pool-1-node-3"),
    ({"NODE_NAME": "..-_node"}, "node"),
    ({"NODE_NAME": "ÿ" * 300}, None),  # nothing of it is a host name's
    ({"NODE_NAME": "n" * 300}, "n" * 253),
])
def test_the_node_name_comes_from_the_first_variable_set_and_is_what_the_wire_takes(environ, expect) -> None:
    got = node_name(environ)
    assert got == expect
    if got is not None:
        assert RankEndpoint(rank=0, local_rank=0, host="h", port=1, node=got).node == got


def test_without_a_variable_the_node_is_the_host_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: "worker 3.cluster")
    assert node_name({}) == "worker-3.cluster"

    def broken() -> str:
        raise OSError("no name")

    monkeypatch.setattr(socket, "gethostname", broken)
    assert node_name({}) is None


def test_a_single_rank_registers_its_endpoint_and_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINGUARD_NODE_NAME", "gpu-node-4")
    (endpoint,) = rank_endpoints("http://127.0.0.1:9400/metrics", 0, 1, None)
    assert endpoint == RankEndpoint(rank=0, local_rank=0, host="127.0.0.1", port=9400, node="gpu-node-4")
    assert rank_endpoints(None, 0, 1, None) == []  # no /metrics endpoint: not registered (nor its node)
