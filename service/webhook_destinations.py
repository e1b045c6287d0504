"""Where a webhook may be sent: anywhere but the addresses no alert receiver lives at and a
request forged by whoever holds the ``webhooks`` scope must not reach: link-local addresses
(``169.254.0.0/16``, ``fe80::/10``: the cloud metadata services, ``169.254.169.254``), the
cloud metadata services' other addresses (``fd00:ec2::254``, ``100.100.100.200``), the
unspecified address (``0.0.0.0``, ``::``: the host itself), multicast and broadcast. An IPv6
address carrying an IPv4 one (``::ffff:169.254.169.254``, ``64:ff9b::a9fe:a9fe``, 6to4) is
judged by the IPv4 address. Loopback and private addresses stay allowed: a receiver beside the
controller or on the cluster's network is the usual case.

:func:`refused_host` judges a URL's host as written (an IP address in any spelling the system's
resolver reads as one, e.g. ``2852039166`` or ``0xa9fea9fe``), when a webhook is created;
:func:`checked_destination` resolves a host name once per delivery and judges every address it
resolves to; the delivery then connects to the address judged (with the URL's host in ``Host`` and,
for ``https``, in TLS's server name and certificate check), never resolving the name again.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass, field

import httpx

__all__ = ["refused_address", "refused_host", "checked_destination", "Destination"]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

#: Cloud metadata services outside the link-local ranges (AWS over IPv6, Alibaba Cloud).
_METADATA = frozenset({ipaddress.ip_address("fd00:ec2::254"), ipaddress.ip_address("100.100.100.200")})
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def _embedded_ipv4(address: IPAddress) -> IPAddress:
    """The IPv4 address an IPv6 one carries (mapped, NAT64, 6to4), else ``address`` itself."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
        if address in _NAT64:
            return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if address.sixtofour is not None:
            return address.sixtofour
    return address


def refused_address(address: IPAddress) -> str | None:
    """Why no webhook may be sent to ``address`` (what it is), or ``None`` when one may."""
    ip = _embedded_ipv4(address)
    if ip in _METADATA:
        return "a cloud metadata service"
    if ip.is_link_local:
        return "a link-local address (where cloud metadata services answer)"
    if ip.is_unspecified:
        return "the unspecified address (the host itself)"
    if ip.is_multicast or ip == ipaddress.IPv4Address("255.255.255.255"):
        return "a multicast or broadcast address"
    return None


def _literal(host: str) -> IPAddress | None:
    """The IP address ``host`` spells, in the forms the system's resolver reads without asking
    DNS (also ``2852039166``, ``0xa9fea9fe``, ``169.254.43518``); ``None`` for a host name."""
    text = host.strip("[]")
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        pass
    try:
        return ipaddress.IPv4Address(socket.inet_aton(text))
    except OSError:
        return None


def refused_host(host: str) -> str | None:
    """Why no webhook may be sent to ``host`` as written (an IP address refused by
    :func:`refused_address`), or ``None``: a host name is judged at delivery."""
    address = _literal(host)
    refused = None if address is None else refused_address(address)
    return None if refused is None else f"{host} is {refused}"


@dataclass(frozen=True, slots=True)
class Destination:
    """Where one delivery goes: the host resolved once and judged, and what to send where."""

    refused: str | None = None
    """Why nothing may be sent (not retried), or None."""
    unresolved: str | None = None
    """Why the host name did not resolve (retried as a connection error), or None."""
    url: str = ""
    """The URL to connect to: the host name replaced by the address that was judged."""
    headers: dict[str, str] = field(default_factory=dict)
    """``Host``: the URL's own host (and port), when the URL names an address instead; and for
    ``https``, ``Connection: close``."""
    extensions: dict[str, object] = field(default_factory=dict)
    """``sni_hostname``: the host name TLS names and checks the certificate against (``https``)."""


async def checked_destination(url: str) -> Destination:
    """Resolve ``url``'s host once, judge every address it resolves to (:func:`refused_address`),
    and name the first as the one to connect to: the delivery connects to the address judged, so a
    name that resolves elsewhere a moment later (DNS rebinding) cannot turn it to a refused one.
    A host that does not resolve is not posted to at all (the connection would resolve it again)."""
    try:
        parsed = httpx.URL(url)
        host, port = parsed.host, parsed.port
    except httpx.InvalidURL:
        return Destination(url=url)  # (the delivery answers an invalid URL itself)
    refused = refused_host(host)
    if refused is not None or _literal(host) is not None:
        return Destination(refused=refused, url=url)
    try:
        found = await asyncio.get_running_loop().getaddrinfo(
            host, port or (443 if parsed.scheme == "https" else 80), type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        return Destination(unresolved=f"{host} does not resolve: {e}")
    addresses = [ipaddress.ip_address(str(sockaddr[0]).split("%")[0]) for *_, sockaddr in found]
    for address in addresses:
        refused = refused_address(address)
        if refused is not None:
            return Destination(refused=f"{host} resolves to {address}, {refused}")
    if not addresses:
        return Destination(unresolved=f"{host} does not resolve: no address")
    headers = {"Host": parsed.netloc.decode("ascii")}
    if parsed.scheme != "https":
        return Destination(url=str(parsed.copy_with(host=str(addresses[0]))), headers=headers)
    # (closed after the answer: the pool keeps connections by address, and a TLS connection made
    # and checked for one name must never carry a request for another name at the same address)
    return Destination(url=str(parsed.copy_with(host=str(addresses[0]))), headers=headers | {"Connection": "close"},
                       extensions={"sni_hostname": host})
