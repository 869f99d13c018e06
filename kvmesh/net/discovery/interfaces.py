"""Which of this Mac's addresses to advertise, and how to dial an address a peer advertised."""

import contextlib
import ipaddress
import socket
from collections.abc import Sequence

import ifaddr

from kvmesh.net.addresses import host_port


def routable_addresses(interfaces: Sequence[str] | None) -> list[str]:
    """The addresses to advertise: the served interfaces' own, never loopback on a LAN.

    Loopback is advertised only when it is explicitly the (only) interface served: tests and demos.
    """
    if interfaces:
        return list(interfaces)
    found = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if isinstance(ip.ip, str) and ip.is_IPv4 and not ip.ip.startswith(("127.", "169.254.")):
                found.append(ip.ip)
    return found


def dial_address(address: str, port: int) -> str | None:
    """The `host:port` to dial an address a peer advertised, or None when it cannot be dialled.

    An IPv6 link-local address (fe80::/10) exists on every link at once, so it means something only
    with its scope, the interface it was heard on: zeroconf appends that as `%<interface index>`
    when it knows it, and the interface's name is put there (gRPC takes either; names read better
    in logs). Without a scope it is left out.
    """
    host, _, scope = address.partition("%")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if ip.version == 6 and ip.is_link_local:
        if not scope:
            return None
        if scope.isdigit():
            with contextlib.suppress(OSError):
                scope = socket.if_indextoname(int(scope))
        return host_port(f"{host}%{scope}", port)
    return host_port(host, port)
