"""Daemon settings: defaults, then a TOML file, then KVMESH_* environment variables, then flags.

Each setting is declared once, below or in `Policy` (kvmesh.settings derives the file's keys, the
variables and the flags from the fields). The file holds the policy's settings at its top level
beside the daemon's own, as one flat list a user reads in one place.
"""

import ipaddress
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvmesh import paths
from kvmesh.errors import ConfigError
from kvmesh.net.addresses import DEFAULT_PORT, peer_address
from kvmesh.net.mesh.pki import MAX_CERT_DAYS, NODE_CERT_DAYS, RENEW_BEFORE_DAYS
from kvmesh.net.policy import Policy
from kvmesh.net.timeouts import TIMEOUTS
from kvmesh.settings import (
    check_choices,
    from_environment,
    from_overrides,
    from_table,
    setting,
    settings_of,
    unknown_names,
)
from kvmesh.store.budget import AUTO_BUDGET

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

# Tables of the config file that belong to other commands (`kvmesh serve`'s).
OTHER_TABLES = ("serve",)


@dataclass(frozen=True)
class DaemonConfig:
    """Every daemon setting, with its default; `load_config` layers file, environment and flags."""

    data_dir: Path = setting(help="node id, mesh credentials, the store, the daemon's state", factory=paths.data_dir)
    store: str = setting("", help="store directory (default: <data dir>/store)", metavar="DIR")
    interfaces: tuple[str, ...] = setting(
        (),
        help="IP address to serve and advertise on (default: this machine's routable IPv4 addresses)",
        flag="--interface",
        metavar="ADDRESS",
    )
    port: int = setting(DEFAULT_PORT, help="port (0: any free port)")
    # Networks that block multicast name their peers.
    peers: tuple[str, ...] = setting(
        (), help="host:port of a peer to use without discovery", flag="--peer", metavar="ADDRESS"
    )
    discovery: bool = setting(True, help="no mDNS: static peers only", flag="--no-discovery")
    max_transfers: int = setting(4, help="transfers served at once; others wait")
    store_budget: int = setting(
        AUTO_BUDGET,
        help="bytes the store may hold before least-recently used caches go (-1: 10% of its disk; 0: no limit)",
    )
    health_interval: float = setting(1.0, help="seconds between peer health checks", metavar="SECONDS")
    budget_interval: float = setting(
        30.0,
        help="seconds between checks that the store is within its budget (others write to it too)",
        metavar="SECONDS",
    )
    log_format: str = setting(
        "text", help="log lines as text, or as JSON objects (for a service's log)", choices=("text", "json")
    )
    log_level: str = setting(
        "info", help="the least severe level logged", choices=("debug", "info", "warning", "error")
    )
    grace: float = setting(
        TIMEOUTS.shutdown_grace, help="seconds transfers in flight get to finish at shutdown", metavar="SECONDS"
    )
    # Node certificates: how long one this daemon issues itself lasts, and how long before its end it
    # is renewed (while the daemon runs, too). Fractions of a day are allowed (tests use seconds).
    certificate_days: float = setting(NODE_CERT_DAYS, help="days a node certificate the daemon issues itself lasts")
    renew_before_days: float = setting(
        RENEW_BEFORE_DAYS, help="days before its certificate ends that the running daemon renews it"
    )
    # Membership (kvmesh.net.mesh.member): the authority's join port, the longest certificate a peer may
    # hold, and how often peers are asked for a newer revocation list.
    join_port: int = setting(
        -1,
        help="port the mesh's authority (the Mac that ran `kvmesh mesh init`) takes joins and renewals on "
        "(-1: the peer port + 1, i.e. 7078, or any free port when the peer port is 0; 0: any free port)",
    )
    max_certificate_days: float = setting(
        MAX_CERT_DAYS,
        help="a peer whose certificate lasts longer than this many days is refused; the authority issues none longer",
    )
    revocation_interval: float = setting(
        30.0, help="seconds between asks of the live peers for a newer revocation list", metavar="SECONDS"
    )
    policy: Policy = field(default_factory=Policy)

    def __post_init__(self) -> None:
        check_choices(self)
        for address in self.interfaces:
            try:
                ipaddress.ip_address(address.split("%")[0])
            except ValueError:
                raise ConfigError(
                    f"interface {address!r} is not an IP address: give one of this machine's, e.g. 192.168.1.10"
                ) from None
        # Peers as gRPC dials them: `localhost` is `localhost:7077`. (A frozen dataclass sets its own
        # fields only this way.)
        object.__setattr__(self, "peers", tuple(peer_address(p) for p in self.peers))
        if not 0 < self.renew_before_days < self.certificate_days:
            raise ConfigError(
                f"renew_before_days ({self.renew_before_days}) must be above 0 and below certificate_days "
                f"({self.certificate_days})"
            )
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in 0..65535, not {self.port}")
        if self.max_transfers < 1:
            raise ConfigError("max_transfers must be at least 1")

    @property
    def store_dir(self) -> Path:
        return Path(self.store).expanduser() if self.store else paths.store_dir(self.data_dir)


def read_file(file: Path | None) -> tuple[Path, dict[str, Any]]:
    """The config file's path and contents ({} when the default file does not exist)."""
    path = file or paths.config_file()
    if file is None and not path.exists():
        return path, {}
    try:
        return path, tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the config: {e}") from e


def load_config(
    file: Path | None = None, *, env: Mapping[str, str] | None = None, overrides: Mapping[str, Any] | None = None
) -> DaemonConfig:
    """Settings from `file` (or the default config file, if it exists), env, then overrides (flags:
    a value of None is a flag not given). Names are those of DaemonConfig and of Policy."""
    env = os.environ if env is None else env
    path, data = read_file(file)
    policy_names = settings_of(Policy)
    daemon_values = from_table(DaemonConfig, data, str(path), allowed=[*policy_names, *OTHER_TABLES])
    policy_values = from_table(Policy, data, str(path), allowed=[*settings_of(DaemonConfig), *OTHER_TABLES])
    daemon_values.update(from_environment(DaemonConfig, env))
    policy_values.update(from_environment(Policy, env))
    overrides = overrides or {}
    unknown_names(overrides, DaemonConfig, Policy)
    daemon_values.update(from_overrides(DaemonConfig, overrides))
    policy_values.update(from_overrides(Policy, overrides))
    return replace(DaemonConfig(), **daemon_values, policy=replace(Policy(), **policy_values))
