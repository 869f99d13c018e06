"""Peers' addresses as people type them and as gRPC dials them. Free of gRPC, so settings tables
(the daemon's config, `kvmesh serve`'s options) check addresses without loading the network."""

from kvmesh.errors import ConfigError

# The port a daemon serves on unless told otherwise, and the one dialled when an address names none.
DEFAULT_PORT = 7077
# The authority's join port (beside the peer port).
DEFAULT_JOIN_PORT = 7078


def peer_address(text: str) -> str:
    """A peer's address as a person types it (`192.168.1.20`, `192.168.1.20:7077`, `localhost`,
    `fe80::1%en0`, `[fe80::1%en0]:7077`) as gRPC dials it: with kvmesh's port when it names none
    (gRPC's own default would be 443). A malformed one is a ConfigError saying what to give."""
    given = text.strip()
    if given.startswith("["):
        host, _, rest = given[1:].partition("]")
        port = rest.removeprefix(":") if rest.startswith(":") else ("" if not rest else None)
    elif given.count(":") > 1:  # a bare IPv6 address
        host, port = given, ""
    else:
        host, _, port = given.partition(":")
    if not host or port is None or any(c.isspace() or c in "/[]" for c in host):
        raise ConfigError(f"peer {text!r}: give an address, host:port (e.g. 192.168.1.20:7077)")
    if port and (not port.isdigit() or not 0 < int(port) < 65536):
        raise ConfigError(f"peer {text!r}: the port must be a number in 1..65535")
    return host_port(host, port or DEFAULT_PORT)


def host_port(host: str, port: int | str) -> str:
    """The `host:port` that gRPC dials and serves: an IPv6 address in brackets (`[fe80::1%en0]:7077`)."""
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_host_port(address: str) -> tuple[str, int]:
    """(host, port) of a `host:port` as gRPC dials it, the inverse of `host_port` (an IPv6 host comes
    without its brackets)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def caller_host(peer: str) -> str:
    """The calling host of a peer as gRPC's `context.peer()` names one, its port left out
    (`ipv4:192.168.1.20:50123` -> `ipv4:192.168.1.20`): what every call from one Mac shares."""
    return peer.rpartition(":")[0]
