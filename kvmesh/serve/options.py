"""`kvmesh serve`'s settings, declared once: the config file's [serve] table, the flags, their help.

Needs no MLX: the daemon's command reads the table to learn whether to run a server beside itself.
"""

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvmesh.codec.levels import LEVELS
from kvmesh.daemon.config import read_file
from kvmesh.errors import ConfigError
from kvmesh.net.addresses import peer_address
from kvmesh.net.timeouts import TIMEOUTS
from kvmesh.reuse.choice import FETCH_HELP, FETCH_MODES
from kvmesh.settings import check_choices, from_overrides, from_table, setting, unknown_names


@dataclass(frozen=True)
class ServeOptions:
    model: str = setting("", help="model directory or Hugging Face repo id")
    host: str = setting("127.0.0.1", help="address to serve on (any but loopback needs an API key)", metavar="ADDRESS")
    port: int = setting(8080, help="port (0: any free port)")
    # On loopback a key is optional; any other address needs one (the API runs a model, reads prompts).
    api_key: str = setting("", help="require this bearer key (default $KVMESH_API_KEY)", metavar="KEY")
    peers: tuple[str, ...] = setting(
        (), help="host:port of a peer to ask (default: the local daemon's live peers)", flag="--peer", metavar="ADDRESS"
    )
    memory_bytes: int = setting(2 << 30, help="bytes of live caches kept in memory, least recently used out")
    memory_caches: int = setting(16, help="live caches kept in memory at most (mlx-lm's --prompt-cache-size)")
    min_store_tokens: int = setting(512, help="caches of at least this many tokens also go to the store")
    # OpenAI's and vLLM's default is the rest of the context: an agent that sends no limit (Codex CLI)
    # would read an answer cut at any fixed number as broken.
    max_tokens: int = setting(
        0, help="max_tokens of a request that gives none (0: as many as the model's context leaves)"
    )
    # Timeouts.stream_idle says why (shorter than the daemon's: a request waits on it).
    idle_timeout: float = setting(
        TIMEOUTS.stream_idle, help="seconds a peer's transfer may stall before the request prefills", metavar="SECONDS"
    )
    max_body_bytes: int = setting(32 << 20, help="a request body larger than this is refused (413) unread")
    # A client that opens connections and never finishes its requests must not hold the server's
    # descriptors: each head has a deadline, each body a longest pause, and connections a bound.
    read_header_timeout: float = setting(
        10.0, help="seconds a client has to send a request's head (line and headers); then 408", metavar="SECONDS"
    )
    read_timeout: float = setting(
        30.0, help="seconds a request's body may pause before it is refused (408)", metavar="SECONDS"
    )
    max_connections: int = setting(
        1000, help="open connections at most; past it the one waiting longest on its request is closed"
    )
    # One client must not hold all the connections: every local tool comes from 127.0.0.1, so the
    # bound is as many as the server holds requests by default (max_requests), each on its own
    # connection, with nothing left waiting.
    max_connections_per_address: int = setting(
        64,
        help="open connections from one address at most (loopback counts too); past it that address's "
        "connection waiting longest on its request is closed, or the new one refused (503)",
    )
    # A client that asks and never reads its answer (or reads a byte a second) must not hold its
    # connection, nor its request's place, for as long as it likes.
    send_timeout: float = setting(
        30.0,
        help="seconds an answer's bytes may wait for the client to read them; then it is cut and its connection closed",
        metavar="SECONDS",
    )
    # A queue that only grows answers everyone late; past the bound a client is told to retry (429).
    max_requests: int = setting(
        64,
        help="requests held at once (finding their prefix, waiting or generating); past it a 429 with Retry-After",
    )
    # The local daemon names the live peers; one that is frozen must not hold each request.
    local_daemon_timeout: float = setting(
        0.5, help="seconds to wait for the local daemon's list of live peers", metavar="SECONDS"
    )
    local_daemon_cache: float = setting(
        10.0,
        help="seconds the local daemon's answer (or its silence) is reused before it is asked again",
        metavar="SECONDS",
    )
    compress: str = setting(
        "none",
        help="keep caches in the store transform coded at this measured level (given alone: default; see "
        "`kvmesh prefill --help` and the README)",
        choices=("none", *LEVELS),
        const="default",
    )
    fetch: str = setting("auto", help=FETCH_HELP, choices=FETCH_MODES)
    # Browsers call another origin's API only when it answers CORS; off by default, since a page's
    # script is exactly what the loopback Origin check keeps out.
    web_origins: tuple[str, ...] = setting(
        (),
        help="let web pages of this origin (e.g. http://localhost:3000) call the API from a browser (CORS); "
        '"*" for any, which needs an API key',
        flag="--web-origin",
        metavar="ORIGIN",
    )

    # A container on this Mac reaches a loopback server under the host name its runtime gives it;
    # CONTAINER_HOSTS are always answered, these too.
    allowed_hosts: tuple[str, ...] = setting(
        (),
        help="a host name a loopback server answers to besides 127.0.0.1, localhost, [::1] and the container "
        "names (host.docker.internal, ...)",
        flag="--allowed-host",
        metavar="NAME",
    )

    def __post_init__(self) -> None:
        for name in (
            "memory_bytes",
            "memory_caches",
            "min_store_tokens",
            "max_body_bytes",
            "max_connections",
            "max_connections_per_address",
            "max_requests",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, not {getattr(self, name)}")
        if self.max_tokens < 0:
            raise ConfigError(f"max_tokens must be 0 (the rest of the context) or more, not {self.max_tokens}")
        for name in ("read_header_timeout", "read_timeout", "send_timeout", "local_daemon_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be more than 0 seconds, not {getattr(self, name)}")
        if self.local_daemon_cache < 0:
            raise ConfigError(f"local_daemon_cache must be 0 seconds or more, not {self.local_daemon_cache}")
        check_choices(self)
        if "*" in self.web_origins and not self.api_key:
            raise ConfigError('web_origins "*" lets any web page call the API: it needs an API key')
        object.__setattr__(self, "peers", tuple(peer_address(p) for p in self.peers))  # `localhost` dials :7077


def load_serve_options(
    file: Path | None = None, *, env: Mapping[str, str] | None = None, overrides: Mapping[str, Any] | None = None
) -> ServeOptions:
    """The config file's [serve] table (of `file`, or the default config file if it exists), then
    $KVMESH_API_KEY, then overrides (flags: None is a flag not given)."""
    env = os.environ if env is None else env
    path, data = read_file(file)
    table = data.get("serve", {})
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [serve] must be a table")
    values = from_table(ServeOptions, table, f"{path} [serve]")
    if env.get("KVMESH_API_KEY"):
        values["api_key"] = env["KVMESH_API_KEY"]
    overrides = overrides or {}
    unknown_names(overrides, ServeOptions)
    values.update(from_overrides(ServeOptions, overrides))
    return replace(ServeOptions(), **values)
