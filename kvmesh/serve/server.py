"""`kvmesh serve`: load a model, wire the prompt cache to the store and the mesh, serve HTTP.

Its life: the port is taken before the model loads (a port in use costs no load); the banner says
where it serves and how it reaches the mesh, and its state file says so for programs
(kvmesh.serve.state); /health says "starting" while it calibrates; SIGINT or SIGTERM stops it within
a second or so: open requests get STOP_GRACE_S to end, the one generating stops within a token or a
prefill chunk.
"""

import ipaddress
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn

from kvmesh.caches.presses import Press
from kvmesh.codec.calibration import NothingToCode
from kvmesh.collector import freeze_startup_objects
from kvmesh.compat.uvicorn import forget_captured_signals
from kvmesh.compression import model_basis
from kvmesh.errors import KvmeshError
from kvmesh.model.loaded import LoadedModel, context_length, local_model_dir
from kvmesh.net.addresses import host_port
from kvmesh.net.mesh.credentials import MeshCredentials
from kvmesh.reuse.rates import Rates
from kvmesh.serve.connections import ConnectionGuard, descriptor_backlog, guarded_protocol
from kvmesh.serve.engine import Engine
from kvmesh.serve.engine.prompt_cache import MeshPromptCache
from kvmesh.serve.http.app import ServedModel, make_app
from kvmesh.serve.options import ServeOptions
from kvmesh.serve.state import ServeState, remove_serve_state, write_serve_state
from kvmesh.store import CacheStore

log = logging.getLogger(__name__)

# Seconds open requests get to end once the server is told to stop; then they are cancelled.
STOP_GRACE_S = 1


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


@dataclass
class Serving:
    """What `kvmesh serve` runs, nothing bound yet: the app, its engine, the model it answers for,
    and whether the engine calibrates the prefill rate first."""

    app: Any
    engine: Engine
    served: ServedModel
    calibrating: bool


def build_app(
    options: ServeOptions,
    loaded: LoadedModel,
    *,
    store: CacheStore | None,
    peers: Sequence[str] | Callable[[], list[str]],
    credentials: MeshCredentials | None,
    rates: Rates | None = None,
) -> Serving:
    """The app and engine that serve `loaded` (the model of `options.model`) by `options`, its
    prompt cache over `store` and `peers` (a function: asked again for each request). With `rates`
    and `options.fetch` "auto", peers' caches are fetched only when faster than prefilling them here.
    `kvmesh serve` runs it on its sockets; tests run it in their own process."""
    model, tokenizer, fp = loaded.model, loaded.tokenizer, loaded.fingerprint
    model_path = options.model
    prompt_cache = MeshPromptCache(
        fp,
        store,
        peers,
        credentials=credentials,
        max_bytes=options.memory_bytes,
        max_caches=options.memory_caches,
        min_store_tokens=options.min_store_tokens,
        idle_timeout=options.idle_timeout,
        rates=rates if options.fetch == "auto" else None,
    )
    if options.compress != "none" and store is not None:
        try:
            basis, _ = model_basis(
                store.root,
                loaded,
                on_fit=lambda: log.info("calibrating the transform codec for %s (once)", fp.model_id),
            )
        except NothingToCode as e:
            log.warning("--compress changes nothing for this model (%s): caches are kept as they are", e)
        else:
            prompt_cache.compress_with(Press(), model, level=options.compress, basis=basis)
    served = ServedModel(
        name=Path(model_path).name or model_path,
        aliases=frozenset({Path(model_path).name, model_path, fp.model_id, fp.repo_id} - {""}),
        context_length=context_length(local_model_dir(model_path)),
    )
    rates = prompt_cache.rates
    calibrating = rates is not None and (
        rates.prefill_model(fp.model_id) is None or rates.decoding(fp.model_id) is None
    )
    engine = Engine(model, tokenizer, prompt_cache, max_held=options.max_requests)
    app = make_app(
        engine,
        served,
        options.api_key or None,
        options.max_tokens,
        max_body_bytes=options.max_body_bytes,
        read_timeout=options.read_timeout,
        loopback=is_loopback(options.host),
        cors_origins=options.web_origins,
        allowed_hosts=options.allowed_hosts,
    )
    return Serving(app, engine, served, calibrating)


