"""trainer_agent/compat/torch_collectives.py: the all-gather under the name this torch has."""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainer_agent.compat.torch_collectives import all_gather_single


def test_torch_2_13_s_name_where_it_exists_else_the_older_one(monkeypatch) -> None:
    """On torch 2.13 ``all_gather_single`` (its older name warns there on every call); on 2.12 and
    older, which lack it, ``all_gather_into_tensor`` (the agent's reports of several ranks once
    failed there with an AttributeError)."""
    calls = []
    out, src = torch.empty(4), torch.ones(2)
    monkeypatch.setattr(dist, "all_gather_single", lambda *a, **k: calls.append(("single", a, k)), raising=False)
    monkeypatch.setattr(dist, "all_gather_into_tensor", lambda *a, **k: calls.append(("into_tensor", a, k)))
    all_gather_single(out, src, group="g")
    monkeypatch.delattr(dist, "all_gather_single")
    all_gather_single(out, src)
    assert [(name, a[0] is out and a[1] is src, k) for name, a, k in calls] == [
        ("single", True, {"group": "g"}), ("into_tensor", True, {"group": None})]
