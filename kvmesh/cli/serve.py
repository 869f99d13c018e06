"""`kvmesh serve`: the OpenAI and Anthropic APIs over a local model, with the mesh as its prompt cache.

Its settings are `ServeOptions`' fields: the flags below, the config file's [serve] table and their
help all come from there.
"""

from pathlib import Path
from typing import Any

from kvmesh.cli.common import Args, Commands, command, data_dir, mesh_credentials, open_store, store_option
from kvmesh.serve.options import ServeOptions
from kvmesh.settings import add_flags, from_flags


def serve_options(args: Args) -> ServeOptions:
    """The config file's [serve] table, then $KVMESH_API_KEY, then the flags."""
    from kvmesh.serve.options import load_serve_options

    overrides = {**from_flags(ServeOptions, args, skip=("model",)), "model": args.model}
    return load_serve_options(Path(args.config) if args.config else None, overrides=overrides)


def mesh_words(args: Args, options: ServeOptions) -> str:
    """How the prompt cache reaches the mesh, for the banner: off, named peers, or the local
    daemon's live peers (and whether a daemon runs now)."""
    from kvmesh.daemon.control import read_state
    from kvmesh.errors import KvmeshError

    if args.no_mesh:
        return "off (--no-mesh): memory and the local store only"
    if options.peers:
        return "on: asking " + ", ".join(options.peers)
    try:
        state = read_state(data_dir(args))
    except KvmeshError as e:
        return f"off for now ({e}); the local daemon is asked again every {options.local_daemon_cache:g} s"
    return f"on: the live peers of the local daemon at {state.control} (node {state.node_id}, {state.mode})"


def serve(args: Args) -> int:
    from kvmesh.daemon.logs import setup_logging
    from kvmesh.errors import KvmeshError
    from kvmesh.model.loaded import load_model
    from kvmesh.model.names import remember_name
    from kvmesh.reuse.rates import Rates
    from kvmesh.serve.server import bind, check_exposure, serve

    options = serve_options(args)
    if not options.model:
        raise KvmeshError("give a model (kvmesh serve MODEL), or set `model` in the config's [serve] table")
    check_exposure(options.host, options.api_key)  # before the model loads
    sockets = bind(options.host, options.port)  # so is the port: one in use costs no model load
    setup_logging("text", "info", native=False)  # one line per request, and the calibration's
    store = None if args.no_store else open_store(args)
    loaded = load_model(options.model)
    remember_name(data_dir(args), loaded.fingerprint, options.model)
    peers: Any
    if options.peers or args.no_mesh:
        peers = [] if args.no_mesh else list(options.peers)
    else:
        from kvmesh.serve.daemon_peers import DaemonPeers

        # Asked again for each request, within a short deadline, its answer reused for a while.
        peers = DaemonPeers(
            data_dir(args), timeout=options.local_daemon_timeout, cache_seconds=options.local_daemon_cache
        )
    serve(
        options,
        loaded,
        store=store,
        peers=peers,
        credentials=mesh_credentials(args),
        announce=lambda line: print(line, flush=True),
        rates=None if args.no_mesh else Rates(data_dir(args)),
        sockets=sockets,
        data_dir=data_dir(args),
        mesh=mesh_words(args, options),
    )
    return 0


def add_commands(commands: Commands) -> None:
    sub = command(
        commands,
        "serve",
        serve,
        "serve the OpenAI API (chat and text completions, Responses) and the Anthropic Messages API, with "
        "the mesh as prompt cache",
        description="Tool calls are read with mlx-lm's parser for the model's chat template, and forced (tool_choice "
        "required, or a named function) or response_format held to a JSON schema by a grammar (llguidance). "
        "Requests find their prefix off the generation thread and decode together (mlx-lm's BatchGenerator) "
        "when their caches allow, else one at a time; at most "
        "--max-requests held at once (then a 429). Their prompt cache is memory, then the local store, "
        "then the mesh's peers (--peer, or the local daemon's); after each request its cache goes back to "
        "memory and, when long enough, to the store, where peers find it. A request's cache_salt (a random "
        "secret, as vLLM's) keeps its caches in memory under that salt only, never in the store: clients that "
        "must not learn each other's prompts through usage.prompt_tokens_details.cached_tokens each send "
        "their own. Settings come from the config file's [serve] table, then these flags.",
    )
    sub.add_argument("model", nargs="?", help="model directory or Hugging Face repo id (default: [serve] model)")
    sub.add_argument("--config", help="TOML file whose [serve] table gives defaults (default: the daemon's)")
    add_flags(sub, ServeOptions, skip=("model",))
    sub.add_argument("--no-mesh", action="store_true", help="only memory and the local store")
    sub.add_argument("--no-store", action="store_true", help="only memory and the mesh; keep nothing on disk")
    store_option(sub)
