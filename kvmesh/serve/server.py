"""`kvmesh serve`: load a model, wire the prompt cache to the store and the mesh, serve HTTP."""

import ipaddress
import json
import logging
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import uvicorn

from kvmesh.caches.presses import Press
from kvmesh.codec.calibration import NothingToCode
from kvmesh.compression import model_basis
from kvmesh.errors import KvmeshError
from kvmesh.fetch_or_prefill import Rates
from kvmesh.model.loaded import LoadedModel
from kvmesh.net.addresses import host_port
from kvmesh.net.credentials import MeshCredentials
from kvmesh.serve.app import ServedModel, make_app
from kvmesh.serve.connections import ConnectionGuard, descriptor_backlog, guarded_protocol
from kvmesh.serve.engine import Engine
from kvmesh.serve.options import ServeOptions
from kvmesh.serve.prompt_cache import MeshPromptCache
from kvmesh.store import CacheStore
from kvmesh.store.artifacts import artifact_store

log = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def check_exposure(host: str, api_key: str | None) -> None:
    """Loopback needs no key; any other address does (the API runs a model and reads prompts)."""
    if not is_loopback(host) and not api_key:
        raise KvmeshError(
            f"serving on {host} needs an API key: give --api-key (or KVMESH_API_KEY), or serve on 127.0.0.1"
        )


def context_length(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config", {})
    return int(config.get("max_position_embeddings") or text.get("max_position_embeddings") or 4096)


def serve(
    options: ServeOptions,
    loaded: LoadedModel,
    *,
    store: CacheStore | None,
    peers: Sequence[str] | Callable[[], list[str]],
    credentials: MeshCredentials | None,
    announce: Callable[[str], None] = print,
    rates: Rates | None = None,
) -> None:
    """Serve `loaded` (the model of `options.model`) until interrupted. With `rates` and
    `options.fetch` "auto", peers' caches are fetched only when faster than prefilling them here;
    `peers` may be a function, asked again for each request (the local daemon's live peers)."""
    check_exposure(options.host, options.api_key)
    model, tokenizer, fp = loaded.model, loaded.tokenizer, loaded.fingerprint
    model_path = options.model
    prompt_cache = MeshPromptCache(
        fp,
        store,
        peers,
        credentials=credentials,
        max_bytes=options.memory_bytes,
        min_store_tokens=options.min_store_tokens,
        idle_timeout=options.idle_timeout,
        rates=rates if options.fetch == "auto" else None,
    )
    if options.compress != "none" and store is not None:
        if artifact_store(store.root).model_basis(fp.model_id) is None:
            log.info("calibrating the transform codec for %s (once)", fp.model_id)
        try:
            basis, _ = model_basis(store.root, loaded)
        except NothingToCode as e:
            log.warning("--compress changes nothing for this model (%s): caches are kept as they are", e)
        else:
            prompt_cache.compress_with(Press(), model, level=options.compress, basis=basis)
    engine = Engine(model, tokenizer, prompt_cache)
    name = Path(model_path).name or model_path
    served = ServedModel(
        name=name,
        aliases=frozenset({name, model_path, fp.model_id, fp.repo_id} - {""}),
        context_length=context_length(Path(model_path)) if Path(model_path).is_dir() else 1 << 20,
    )
    app = make_app(
        engine,
        served,
        options.api_key or None,
        options.max_tokens,
        max_body_bytes=options.max_body_bytes,
        read_timeout=options.read_timeout,
        loopback=is_loopback(options.host),
        cors_origins=options.web_origins,
    )
    server, backlog = http_server(app, options)
    sock = listen(options.host, options.port, backlog)
    address = host_port(options.host, sock.getsockname()[1])
    announce(f"kvmesh serve: {name} at http://{address}/v1 (model id {fp.model_id})")
    try:
        server.run(sockets=[sock])
    finally:
        app.state.parse_pool.shutdown(wait=False, cancel_futures=True)
        engine.close()
        sock.close()


def listen(host: str, port: int, backlog: int) -> socket.socket:
    """A socket listening on host:port, before the URL is announced: a client that reads it can
    connect at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise KvmeshError(f"cannot listen on {host_port(host, port)}: {e.strerror or e}") from None
    sock.listen(backlog)
    return sock


def http_server(app: Any, options: ServeOptions) -> tuple[uvicorn.Server, int]:
    """uvicorn serving `app` with the connection bounds of `options` (kvmesh.serve.connections), and
    the listen backlog that keeps them within the descriptor limit."""
    backlog = descriptor_backlog(options.max_connections)
    guard = ConnectionGuard(options.read_header_timeout, options.max_connections)
    config = uvicorn.Config(
        app,
        log_level="warning",
        lifespan="off",
        http=guarded_protocol(guard),
        backlog=backlog,  # asyncio accepts up to this many at once: within the descriptor budget
    )
    return uvicorn.Server(config), backlog
