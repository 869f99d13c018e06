"""Daemon settings: defaults, then a TOML file, then KVMESH_* environment variables, then flags."""

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from kvmesh import paths
from kvmesh.errors import ConfigError
from kvmesh.net.policy import Policy
from kvmesh.store.cache_store import AUTO_BUDGET

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

DEFAULT_PORT = 7077


@dataclass(frozen=True)
class DaemonConfig:
    """Every daemon setting, with its default; `load_config` layers file, environment and flags."""

    data_dir: Path = field(default_factory=paths.data_dir)
    # Where caches are kept; empty: <data_dir>/store.
    store: str = ""
    # IP addresses to listen and advertise on; empty: this machine's routable IPv4 addresses.
    interfaces: tuple[str, ...] = ()
    port: int = DEFAULT_PORT
    # host:port of peers to use without discovery (networks that block multicast).
    peers: tuple[str, ...] = ()
    discovery: bool = True
    max_transfers: int = 4
    # Bytes the store may hold before least-recently used caches go; -1: 10% of its disk; 0: no limit.
    store_budget: int = AUTO_BUDGET
    health_interval: float = 1.0
    log_format: str = "text"
    log_level: str = "info"
    # Policy (kvmesh.net.policy.Policy, which documents them): what is shared and taken, per-peer limits.
    share_models: tuple[str, ...] = Policy.share_models
    accept_publish: bool = Policy.accept_publish
    publishers: tuple[str, ...] = Policy.publishers
    max_publish_bytes: int = Policy.max_publish_bytes
    peer_calls_per_second: float = Policy.peer_calls_per_second
    peer_transfers: int = Policy.peer_transfers
    idle_timeout: float = Policy.idle_timeout

    def __post_init__(self) -> None:
        if self.log_format not in ("text", "json"):
            raise ConfigError(f"log_format must be text or json, not {self.log_format!r}")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in 0..65535, not {self.port}")
        if self.max_transfers < 1:
            raise ConfigError("max_transfers must be at least 1")

    @property
    def policy(self) -> Policy:
        return Policy(**{f.name: getattr(self, f.name) for f in fields(Policy)})

    @property
    def store_dir(self) -> Path:
        return Path(self.store).expanduser() if self.store else paths.store_dir(self.data_dir)


def _convert(name: str, value: Any, source: str) -> Any:
    """A setting from a file or the environment, as the field's type."""
    kind: Any = {f.name: f.default for f in fields(DaemonConfig) if f.name != "data_dir"}.get(name)
    try:
        if name == "data_dir":
            return Path(value).expanduser()
        if isinstance(kind, tuple):
            return tuple(v.strip() for v in (value.split(",") if isinstance(value, str) else value) if v.strip())
        if isinstance(kind, bool):
            return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes", "on")
        return type(kind)(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{source}: bad value {value!r} for {name}: {e}") from e


# The [serve] table: what `kvmesh serve` runs with, and whether the daemon runs it (when it names a model).
SERVE_SETTINGS = {
    "model": str,
    "host": str,
    "port": int,
    "api_key": str,
    "peers": list,
    "memory_bytes": int,
    "min_store_tokens": int,
    "max_tokens": int,
    "idle_timeout": float,
    "compress": bool,
    "fetch": str,
}


def read_file(file: Path | None) -> tuple[Path, dict[str, Any]]:
    """The config file's path and contents ({} when the default file does not exist)."""
    path = file or paths.config_file()
    if file is None and not path.exists():
        return path, {}
    try:
        return path, tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the config: {e}") from e


def load_serve_settings(file: Path | None = None) -> dict[str, Any]:
    """The [serve] table of the config file, checked: a model, host, port, api_key, peers, ..."""
    path, data = read_file(file)
    table = data.get("serve", {})
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [serve] must be a table")
    settings = {}
    for key, value in table.items():
        name = key.replace("-", "_")
        kind = SERVE_SETTINGS.get(name)
        if kind is None:
            raise ConfigError(f"{path}: unknown [serve] setting {key!r}; known: {', '.join(sorted(SERVE_SETTINGS))}")
        if not isinstance(value, kind) and not (kind is float and isinstance(value, int)):
            raise ConfigError(f"{path}: [serve] {key} must be a {kind.__name__}, not {value!r}")
        settings[name] = value
    return settings


def load_config(
    file: Path | None = None, env: Mapping[str, str] | None = None, overrides: Mapping[str, Any] | None = None
) -> DaemonConfig:
    """Settings from `file` (or the default config file, if it exists), env, then overrides."""
    env = os.environ if env is None else env
    names = {f.name for f in fields(DaemonConfig)}
    values: dict[str, Any] = {}
    path, data = read_file(file)
    if data:
        for key, value in data.items():
            if key == "serve":
                continue  # `kvmesh serve`'s table: load_serve_settings
            name = key.replace("-", "_")
            if name not in names:
                raise ConfigError(f"{path}: unknown setting {key!r}; known: {', '.join(sorted(names))}")
            values[name] = _convert(name, value, str(path))
    for name in names:
        if (value := env.get(f"KVMESH_{name.upper()}")) is not None:
            values[name] = _convert(name, value, f"KVMESH_{name.upper()}")
    for name, value in (overrides or {}).items():
        if value is not None:
            values[name] = _convert(name, value, f"--{name.replace('_', '-')}")
    return replace(DaemonConfig(), **values)