def serve(
    options: ServeOptions,
    loaded: LoadedModel,
    *,
    store: CacheStore | None,
    peers: Sequence[str] | Callable[[], list[str]],
    credentials: MeshCredentials | None,
    announce: Callable[[str], None] = print,
    rates: Rates | None = None,
    sockets: list[socket.socket] | None = None,
    data_dir: Path | None = None,
    mesh: str = "",
) -> None:
    """Serve `loaded` (the model of `options.model`) until interrupted: `build_app`'s app, announced.
    `sockets`: bound to options' host and port before the model loaded (else bound here); `data_dir`:
    where its state file goes; `mesh`: the banner's words for how the mesh is reached."""
    check_exposure(options.host, options.api_key)
    sockets = sockets if sockets is not None else bind(options.host, options.port)
    serving = build_app(options, loaded, store=store, peers=peers, credentials=credentials, rates=rates)
    app, engine, served = serving.app, serving.engine, serving.served
    name, fp = served.name, loaded.fingerprint

    def stop(signal_name: str) -> None:
        held = engine.held()
        log.info(
            "%s: stopping; the requests held end now (%d finding their prefix, %d waiting, %d generating)",
            signal_name,
            held["lookup"],
            held["waiting"],
            held["generating"],
        )
        engine.stop()

    server, backlog = http_server(app, options, on_stop=stop)
    for sock in sockets:  # before the URL is announced: a client that reads it can connect at once
        sock.listen(backlog)
    url = f"http://{host_port(options.host, sockets[0].getsockname()[1])}/v1"
    if data_dir is not None:
        write_serve_state(data_dir, ServeState(os.getpid(), url, name, fp.model_id, mesh))
    announce(f"kvmesh serve: {name} at {url} (model id {fp.model_id})")
    if mesh:
        announce(f"  mesh: {mesh}")
    limit = f"up to {options.max_tokens}" if options.max_tokens else "to the end of the context"
    announce(f"  a request without max_tokens generates {limit} ({served.context_length:,} tokens in all)")
    if serving.calibrating:
        announce(
            '  calibrating the prefill and decode rates here (once): /health says "starting" until done; requests wait'
        )
    freeze_startup_objects()  # the model, the engine, the app: full collections walk less from now on
    try:
        server.run(sockets=sockets)
    finally:
        if data_dir is not None:
            remove_serve_state(data_dir)
        app.state.parse_pool.shutdown(wait=False, cancel_futures=True)
        for sock in sockets:
            sock.close()
        stopped = engine.close(timeout=1.0)
    if not stopped:  # calibration's prefills and a prefill chunk cannot be interrupted
        log.warning("stopped while %s: leaving it unfinished", engine.doing)
    # The way a stop would have ended, without the interpreter's exit: MLX aborts a process (exit
    # 134) whose exit finds a thread inside MLX, or frees a stopped step's arrays on another thread.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def bind(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to host:port, not yet listening: taken before the model loads, so that a port
    in use is said at once, with no model loaded in vain. `localhost` is both loopbacks, 127.0.0.1
    and [::1] on the same port (macOS resolves it to ::1 first: a client of `localhost` must find the
    server there too), or the first alone where [::1] cannot be had (said in the log)."""
    if host == "localhost":
        first = bind_one("127.0.0.1", port)
        try:
            return [first, bind_one("::1", first.getsockname()[1])]
        except KvmeshError as e:
            log.warning("serving localhost on 127.0.0.1 only: %s", e)
            return [first]
    return [bind_one(host, port)]


def bind_one(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # (127.0.0.1 has its own socket)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise KvmeshError(f"cannot listen on {host_port(host, port)}: {e.strerror or e}") from None
    return sock


def listen(host: str, port: int, backlog: int) -> socket.socket:
    """A socket listening on host:port, before the URL is announced: a client that reads it can
    connect at once."""
    sock = bind_one(host, port)
    sock.listen(backlog)
    return sock


class StoppingServer(uvicorn.Server):
    """uvicorn, which on SIGINT or SIGTERM also calls `on_stop` at once, with the signal's name (the
    engine's stop: the requests it holds end now, rather than after uvicorn's grace), and then returns."""

    def __init__(self, config: uvicorn.Config, on_stop: Callable[[str], None] | None = None):
        super().__init__(config)
        self.on_stop = on_stop

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.on_stop is not None and not self.should_exit:  # (a second Ctrl-C says nothing new)
            self.on_stop(signal.Signals(sig).name)
        super().handle_exit(sig, frame)
        # uvicorn raises the signal again once it has stopped, which kills the process before
        # `serve` removes its state file and stops the engine: a graceful stop exits 0 instead.
        forget_captured_signals(self)


def http_server(
    app: Any, options: ServeOptions, on_stop: Callable[[str], None] | None = None
) -> tuple[uvicorn.Server, int]:
    """uvicorn serving `app` with the connection bounds of `options` (kvmesh.serve.connections), and
    the listen backlog that keeps them within the descriptor limit; `on_stop` is called when it is
    told to stop."""
    backlog = descriptor_backlog(options.max_connections)
    guard = ConnectionGuard(
        options.read_header_timeout, options.max_connections, options.max_connections_per_address, options.send_timeout
    )
    config = uvicorn.Config(
        app,
        log_level="warning",
        lifespan="off",
        http=guarded_protocol(guard),
        backlog=backlog,  # asyncio accepts up to this many at once: within the descriptor budget
        timeout_graceful_shutdown=STOP_GRACE_S,  # then open requests are cancelled: a stop takes a second
    )
    return StoppingServer(config, on_stop), backlog
