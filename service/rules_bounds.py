"""The bounds of a rules file: its size limits and the checks that refuse a file beyond them
before any of it is validated (YAML aliases expanded on the node graph, then the counts of rules,
jobs and overrides)."""

from __future__ import annotations

from typing import Any

import yaml

from trainguard.service.rule_schema import RulesError

__all__ = ["MAX_ACTIONS", "MAX_JOBS", "MAX_NODES", "MAX_OVERRIDES", "MAX_RULES", "check_counts", "parse_bounded"]

#: Limits of a rules file. Validation takes time in proportion to these, so a file within them is
#: validated in well under a second; beyond them it is refused with the limit named. They bound
#: the file *after* YAML aliases are expanded (``&anchor`` / ``*alias``): a 16 KB file whose
#: aliases multiply through jobs, overrides and actions is refused before it is validated.
MAX_RULES = 1000
MAX_ACTIONS = 16  # per rule
MAX_JOBS = 1000  # jobs with overrides
MAX_OVERRIDES = 10_000  # overrides over all jobs
MAX_NODES = 200_000  # YAML nodes (mappings, lists, scalars, keys included) with every alias expanded


def parse_bounded(text: str | bytes) -> Any:
    """The YAML (or JSON) document, refused when it holds more than :data:`MAX_NODES` nodes with
    its aliases expanded (counted on the composed node graph, before any object is built)."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        expanded = _expanded_nodes(node)
        if expanded > MAX_NODES:
            raise RulesError([f"the rules file holds more than {MAX_NODES:,} YAML nodes once its aliases are expanded "
                              f"(the limit of a rules file); write the rules out without multiplying aliases"])
        return loader.construct_document(node)
    finally:
        loader.dispose()


_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _expanded_nodes(root: yaml.Node) -> int:
    """How many nodes ``root`` has when every alias is written out, counting stops past
    :data:`MAX_NODES` (iterative and memoised: linear in the distinct nodes; a node that holds
    itself counts as too many)."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()
    todo: list[tuple[yaml.Node, bool]] = [(root, False)]
    while todo:
        node, done = todo.pop()
        key = id(node)
        if done:
            children = _children(node)
            sizes[key] = min(1 + sum(sizes[id(c)] for c in children), MAX_NODES + 1)
            open_.discard(key)
            continue
        if key in sizes:
            continue
        if key in open_:
            return MAX_NODES + 1  # an alias to one of its own ancestors: infinitely large
        open_.add(key)
        todo.append((node, True))
        todo.extend((c, False) for c in _children(node) if id(c) not in sizes)
    return sizes[id(root)]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return node.value
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def check_counts(data: dict[str, Any]) -> None:
    """Refuse more rules, jobs or overrides than the limits before any of them is validated."""
    reasons = []
    rules, jobs = data.get("rules"), data.get("jobs")
    if isinstance(rules, list) and len(rules) > MAX_RULES:
        reasons.append(f"rules: {len(rules):,} rules; a rules file holds at most {MAX_RULES:,}")
    if isinstance(jobs, dict):
        if len(jobs) > MAX_JOBS:
            reasons.append(f"jobs: overrides for {len(jobs):,} jobs; a rules file holds at most {MAX_JOBS:,}")
        overrides = sum(len(p) for p in jobs.values() if isinstance(p, list))
        if overrides > MAX_OVERRIDES:
            reasons.append(f"jobs: {overrides:,} overrides in all; a rules file holds at most {MAX_OVERRIDES:,}")
    if reasons:
        raise RulesError(reasons)
