"""Every private member of httpx (and of the httpcore pool inside it) the agent uses; nothing else
in the agent touches one (``tests/architecture/test_private_members.py``).

httpcore is httpx's own connection layer (same maintainers, pinned together): ``HTTPTransport``
keeps an ``httpcore.ConnectionPool`` in ``_pool``. Checked against :data:`CHECKED_VERSIONS`; the
test of each member is named in :data:`PRIVATE_MEMBERS` (``tests/agent/test_httpx_private.py``).
"""

from __future__ import annotations

import httpcore
import httpx

from trainer_agent.compat import PrivateMember, degraded

__all__ = ["CHECKED_VERSIONS", "PRIVATE_MEMBERS", "install_network_backend"]

#: The releases the members below were checked against (their tests passed on them); a pin in
#: constraints.txt past these fails tests/architecture/test_private_members.py until the tests are
#: run on the new release and this is updated.
CHECKED_VERSIONS = {"httpx": "0.28.1", "httpcore": "1.0.9"}

PRIVATE_MEMBERS = (
    PrivateMember("httpx.HTTPTransport._pool", "_pool", "install_network_backend",
                  "test_installed_backend_makes_the_connections_and_abort_ends_a_pending_request"),
    PrivateMember("httpcore.ConnectionPool._network_backend", "_network_backend", "install_network_backend",
                  "test_installed_backend_makes_the_connections_and_abort_ends_a_pending_request"),
)


def install_network_backend(transport: httpx.HTTPTransport, backend: httpcore.NetworkBackend) -> bool:
    """Make ``transport`` open its connections through ``backend`` (before its first request), so
    that the backend can cut a request blocked in ``recv`` from another thread. True when done.

    Reaches ``HTTPTransport._pool._network_backend``: ``httpcore.ConnectionPool`` takes a
    ``network_backend`` argument, but ``httpx.HTTPTransport`` builds the pool itself and does not
    pass one through (the alternative, a transport of our own around a pool of our own, would copy
    httpx's request and response mapping). Without the members: False, the transport as it is (a
    blocked request then ends at its timeout instead of at once: closing the client can wait up to
    the request timeout; logged once)."""
    pool = getattr(transport, "_pool", None)
    if not isinstance(pool, httpcore.ConnectionPool):
        degraded("httpx.HTTPTransport._pool", "closing the client waits for a pending request's timeout")
        return False
    if not isinstance(getattr(pool, "_network_backend", None), httpcore.NetworkBackend):
        degraded("httpcore.ConnectionPool._network_backend",
                 "closing the client waits for a pending request's timeout")
        return False
    pool._network_backend = backend
    return True
