"""`kvmesh serve`: load a model, wire the prompt cache to the store and the mesh, serve HTTP."""

import ipaddress
import json
import logging
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from kvmesh.caches.defaults import DEFAULT_COMPRESSION
from kvmesh.caches.presses import make_press
from kvmesh.errors import KvmeshError
from kvmesh.fetch_or_prefill import Rates
from kvmesh.net.credentials import MeshCredentials
from kvmesh.serve.app import ServedModel, make_app
from kvmesh.serve.engine import Engine
from kvmesh.serve.prompt_cache import MeshPromptCache
from kvmesh.store import CacheStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    # Bytes of live caches kept in memory; caches of at least this many tokens also go to the store.
    memory_bytes: int = 2 << 30
    min_store_tokens: int = 512
    max_tokens: int = 512
    idle_timeout: float = 10.0
    # Keep caches in the store compressed with the measured default (kvmesh.caches.defaults).
    compress: bool = False
    # "auto": fetch a peer's cache only when that beats prefilling it here; "always": whenever found.
    fetch: str = "auto"


def check_exposure(host: str, api_key: str | None) -> None:
    """Loopback needs no key; any other address does (the API runs a model and reads prompts)."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback and not api_key:
        raise KvmeshError(
            f"serving on {host} needs an API key: give --api-key (or KVMESH_API_KEY), or serve on 127.0.0.1"
        )


def context_length(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config", {})
    return int(config.get("max_position_embeddings") or text.get("max_position_embeddings") or 4096)


def serve(
    model_path: str,
    loaded: tuple,
    store: CacheStore | None,
    peers: Sequence[str] | Callable[[], list[str]],
    credentials: MeshCredentials | None,
    options: ServeOptions,
    announce: Callable[[str], None] = print,
    rates: Rates | None = None,
) -> None:
    """Serve until interrupted; `loaded` is (model, tokenizer, fingerprint) of `model_path`. With
    `rates` and `options.fetch` "auto", peers' caches are fetched only when faster than prefilling."""
    check_exposure(options.host, options.api_key)
    model, tokenizer, fp = loaded
    prompt_cache = MeshPromptCache(
        fp,
        store,
        peers,
        credentials,
        options.memory_bytes,
        options.min_store_tokens,
        options.idle_timeout,
        rates if options.fetch == "auto" else None,
    )
    if options.compress:
        prompt_cache.compress_with(make_press(*DEFAULT_COMPRESSION), model)
    engine = Engine(model, tokenizer, prompt_cache)
    name = Path(model_path).name or model_path
    served = ServedModel(
        name=name,
        aliases=frozenset({name, model_path, fp.model_id, fp.repo_id} - {""}),
        context_length=context_length(Path(model_path)) if Path(model_path).is_dir() else 1 << 20,
    )
    app = make_app(engine, served, options.api_key, options.max_tokens)
    family = socket.AF_INET6 if ":" in options.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((options.host, options.port))
    except OSError as e:
        sock.close()
        raise KvmeshError(f"cannot listen on {options.host}:{options.port}: {e.strerror or e}") from None
    port = sock.getsockname()[1]
    host = f"[{options.host}]" if ":" in options.host else options.host
    announce(f"kvmesh serve: {name} at http://{host}:{port}/v1 (model id {fp.model_id})")
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    try:
        server.run(sockets=[sock])
    finally:
        engine.close()
        sock.close()
