"""service/rank_nodes.py: the nodes of the ranks a finding names, from the run's registration."""

from __future__ import annotations

from trainguard.service.rank_nodes import nodes_text, rank_nodes, rank_places, with_nodes

RANKS = [{"rank": 0, "local_rank": 0, "host": "127.0.0.1", "port": 9400, "node": "gpu-a"},
         {"rank": 1, "local_rank": 1, "host": "127.0.0.1", "port": 9401, "node": "gpu-a"},
         {"rank": 2, "local_rank": 0, "host": "10.0.0.3", "port": 9400},  # an older agent: no node
         {"rank": 3, "local_rank": 1, "host": "127.0.0.1", "port": 9401, "node": "gpu-b"}]


def test_the_node_else_the_host_of_each_rank() -> None:
    assert rank_nodes(RANKS) == {0: "gpu-a", 1: "gpu-a", 3: "gpu-b"}
    assert rank_places(RANKS) == {0: "gpu-a", 1: "gpu-a", 2: "10.0.0.3", 3: "gpu-b"}
    assert rank_nodes(()) == {} and rank_places(()) == {}


def test_ranks_are_grouped_by_node_and_bounded() -> None:
    nodes = rank_nodes(RANKS)
    assert nodes_text([3], nodes) == "rank 3 on node gpu-b"
    assert nodes_text([0, 1, 2, 3], nodes) == "ranks 0, 1 on node gpu-a; rank 3 on node gpu-b"
    assert nodes_text([2], nodes) == ""
    many = {r: f"n{r // 10}" for r in range(200)}
    text = nodes_text(list(range(200)), many)
    assert text.startswith("ranks 0, 1, 2, 3, 4, 5, 6, 7 and 2 more on node n0; ") and text.endswith("and 12 more nodes")
    assert text.count("; ") == 7


def test_an_alert_s_text_and_values_gain_the_nodes_of_its_ranks() -> None:
    nodes = rank_nodes(RANKS)
    values = {"rank": 3, "ratio": 2.0}
    summary, out = with_nodes("rank 3 is slow", values, nodes)
    assert (summary, out) == ("rank 3 is slow (rank 3 on node gpu-b)", {"rank": 3, "ratio": 2.0, "nodes": {3: "gpu-b"}})
    assert values == {"rank": 3, "ratio": 2.0}  # the finding's own values are left as they are
    summary, out = with_nodes("ranks differ", {"ranks": [0, 2, 3], "rank": 0}, nodes)
    assert summary == "ranks differ (rank 0 on node gpu-a; rank 3 on node gpu-b)" and out["nodes"] == {0: "gpu-a", 3: "gpu-b"}
    for unnamed in ({"value": 3.0}, {"ranks": [2]}, {"rank": True}, {"ranks": "all"}):
        assert with_nodes("x", unnamed, nodes) == ("x", unnamed)
