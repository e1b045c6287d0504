"""Whether a desync finding (rule diagnosis ``grad_desync`` / ``param_desync``) shows a layout
rather than a faulty device, for the cause verdict (``service/cause.py``).

The agent compares each rank's fingerprints with the middle values of its ranks, so one faulty
device among three or more ranks is one rank that disagrees. When more than half the ranks of a
job of three or more disagree, no majority holds the values a fault would have changed: the ranks
hold different values by design (post-local SGD between its averaging steps, FSDP1's rank-local
shards, per-rank expert layers held as plain tensors). Draining nodes or pausing the run would not
help; the verdict counts such a finding as evidence of nothing (``none``). With two ranks nothing
tells one case from the other: both ranks are named either way, and the finding stays hardware
evidence.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LAYOUT_HINT", "layout_desync"]

#: What the verdict's detail suggests for a desync of most ranks.
LAYOUT_HINT = ("ranks that hold different values by design (post-local SGD, FSDP1 shards, per-rank expert layers), "
               "not a faulty device: declare such parameters with AgentConfig(rank_local_params=(...)) or turn the "
               "comparison off with AgentConfig(fingerprint=False)")


def layout_desync(finding: Any) -> str | None:
    """The verdict's detail when ``finding``, of a desync rule, names more than half the judged ranks of a
    job of three or more (a layout, see the module docstring), else None (the finding counts both:
    ``service/evaluate_ranks.py``, ``desync``)."""
    if getattr(finding.rule, "diagnosis", "") not in ("grad_desync", "param_desync"):
        return None
    differing, ranks = finding.values.get("differing"), finding.values.get("judged")
    if not isinstance(differing, int) or not isinstance(ranks, int) or ranks < 3 or 2 * differing <= ranks:
        return None
    return f"{differing} of {ranks} ranks disagree on {finding.values.get('vector')}: {LAYOUT_HINT}"
