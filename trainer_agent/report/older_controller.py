"""The run's registration for a controller older than the agent. The wire refuses fields it does
not know (``extra="forbid"``), so such a controller answers a registration that carries a newer
optional field with a 422 naming it (``extra_forbidden``); the agent then registers without its
optional fields (:data:`OPTIONAL_RANK_FIELDS`), and a controller as new as the agent never sees
that happen. Without the fields the run is monitored and controlled the same; the controller only
cannot name what they carried (the rank's node)."""

from __future__ import annotations

import json
from typing import Any

from trainguard.protocol.wire import RunRegistration
from trainer_agent.report.controller_link import Failures, Refused

__all__ = ["OPTIONAL_RANK_FIELDS", "unknown_rank_fields", "registration_for"]

#: Fields of ``RunRegistration.ranks[]`` an agent may leave out (each optional, None by default).
OPTIONAL_RANK_FIELDS = frozenset({"node"})


def unknown_rank_fields(status: int, content: bytes) -> frozenset[str] | None:
    """The optional rank fields a 422 answer refuses as unknown, when every error it lists is
    one of those (this controller's ``errors`` list, or FastAPI's own ``detail`` list); else None."""
    if status != 422:
        return None
    try:
        body = json.loads(content)
        errors: Any = body.get("errors") if isinstance(body.get("errors"), list) else body.get("detail")
        locs = [tuple(e["loc"]) for e in errors if e["type"] == "extra_forbidden"]
        if not errors or len(locs) != len(errors):
            return None
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    fields = frozenset(str(loc[-1]) for loc in locs if len(loc) == 4 and loc[:2] == ("body", "ranks"))
    return fields if len(fields) and fields <= OPTIONAL_RANK_FIELDS else None


def registration_for(registration: RunRegistration, refused: Refused, failures: Failures) -> RunRegistration:
    """``registration`` without the optional rank fields ``refused`` (a 422) names as unknown;
    raises ``refused`` when it is another refusal."""
    fields = unknown_rank_fields(refused.status, refused.content)
    if fields is None or not any(getattr(r, f) is not None for r in registration.ranks for f in fields):
        raise refused
    failures.note("older-controller", f"the controller does not know the registration's {', '.join(sorted(fields))} "
                  "(it is older than this agent): registering without it")
    return registration.model_copy(update={"ranks": [r.model_copy(update=dict.fromkeys(fields)) for r in registration.ranks]})
