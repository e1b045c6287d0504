"""The nodes of a run's ranks, from its registration (``RankEndpoint.node``), named where the
controller names ranks: the suspects of a hardware incident, and the alerts whose findings name
ranks (a straggler, ranks that disagree, a GPU's XID error). The registered ``host`` is where
Prometheus scrapes the rank (the agent's default is 127.0.0.1 on every node), so a rank registered
without a node (an agent older than the field) is named by its host, as before."""

from __future__ import annotations

from typing import Any

__all__ = ["listed", "rank_nodes", "rank_places", "nodes_text", "with_nodes"]

#: Ranks and nodes named in one alert's text (the rest counted).
_SHOWN = 8


def rank_nodes(ranks: list[dict[str, Any]] | tuple[()]) -> dict[int, str]:
    """Rank -> node, for the registered ranks that named theirs."""
    return {int(r["rank"]): str(r["node"]) for r in ranks if r.get("node")}


def rank_places(ranks: list[dict[str, Any]] | tuple[()]) -> dict[int, str]:
    """Rank -> its node, else its registered host (what a hardware verdict's ``hosts`` name)."""
    return {int(r["rank"]): str(r["host"]) for r in ranks} | rank_nodes(ranks)


def listed(items: list[Any], shown: int = _SHOWN) -> str:
    """``items`` joined with commas, the first ``shown`` of them and the rest counted: ``1, 2 and 3 more``."""
    return ", ".join(map(str, items[:shown])) + (f" and {len(items) - shown} more" if len(items) > shown else "")


def _ranks_text(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {listed(ranks)}"


def nodes_text(named: list[int], nodes: dict[int, str]) -> str:
    """Where ``named`` ranks run, e.g. ``rank 3 on node gpu-7`` or ``ranks 4, 5 on node gpu-b; rank 6
    on node gpu-c``; '' when no node of theirs is known."""
    by_node: dict[str, list[int]] = {}
    for r in named:
        if r in nodes:
            by_node.setdefault(nodes[r], []).append(r)
    if not by_node:
        return ""
    parts = [f"{_ranks_text(found)} on node {node}" for node, found in list(by_node.items())[:_SHOWN]]
    more = f" and {len(by_node) - _SHOWN} more nodes" if len(by_node) > _SHOWN else ""
    return "; ".join(parts) + more


def with_nodes(summary: str, values: dict[str, Any], nodes: dict[int, str]) -> tuple[str, dict[str, Any]]:
    """An alert's ``summary`` and ``values`` with the nodes of the ranks its finding names (its
    ``ranks``, else its ``rank``) added: the text in parentheses, ``values["nodes"]`` rank -> node.
    Unchanged when the finding names no rank or none of its ranks' nodes is known."""
    named = values.get("ranks")
    if not isinstance(named, list):
        named = [values.get("rank")]
    named = [r for r in named if type(r) is int]  # (not a bool)
    text = nodes_text(named, nodes)
    if not text:
        return summary, values
    return f"{summary} ({text})", {**values, "nodes": {r: nodes[r] for r in named if r in nodes}}
