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
:func:`refused_destination` judges every address a host name resolves to, before each delivery.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket

import httpx

__all__ = ["refused_address", "refused_host", "refused_destination"]

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


async def refused_destination(url: str) -> str | None:
    """Why ``url`` may not be posted to now: its host, or an address it resolves to, is refused;
    ``None`` when it may, or when the host does not resolve (the connection then fails and is
    retried as any connection error)."""
    try:
        host, port = httpx.URL(url).host, httpx.URL(url).port
    except httpx.InvalidURL:
        return None  # (the delivery answers an invalid URL itself)
    refused = refused_host(host)
    if refused is not None or _literal(host) is not None:
        return refused
    try:
        found = await asyncio.get_running_loop().getaddrinfo(host, port or 443, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return None
    for *_, sockaddr in found:
        address = ipaddress.ip_address(str(sockaddr[0]).split("%")[0])
        refused = refused_address(address)
        if refused is not None:
            return f"{host} resolves to {address}, {refused}"
    return None
