"""The only places the agent touches a library's private members: one adapter module per library.

- :mod:`trainer_agent.compat.torch_private`: torch (the autograd engine's end-of-backward queue,
  tensor hook dicts and version counters, ``GradScaler``'s scale tensor, DTensor's local shard,
  the default process group's timeout, pytree and dispatch modes, state-dict metadata, the fused
  ``torch._foreach_*`` list ops).
- :mod:`trainer_agent.compat.httpx_private`: httpx and the httpcore pool it wraps (the network
  backend of an ``HTTPTransport``, so that closing the client cuts a pending request).

Each adapter function says what it reaches into, why no public API does it in the pinned version,
and what it does when the member is gone: it *degrades* (a documented slower or coarser path, logged
once through :func:`degraded` and listed in :data:`DEGRADED`) or, where nothing can stand in, raises
:class:`PrivateMemberMissing`, which the agent counts as its own error (it never reaches the training
loop). Each module lists its members in ``PRIVATE_MEMBERS`` with the test that fails when the member
changes (``tests/agent/test_<module>.py``) and the versions they were checked against in
``CHECKED_VERSIONS``; ``tests/architecture/test_private_members.py`` fails on a private member used
anywhere else, on a member missing from a table, and when a pinned version moves past the checked
one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

__all__ = ["DEGRADED", "PrivateMember", "PrivateMemberMissing", "degraded"]

log = logging.getLogger(__name__)

#: Private member -> what the agent does without it, for each one found missing or changed in this
#: process (each is logged once).
DEGRADED: dict[str, str] = {}


@dataclass(frozen=True, slots=True)
class PrivateMember:
    """One private member an adapter reaches: ``path`` as the code reaches it, ``name`` the private
    attribute (or module) as written, ``adapter`` the function that uses it, ``test`` the test in
    ``tests/agent/test_<adapter module>.py`` that fails when it is gone or changes shape."""

    path: str
    name: str
    adapter: str
    test: str


class PrivateMemberMissing(RuntimeError):
    """A private library member the agent needs, with no stand-in, is gone or has changed shape."""


def degraded(member: str, consequence: str) -> None:
    """Record (and log once) that ``member`` is missing or changed, and what the agent does instead."""
    if member not in DEGRADED:
        DEGRADED[member] = consequence
        log.warning("trainguard: %s is missing or changed in the installed version: %s", member, consequence)
