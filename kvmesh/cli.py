"""The `kvmesh` command line.

Each command imports what it needs when it runs, so `kvmesh --version`, `status` and `peers` never
load MLX or a model.
"""

import argparse
import json
import os
import sqlite3
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvmesh import paths
from kvmesh.errors import KvmeshError
from kvmesh.versions import __version__

Args = argparse.Namespace


def read_text(path: str) -> str:
    """A text file's contents; one that is unreadable, empty or not UTF-8 text is a clear error."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise KvmeshError(f"{path}: cannot read: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise KvmeshError(
            f"{path}: not UTF-8 text (byte {e.start} is {e.object[e.start]:#04x}): give a text file"
        ) from None
    if not text.strip():
        raise KvmeshError(f"{path}: the file is empty: there is nothing to prefill")
    return text


def positive_int(value: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {number}")
    return number


def data_dir(args: Args) -> Path:
    return Path(args.data_dir) if args.data_dir else paths.data_dir()


def open_store(args: Args) -> Any:
    """--store, else the running daemon's store, else <data dir>/store; with the configured budget.

    The budget is the daemon's setting (config file, KVMESH_STORE_BUDGET), so every writer of a
    store, the daemon and each command alike, keeps to the same one.
    """
    from kvmesh.daemon.config import load_config
    from kvmesh.daemon.control import read_state
    from kvmesh.store import CacheStore

    budget = load_config(overrides={"data_dir": args.data_dir}).store_budget
    if getattr(args, "store", None):
        return CacheStore(args.store, max_bytes=budget)
    try:
        root = Path(read_state(data_dir(args), check_alive=False).store)
    except KvmeshError:  # no daemon, or an unreadable state file: the data dir's own store
        root = paths.store_dir(data_dir(args))
    return CacheStore(root, max_bytes=budget)


def progress_bar(description: str, unit: str) -> tuple[Any, Callable[[int, int], None]]:
    """A rich progress bar on stderr (quiet when stderr is not a terminal) and its update function."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    console = Console(stderr=True)
    amount = DownloadColumn() if unit == "bytes" else MofNCompleteColumn()
    bar = Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        amount,
        TimeRemainingColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )
    task = bar.add_task(description, total=None)
    return bar, lambda done, total: bar.update(task, completed=done, total=total)


def load_model(path: str) -> tuple[Any, Any, Any]:
    """Model, tokenizer and fingerprint of a local directory or a Hugging Face repo id (via its cache)."""
    import mlx_lm

    from kvmesh.model.fingerprint import fingerprint

    if not Path(path).exists() and path.startswith(("/", "./", "../", "~")):
        raise KvmeshError(f"{path}: no such model directory")
    fp = fingerprint(path) if Path(path).exists() else None
    try:
        model, tokenizer = mlx_lm.load(path)[:2]  # (its type also allows a third item, the config)
    except Exception as e:  # mlx-lm raises plain exceptions for missing files and unknown models
        raise KvmeshError(f"{path}: cannot load the model: {e}") from e
    if fp is None:
        from mlx_lm.utils import hf_repo_to_path

        fp = fingerprint(hf_repo_to_path(path), repo_id=path)
    return model, tokenizer, fp


def load_tokenizer_and_fingerprint(path: str) -> tuple[Any, Any]:
    """What file imports and exports need of a local model directory: no weights are loaded."""
    from mlx_lm.utils import load_tokenizer

    from kvmesh.model.fingerprint import fingerprint

    fp = fingerprint(path)
    return load_tokenizer(Path(path)), fp


def prompt_texts(args: Args) -> tuple[str, str]:
    """(file text, prompt text), checked before any model is loaded."""
    if not args.file and not args.prompt:
        raise KvmeshError("give a --file, a --prompt, or both")
    return (read_text(args.file) if args.file else ""), (args.prompt or "")


def prompt_tokens(tokenizer: Any, file_text: str, prompt: str, chat: bool = False) -> list[int]:
    """The tokens of the file then the prompt, built so that those of the file alone are a prefix.

    Plain: the file's tokens (with BOS), then the prompt's. With `chat`, one user message holding
    file and prompt in the model's chat template, the file's part tokenized exactly as
    `mlx_lm.cache_prompt` does, so its caches (via `cache import-mlx`) serve as prefixes too.
    """
    if not chat:
        tokens = tokenizer.encode(file_text) if file_text else []
        if prompt:
            tokens += tokenizer.encode(prompt, add_special_tokens=not tokens)
        return tokens
    from kvmesh.files.mlx_prompt_cache import cache_prompt_tokens

    if not tokenizer.has_chat_template:
        raise KvmeshError("this model has no chat template: drop --chat")
    if not prompt:
        return cache_prompt_tokens(tokenizer, file_text)
    full = tokenizer.apply_chat_template(
        [{"role": "user", "content": file_text + prompt}], tokenize=False, add_generation_prompt=True
    )
    if not file_text:
        return tokenizer.encode(full, add_special_tokens=False)
    head = tokenizer.apply_chat_template(
        [{"role": "user", "content": file_text}], tokenize=False, continue_final_message=True
    )
    if not full.startswith(head):
        raise KvmeshError("this chat template does not put the file before the prompt: drop --chat")
    return cache_prompt_tokens(tokenizer, file_text) + tokenizer.encode(full[len(head) :], add_special_tokens=False)


def mesh_credentials(args: Args) -> Any:
    """This node's mesh credentials (renewed if due), if it has joined a mesh: for commands that dial peers."""
    from kvmesh.net.credentials import renew_if_due
    from kvmesh.net.node_id import node_id

    return renew_if_due(data_dir(args), node_id(data_dir(args)))


# mesh membership


def cmd_mesh_init(args: Args) -> int:
    from kvmesh.net.credentials import init_mesh
    from kvmesh.net.node_id import node_id

    creds = init_mesh(data_dir(args), node_id(data_dir(args)), args.name)
    print(f"created a mesh in {data_dir(args) / 'mesh'}; this node's certificate runs to {creds.expires:%Y-%m-%d}.")
    print("On each other Mac: `kvmesh mesh export` here, then `kvmesh mesh join <that line>` there.")
    return 0


def cmd_mesh_export(args: Args) -> int:
    from kvmesh.net.credentials import export_bundle

    print(export_bundle(data_dir(args)))
    print("This line is the mesh's secret: whoever has it can join. Copy it only to your own Macs.", file=sys.stderr)
    return 0


def cmd_mesh_join(args: Args) -> int:
    from kvmesh.net.credentials import join_mesh
    from kvmesh.net.node_id import node_id

    bundle = sys.stdin.read() if args.bundle == "-" else args.bundle
    creds = join_mesh(data_dir(args), node_id(data_dir(args)), bundle, replace=args.replace)
    print(f"joined the mesh; this node's certificate runs to {creds.expires:%Y-%m-%d}.")
    print("Restart the daemon to serve the network.")
    return 0


def cmd_mesh_renew(args: Args) -> int:
    from kvmesh.errors import CredentialsError
    from kvmesh.net.credentials import renew
    from kvmesh.net.node_id import node_id

    if not (paths.mesh_dir(data_dir(args)) / "ca.key").exists():
        raise CredentialsError(f"no mesh in {paths.mesh_dir(data_dir(args))}: run `kvmesh mesh init` or `join` first")
    creds = renew(data_dir(args), node_id(data_dir(args)))
    print(f"renewed; the certificate runs to {creds.expires:%Y-%m-%d}. Peers need nothing new.")
    return 0


def cmd_mesh_status(args: Args) -> int:
    from kvmesh.net.credentials import load_credentials, renewal_due

    creds = load_credentials(data_dir(args))
    if creds is None:
        print("no mesh: the daemon serves loopback only (`kvmesh mesh init` or `kvmesh mesh join`)")
        return 0
    print(f"member of a mesh; node certificate valid to {creds.expires:%Y-%m-%d %H:%M} UTC")
    if renewal_due(creds):
        print("it is due for renewal: the daemon renews it when it starts, or run `kvmesh mesh renew`")
    return 0


# model


def cmd_model_make_test(args: Args) -> int:
    from kvmesh.model.testmodels import make_test_model

    path = make_test_model(args.dir, preset=args.preset, seed=args.seed, dtype=args.dtype)
    print(f"built preset {args.preset!r} in {path}")
    return 0


def cmd_model_info(args: Args) -> int:
    from kvmesh.model.fingerprint import fingerprint

    fp = fingerprint(args.path, repo_id=args.repo_id, revision=args.revision)
    if args.json:
        print(json.dumps(fp.to_dict(), indent=2))
    else:
        width = max(len(k) for k in fp.to_dict())
        for key, value in fp.to_dict().items():
            print(f"{key:<{width}}  {value}")
    return 0


# cache


def cmd_cache_list(args: Args) -> int:
    entries = open_store(args).entries()
    if args.json:
        print(json.dumps([{**vars(e), "prefix_sha256": e.prefix_sha256.hex()} for e in entries], indent=2))
        return 0
    if not entries:
        print("the store is empty")
    for e in entries:
        # Which prompts it serves: any that shares a block-aligned prefix with it, or only its own prefix.
        serves = "any prefix" if e.cuttable else "exact"
        print(
            f"{e.cache_id}  model {e.model_id}  {e.num_tokens:>7} tokens  {e.method:<13} {serves:<10} "
            f"{e.file_bytes:>14,} bytes"
        )
    return 0


def cmd_cache_show(args: Args) -> int:
    from google.protobuf.json_format import MessageToDict

    from kvmesh.codec.manifest import CODEC_NAMES, layer_report, uncuttable_reason

    manifest = open_store(args).manifest(args.cache_id)
    layers = layer_report(manifest)
    if args.json:
        summary = MessageToDict(manifest, preserving_proto_field_name=True)
        print(json.dumps({**summary, "layers": layers}, indent=2))
        return 0
    config = MessageToDict(manifest.compression.config, preserving_proto_field_name=True)
    encoding = manifest.encoding
    print(f"cache {manifest.cache_id}: {manifest.prefix.num_tokens} tokens of model {manifest.model.model_id}")
    print(f"  compression  {manifest.compression.method} {json.dumps(config) if config else ''}".rstrip())
    print(
        f"  encoding     {CODEC_NAMES[encoding.codec]}, {encoding.raw_bytes:,} bytes -> "
        f"{encoding.encoded_bytes:,} in {encoding.chunk_count} chunks"
    )
    if manifest.HasField("quality"):
        quality = manifest.quality
        print(f"  quality      {quality.metric} {quality.value:.4f} nats/token over its last {quality.tokens} tokens")
    why = uncuttable_reason(manifest)
    serves = f"only its exact prefix ({why})" if why else "its prefix and any shorter block-aligned one"
    print(f"  serves       {serves}")
    for row in layers:
        if "arrays" in row:
            held = "arrays " + " ".join("x".join(map(str, shape)) for shape in row["arrays"])
        else:
            held = f"{row['kept']:>7} of {row['of']} positions"
        window = f", window {row['window']} keep {row['keep']}" if "window" in row else ""
        bits = f", {row['bits']}-bit" if "bits" in row else ""
        print(f"  layer {row['layer']:>3}  {row['kind']:<22} {held}{window}{bits}  {row['bytes']:,} bytes")
    return 0


def cmd_cache_export(args: Args) -> int:
    path = open_store(args).export(args.cache_id, args.file)
    print(f"exported {args.cache_id} to {path}")
    return 0


def cmd_cache_delete(args: Args) -> int:
    open_store(args).delete(args.cache_id)
    print(f"deleted {args.cache_id}")
    return 0


def cmd_cache_verify(args: Args) -> int:
    """Check every chunk; damaged entries go to quarantine. Exit status 1 when any was damaged."""
    from kvmesh.errors import IntegrityError

    store = open_store(args)
    if args.all == bool(args.cache_id):
        raise KvmeshError("give a cache id, or --all")
    ids = [e.cache_id for e in store.entries()] if args.all else [args.cache_id]
    damaged = 0
    for cache_id in ids:
        try:
            store.verify(cache_id)
            print(f"{cache_id}  ok")
        except IntegrityError as e:
            damaged += 1
            print(f"{cache_id}  DAMAGED, quarantined: {e}")
    print(f"{len(ids)} checked, {damaged} damaged", file=sys.stderr)
    return 1 if damaged else 0


def cmd_cache_import(args: Args) -> int:
    manifest = open_store(args).import_file(args.file)
    print(f"imported {manifest.cache_id} ({manifest.prefix.num_tokens} tokens)")
    return 0


def cmd_cache_import_mlx(args: Args) -> int:
    from kvmesh.files.mlx_prompt_cache import cache_prompt_tokens, import_prompt_cache

    text = args.prompt if args.prompt is not None else read_text(args.prompt_file)
    tokenizer, fp = load_tokenizer_and_fingerprint(args.model)
    manifest = import_prompt_cache(open_store(args), args.file, fp, cache_prompt_tokens(tokenizer, text))
    print(f"imported {manifest.cache_id} ({manifest.prefix.num_tokens} tokens)")
    return 0


def cmd_cache_import_wp30(args: Args) -> int:
    from kvmesh.files.wp30 import import_wp30

    texts = prompt_texts(args)
    tokenizer, fp = load_tokenizer_and_fingerprint(args.model)
    imported = import_wp30(open_store(args), args.path, fp, prompt_tokens(tokenizer, *texts, chat=args.chat))
    manifest = imported.manifest
    print(f"imported {manifest.cache_id} ({manifest.prefix.num_tokens} tokens, {manifest.compression.method})")
    if imported.verified:
        print(f"  verified: schema, geometry, prefix tokens, every layer, {', '.join(imported.verified)}")
    if imported.unchecked:
        print(
            f"  not checked: {', '.join(imported.unchecked)} (wp30's own model hashes, which kvmesh cannot "
            "recompute: make sure the file was made with this model)"
        )
    return 0


def cmd_cache_export_wp30(args: Args) -> int:
    from kvmesh.files.wp30 import export_wp30

    texts = prompt_texts(args)
    tokenizer, fp = load_tokenizer_and_fingerprint(args.model)
    tokens = prompt_tokens(tokenizer, *texts, chat=args.chat)
    path = export_wp30(open_store(args), args.cache_id, args.path, tokens, fp, args.compression)
    print(f"exported {args.cache_id} to {path} (wp30-cache-2, compression {args.compression})")
    return 0


def cmd_cache_export_mlx(args: Args) -> int:
    from kvmesh.files.mlx_prompt_cache import export_prompt_cache

    path = export_prompt_cache(open_store(args), args.cache_id, args.file, args.model)
    print(f"exported {args.cache_id} to {path} for mlx_lm.generate --prompt-cache-file")
    return 0


# daemon and mesh


def cmd_daemon(args: Args) -> int:
    from kvmesh.daemon.config import load_config, load_serve_settings
    from kvmesh.daemon.logs import setup_logging
    from kvmesh.daemon.process import Daemon

    overrides = {
        "data_dir": args.data_dir,
        "store": args.store,
        "interfaces": args.interface or None,
        "port": args.port,
        "peers": args.peer or None,
        "max_transfers": args.max_transfers,
        "store_budget": args.store_budget,
        "health_interval": args.health_interval,
        "log_format": args.log_format,
        "log_level": args.log_level,
        "discovery": False if args.no_discovery else None,
        "share_models": args.share_model or None,
        "accept_publish": False if args.read_only else None,
        "publishers": args.publisher or None,
        "idle_timeout": args.idle_timeout,
        "peer_calls_per_second": args.peer_rate,
    }
    config_file = Path(args.config) if args.config else None
    config = load_config(config_file, overrides=overrides)
    setup_logging(config.log_format, config.log_level)
    serve_command = None
    if load_serve_settings(config_file).get("model"):  # the daemon runs `kvmesh serve` beside itself
        serve_command = [sys.executable, "-m", "kvmesh", "--data-dir", str(config.data_dir), "serve"]
        serve_command += ["--config", str(config_file)] if config_file else []
    Daemon(config, serve_command).run(grace=args.grace)
    return 0


def cmd_status(args: Args) -> int:
    from google.protobuf.json_format import MessageToDict

    from kvmesh.daemon.control import control_status

    status = control_status(data_dir(args))
    if args.json:
        print(json.dumps(MessageToDict(status, preserving_proto_field_name=True), indent=2))
        return 0
    info = status.info
    print(f"node {info.node_id} (kvmesh {info.version}) on {', '.join(status.listen)}")
    print(f"store: {info.store.entries} caches, {info.store.bytes:,} bytes")
    print(f"peers: {sum(p.healthy for p in status.peers)} live of {len(status.peers)} known")
    t = info.transfers
    print(
        f"fetches served: {t.fetches_completed} done, {t.fetches_rejected} rejected, {t.fetches_failed} failed; "
        f"{t.transfers_active} active (cap {t.transfers_cap})"
    )
    return 0


def cmd_peers(args: Args) -> int:
    from kvmesh.daemon.control import control_status

    peers = [p for p in control_status(data_dir(args)).peers if args.all or p.healthy]
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "node_id": p.node_id,
                        "addresses": list(p.addresses),
                        "source": source_name(p.source),
                        "healthy": p.healthy,
                        "version": p.version,
                    }
                    for p in peers
                ],
                indent=2,
            )
        )
        return 0
    if not peers:
        print("no live peers" if not args.all else "no peers known")
    for p in peers:
        state = "live" if p.healthy else f"lost ({p.failures} failed checks)"
        print(f"{p.node_id}  {', '.join(p.addresses)}  {source_name(p.source)}  {state}")
    return 0


def source_name(source: int) -> str:
    """PEER_SOURCE_MDNS -> mdns."""
    from kvmesh.v1 import control_pb2 as cpb

    return cpb.PeerSource.Name(source).removeprefix("PEER_SOURCE_").lower()


def mesh_peers(args: Args) -> list[str]:
    """--peer addresses, else the live peers of the local daemon, if one runs."""
    from kvmesh.daemon.control import live_peer_addresses

    if args.peer:
        return list(args.peer)
    if args.no_mesh:
        return []
    return live_peer_addresses(data_dir(args))


def cmd_prefill(args: Args) -> int:
    import time

    from kvmesh.caches.defaults import DEFAULT_COMPRESSION
    from kvmesh.caches.prefill import prefill
    from kvmesh.caches.presses import make_press
    from kvmesh.caches.sparse import SparseKVCache, SparseQuantizedKVCache
    from kvmesh.codec.encode import EncodeOptions, encode_cache

    texts = prompt_texts(args)
    config = {
        k: v for k, v in {"ratio": args.ratio, "budget": args.budget, "kv_bits": args.kv_bits}.items() if v is not None
    }
    if args.compress and (args.method or config):
        raise KvmeshError("--compress chooses the method itself: give it alone, or --method with its options")
    method, defaults = DEFAULT_COMPRESSION if args.compress else (args.method or "full", {})
    press = make_press(method, {**defaults, **config})
    store = open_store(args)
    model, tokenizer, fp = load_model(args.model)
    tokens = prompt_tokens(tokenizer, *texts, chat=args.chat)
    # Known before the work: a store whose disk cannot take the cache (counted uncompressed).
    itemsize = 4 if fp.dtype == "float32" else 2
    if problem := store.lacks_space(2 * fp.num_layers * fp.num_kv_heads * fp.head_dim * itemsize * len(tokens)):
        raise KvmeshError(f"not prefilling: {problem}")
    bar, update = progress_bar("prefill", "tokens")
    start = time.perf_counter()
    with bar:
        cached = prefill(model, tokens, press, progress=update)
    elapsed = time.perf_counter() - start
    options = EncodeOptions(codec=args.codec)
    manifest = store.add(*encode_cache(cached.cache, fp, tokens, press, options, tail_kl=cached.tail_kl))
    result = {
        "cache_id": manifest.cache_id,
        "tokens": len(tokens),
        "prefill_s": round(elapsed, 3),
        "dense_bytes": cached.dense_nbytes,
        "bytes": cached.nbytes,
        "stored_bytes": manifest.encoding.encoded_bytes,
        "tail_kl": cached.tail_kl,
    }
    if press.lossy and not any(isinstance(c, (SparseKVCache, SparseQuantizedKVCache)) for c in cached.cache):
        print(
            f"note: {press.method} changed nothing: it compresses full-attention layers only, and this model "
            "has none outside sliding windows, recurrent state or CacheLists (`kvmesh cache show` lists them)",
            file=sys.stderr,
        )
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        loss = "" if cached.tail_kl is None else f"; measured loss {cached.tail_kl:.4f} nats/token on its tail"
        print(
            f"stored {manifest.cache_id}: {len(tokens)} tokens prefilled in {elapsed:.2f} s, "
            f"{cached.dense_nbytes:,} -> {cached.nbytes:,} bytes ({press.method}), "
            f"{manifest.encoding.encoded_bytes:,} on disk{loss}"
        )
    return 0


def cmd_fetch(args: Args) -> int:
    from kvmesh.codec.compat import ReceiverProfile
    from kvmesh.model.fingerprint import fingerprint
    from kvmesh.net.client import PeerClient

    profile = ReceiverProfile(fingerprint(args.model), max_kl=args.max_kl)
    bar, update = progress_bar("fetch", "bytes")
    with bar, PeerClient(args.peer, credentials=mesh_credentials(args)) as client:
        fetched = client.fetch(args.cache_id, profile, num_tokens=args.tokens, store=open_store(args), progress=update)
    print(
        f"fetched {fetched.manifest.cache_id} from {args.peer}: {fetched.manifest.prefix.num_tokens} tokens, "
        f"{fetched.wire_bytes:,} bytes in {fetched.seconds:.2f} s"
    )
    return 0


def cmd_generate(args: Args) -> int:
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    from kvmesh.fetch_or_prefill import Rates
    from kvmesh.generation import generate

    texts = prompt_texts(args)
    model, tokenizer, fp = load_model(args.model)
    tokens = prompt_tokens(tokenizer, *texts, chat=args.chat)
    if args.seed is not None:
        mx.random.seed(args.seed)
    bar, update = progress_bar("fetch", "bytes")
    with bar:
        result = generate(
            model,
            fp,
            tokens,
            open_store(args),
            mesh_peers(args),
            args.max_tokens,
            update,
            credentials=mesh_credentials(args),
            sampler=make_sampler(temp=args.temp, top_p=args.top_p),
            stop_tokens=set(tokenizer.eos_token_ids),
            max_kl=args.max_kl,
            rates=None if args.fetch == "always" else Rates(data_dir(args)),
        )
    text = tokenizer.decode(result.tokens)
    source = result.source
    saving = result.estimated_saving_s
    if args.json:
        print(
            json.dumps(
                {
                    "text": text,
                    "tokens": result.tokens,
                    "prefix_from": source.where,
                    "prefix_tokens": source.tokens,
                    "prompt_tokens": result.prompt_tokens,
                    "fetch_s": round(source.seconds, 4),
                    "wire_bytes": source.wire_bytes,
                    "prefill_s": round(result.prefill_s, 4),
                    "generate_s": round(result.generate_s, 4),
                    "estimated_saving_s": None if saving is None else round(saving, 3),
                    "skipped": source.skipped,
                    "choices": source.choices,
                },
                indent=2,
            )
        )
        return 0
    print(text)
    print(file=sys.stderr)
    if source.tokens:
        print(
            f"prefix: {source.tokens} of {result.prompt_tokens} tokens from {source.where} "
            f"({source.wire_bytes:,} bytes on the wire, {source.seconds:.2f} s)",
            file=sys.stderr,
        )
    else:
        print(f"prefix: none cached; all {result.prompt_tokens} tokens prefilled here", file=sys.stderr)
    print(
        f"prefill of the remaining {result.prompt_tokens - source.tokens} tokens: {result.prefill_s:.2f} s; "
        f"{len(result.tokens)} tokens generated in {result.generate_s:.2f} s",
        file=sys.stderr,
    )
    if saving is not None:
        print(f"estimated time saved against prefilling the cached tokens here: {saving:.2f} s", file=sys.stderr)
    for reason in source.skipped:
        print(f"skipped: {reason}", file=sys.stderr)
    if args.explain:
        for choice in source.choices or ["no peer had a longer cached prefix: nothing to choose"]:
            print(f"choice: {choice}", file=sys.stderr)
    return 0


def cmd_serve(args: Args) -> int:
    """Flags, then the config file's [serve] table, then the defaults of ServeOptions."""
    from kvmesh.daemon.config import load_serve_settings
    from kvmesh.fetch_or_prefill import Rates
    from kvmesh.serve.server import ServeOptions, check_exposure, serve

    settings = load_serve_settings(Path(args.config) if args.config else None)

    def pick(name: str) -> Any:
        given = getattr(args, name)
        return given if given is not None else settings.get(name, getattr(ServeOptions, name))

    model = args.model or settings.get("model")
    if not model:
        raise KvmeshError("give a model (kvmesh serve MODEL), or set `model` in the config's [serve] table")
    api_key = args.api_key or settings.get("api_key") or os.environ.get("KVMESH_API_KEY")
    options = ServeOptions(
        host=pick("host"),
        port=pick("port"),
        api_key=api_key,
        memory_bytes=pick("memory_bytes"),
        min_store_tokens=pick("min_store_tokens"),
        max_tokens=pick("max_tokens"),
        idle_timeout=pick("idle_timeout"),
        compress=bool(pick("compress")),
        fetch=pick("fetch"),
    )
    if options.fetch not in ("auto", "always"):
        raise KvmeshError(f"fetch must be auto or always, not {options.fetch!r} (the config's [serve] table)")
    check_exposure(options.host, api_key)  # before the model loads
    store = None if args.no_store else open_store(args)
    loaded = load_model(model)
    static = args.peer or settings.get("peers")
    if static or args.no_mesh:
        peers: Any = [] if args.no_mesh else list(static or [])
    else:
        from kvmesh.daemon.control import live_peer_addresses

        peers = lambda: live_peer_addresses(data_dir(args))  # noqa: E731 (asked again for each request)
    serve(
        model,
        loaded,
        store,
        peers,
        mesh_credentials(args),
        options,
        announce=lambda line: print(line, flush=True),
        rates=None if args.no_mesh else Rates(data_dir(args)),
    )
    return 0


def cmd_service(args: Args) -> int:
    from kvmesh.daemon.service_files import service_file

    platform = args.platform or ("macos" if sys.platform == "darwin" else "linux")
    default_path, content, enable = service_file(platform)
    if args.print:
        sys.stdout.write(content.decode())
        return 0
    path = Path(args.output) if args.output else default_path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    print(f"wrote {path}; turn it on with: {enable}")
    return 0


def cmd_demo(args: Args) -> int:
    from kvmesh.demo import run_demo

    return run_demo(steps=args.steps)


def build_parser() -> argparse.ArgumentParser:
    from kvmesh.caches.defaults import DEFAULT_COMPRESSION
    from kvmesh.model.presets import PRESETS, REAL_PRESETS

    parser = argparse.ArgumentParser(
        prog="kvmesh",
        description="Share LLM KV caches between Apple-silicon Macs on one network.",
    )
    parser.add_argument("--version", action="version", version=f"kvmesh {__version__}")
    parser.add_argument(
        "--data-dir", default=None, help="daemon data directory (default: the platform data dir, or $KVMESH_DATA_DIR)"
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    def command(name: str, func: Callable, help: str, parent=commands, **kwargs) -> argparse.ArgumentParser:
        sub = parent.add_parser(name, help=help, description=kwargs.pop("description", help), **kwargs)
        sub.set_defaults(func=func)
        return sub

    def max_kl_option(sub: argparse.ArgumentParser) -> None:
        sub.add_argument(
            "--max-kl",
            type=float,
            help="quality floor: refuse lossy caches whose producer measured a loss above this (nats/token on "
            "the context's tail; see `kvmesh cache show`) or did not measure one; lossless caches always pass",
        )

    def fetch_option(sub: argparse.ArgumentParser) -> None:
        sub.add_argument(
            "--fetch",
            choices=["auto", "always"],
            default=None,
            help="auto (default): fetch a peer's cache only when that is expected to beat prefilling its tokens "
            "here (link rates measured per peer, this model's prefill rate measured here; kept in the data dir); "
            "always: whenever a peer has a longer prefix",
        )

    def store_option(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--store", default=None, help="store directory (default: the daemon's, or <data dir>/store)")

    def prompt_options(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("model", help="model directory or Hugging Face repo id")
        sub.add_argument("--file", help="a text file: its tokens come first (the shared prefix)")
        sub.add_argument("--prompt", help="text after the file (or the whole prompt)")
        sub.add_argument(
            "--chat",
            action="store_true",
            help="wrap file and prompt in one user message of the "
            "model's chat template (as mlx_lm.cache_prompt does for its caches)",
        )

    model = commands.add_parser("model", help="build test models and show model fingerprints")
    model_commands = model.add_subparsers(title="model commands", metavar="COMMAND", required=True)
    make = command(
        "make-test",
        cmd_model_make_test,
        "build an offline model: random weights, or a real one from an installed package",
        model_commands,
        description="Presets: "
        + "; ".join(f"{k}: {p.description}" for presets in (PRESETS, REAL_PRESETS) for k, p in presets.items()),
    )
    make.add_argument("dir", help="directory to create (must not exist, or be empty)")
    make.add_argument("--preset", default="tiny", choices=sorted([*PRESETS, *REAL_PRESETS]))
    make.add_argument("--seed", type=int, default=0, help="weight initialisation seed (random presets)")
    make.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16"],
        default="float32",
        help="real presets: the dtype of the weights, dequantized from the shipped 4-bit file (default "
        "float32: fastest on a CPU; float16 or bfloat16 on a Mac's GPU)",
    )
    info = command("info", cmd_model_info, "print the fingerprint of a local model directory", model_commands)
    info.add_argument("path", help="model directory (config.json, *.safetensors, tokenizer)")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.add_argument("--repo-id", default="", help="Hugging Face repo id, if known")
    info.add_argument("--revision", default="", help="Hugging Face revision, if known")

    cache = commands.add_parser("cache", help="list, check, delete, export and import caches in the local store")
    store_option(cache)
    cache_commands = cache.add_subparsers(title="cache commands", metavar="COMMAND", required=True)
    listing = command("list", cmd_cache_list, "list stored caches", cache_commands)
    listing.add_argument("--json", action="store_true", help="print JSON")
    show = command("show", cmd_cache_show, "what a stored cache holds, layer by layer", cache_commands)
    show.add_argument("cache_id")
    show.add_argument("--json", action="store_true", help="print the manifest and layer report as JSON")
    export = command("export", cmd_cache_export, "write a stored cache to one file", cache_commands)
    export.add_argument("cache_id")
    export.add_argument("file")
    delete = command("delete", cmd_cache_delete, "remove a cache from the store", cache_commands)
    delete.add_argument("cache_id")
    verify = command(
        "verify",
        cmd_cache_verify,
        "check every chunk of a cache (or --all); damaged ones are quarantined",
        cache_commands,
    )
    verify.add_argument("cache_id", nargs="?")
    verify.add_argument("--all", action="store_true", help="every cache in the store")
    imported = command("import", cmd_cache_import, "import a file written by `cache export`", cache_commands)
    imported.add_argument("file")
    import_mlx = command(
        "import-mlx",
        cmd_cache_import_mlx,
        "import an mlx-lm prompt-cache file (from mlx_lm.cache_prompt)",
        cache_commands,
        description="mlx-lm files do not record their prompt: give the same prompt and model.",
    )
    import_mlx.add_argument("file")
    import_mlx.add_argument("--model", required=True, help="the model directory the cache was made with")
    source = import_mlx.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the prompt given to mlx_lm.cache_prompt")
    source.add_argument("--prompt-file", help="a file holding that prompt")
    import_wp30 = command(
        "import-wp30",
        cmd_cache_import_wp30,
        "import a wp30-cache-2 file (plain, gzip or zstd)",
        cache_commands,
        description="wp30 files hold only a hash of their prompt: give the model and the same prompt "
        "(--file and/or --prompt, --chat as when it was made). Schema, geometry, prompt and every layer "
        "are checked before anything is stored.",
    )
    import_wp30.add_argument("path", help="the wp30 file")
    prompt_options(import_wp30)
    export_wp30 = command(
        "export-wp30",
        cmd_cache_export_wp30,
        "write a stored cache as a wp30-cache-2 file",
        cache_commands,
        description="The file records a hash of the prompt's tokens: give the model and the prompt the cache holds.",
    )
    export_wp30.add_argument("cache_id")
    export_wp30.add_argument("path", help="the file to write")
    prompt_options(export_wp30)
    export_wp30.add_argument(
        "--compression", choices=["none", "gzip", "zstd"], default="none", help="compress the whole file"
    )
    export_mlx = command(
        "export-mlx", cmd_cache_export_mlx, "write a stored cache as an mlx-lm prompt-cache file", cache_commands
    )
    export_mlx.add_argument("cache_id")
    export_mlx.add_argument("file")
    export_mlx.add_argument("--model", required=True, help="model path or hub id recorded for mlx_lm.generate")

    mesh = commands.add_parser("mesh", help="create or join the mesh of your Macs (certificates for mutual TLS)")
    mesh_commands = mesh.add_subparsers(title="mesh commands", metavar="COMMAND", required=True)
    init = command("init", cmd_mesh_init, "create a new mesh (once, on the first Mac)", mesh_commands)
    init.add_argument("--name", default="", help="a name for the mesh, shown in its CA certificate")
    command("export", cmd_mesh_export, "print the mesh secret for `mesh join` on your other Macs", mesh_commands)
    join = command("join", cmd_mesh_join, "join the mesh printed by `mesh export` on another Mac", mesh_commands)
    join.add_argument("bundle", help="the line `kvmesh mesh export` printed, or - to read it from stdin")
    join.add_argument("--replace", action="store_true", help="leave the mesh this node belongs to for this one")
    command("renew", cmd_mesh_renew, "issue this node a fresh certificate now (also done automatically)", mesh_commands)
    command("status", cmd_mesh_status, "whether this node belongs to a mesh", mesh_commands)

    daemon = command(
        "daemon",
        cmd_daemon,
        "run the daemon: serve the store, advertise, find peers",
        description="Settings come from --config (default: the platform config dir's config.toml), "
        "then KVMESH_<SETTING> variables, then these flags.",
    )
    daemon.add_argument("--config", help="TOML file with the settings below (names with _ or -)")
    store_option(daemon)
    daemon.add_argument(
        "--interface",
        action="append",
        help="IP address to serve and advertise on (repeat); default: this machine's routable IPv4 addresses",
    )
    daemon.add_argument("--port", type=int, help="port (default 7077; 0: any free port)")
    daemon.add_argument("--peer", action="append", help="host:port of a peer to use without discovery (repeat)")
    daemon.add_argument("--no-discovery", action="store_true", help="no mDNS: static peers only")
    daemon.add_argument("--max-transfers", type=int, help="transfers served at once (default 4); others wait")
    daemon.add_argument(
        "--store-budget", type=int, help="bytes the store may hold (default -1: 10%% of its disk; 0: no limit)"
    )
    daemon.add_argument("--health-interval", type=float, help="seconds between peer health checks (default 1)")
    daemon.add_argument("--log-format", choices=["text", "json"])
    daemon.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    daemon.add_argument("--grace", type=float, default=10.0, help="seconds transfers in flight get at shutdown")
    daemon.add_argument("--share-model", action="append", help="share only caches of this model id (repeat)")
    daemon.add_argument("--read-only", action="store_true", help="take no publishes from peers")
    daemon.add_argument(
        "--publisher", action="append", help="node id allowed to publish here (repeat); default: every member"
    )
    daemon.add_argument("--idle-timeout", type=float, help="seconds a peer's stream may stall (default 30)")
    daemon.add_argument("--peer-rate", type=float, help="calls per second allowed per peer (default 50)")

    status = command("status", cmd_status, "show what the local daemon is doing")
    status.add_argument("--json", action="store_true", help="print JSON")
    peers = command("peers", cmd_peers, "list the peers the local daemon knows")
    peers.add_argument("--all", action="store_true", help="also peers that stopped answering")
    peers.add_argument("--json", action="store_true", help="print JSON")

    prefill = command("prefill", cmd_prefill, "prefill a prompt with a local model and store its (compressed) cache")
    prompt_options(prefill)
    store_option(prefill)
    prefill.add_argument(
        "--method", help="compression method: full (the default), quantize, streaming_llm, snapkv, knorm, kvzip"
    )
    prefill.add_argument(
        "--compress",
        action="store_true",
        help="compress with the measured default ("
        + ", ".join([DEFAULT_COMPRESSION[0], *(f"{k} {v}" for k, v in DEFAULT_COMPRESSION[1].items())])
        + "; see README)",
    )
    prefill.add_argument("--ratio", type=float, help="fraction of tokens to evict")
    prefill.add_argument("--budget", type=int, help="tokens to keep per layer")
    prefill.add_argument("--kv-bits", type=int, help="quantize what is kept to 2-8 bits")
    prefill.add_argument("--codec", default="zstd", choices=["zstd", "none"], help="wire and disk encoding")
    prefill.add_argument("--json", action="store_true", help="print JSON")

    fetch = command("fetch", cmd_fetch, "fetch a cache from a peer into the local store")
    fetch.add_argument("cache_id")
    fetch.add_argument("--peer", required=True, help="host:port of the peer")
    fetch.add_argument("--model", required=True, help="the local model the cache must fit")
    fetch.add_argument("--tokens", type=int, default=0, help="only a block-aligned prefix of this many tokens")
    max_kl_option(fetch)
    store_option(fetch)

    generate = command(
        "generate",
        cmd_generate,
        "generate, reusing the longest cached prefix on the mesh",
        description="The local store is asked first, then peers (--peer, or the local daemon's); a peer's "
        "cache is fetched when that is expected to beat prefilling it here (--fetch, --explain). Only the "
        "tokens after the cached prefix are prefilled.",
    )
    prompt_options(generate)
    store_option(generate)
    generate.add_argument("--max-tokens", type=positive_int, default=64, help="tokens to generate (default 64)")
    generate.add_argument("--temp", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    generate.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (default 1)")
    generate.add_argument("--seed", type=int, help="random seed, for repeatable sampling")
    generate.add_argument("--peer", action="append", help="host:port of a peer to ask (repeat)")
    generate.add_argument("--no-mesh", action="store_true", help="only the local store")
    fetch_option(generate)
    generate.add_argument(
        "--explain", action="store_true", help="say, for each peer's cache, why it was fetched or prefilled instead"
    )
    max_kl_option(generate)
    generate.add_argument("--json", action="store_true", help="print JSON")

    serve = command(
        "serve",
        cmd_serve,
        "serve the OpenAI API (chat and text completions) with the mesh as prompt cache",
        description="Requests are served one at a time. Their prompt cache is memory, then the local store, "
        "then the mesh's peers (--peer, or the local daemon's); after each request its cache goes back to "
        "memory and, when long enough, to the store, where peers find it.",
    )
    serve.add_argument("model", nargs="?", help="model directory or Hugging Face repo id (default: [serve] model)")
    serve.add_argument("--config", help="TOML file whose [serve] table gives defaults (default: the daemon's)")
    serve.add_argument("--host", help="address to serve on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8080; 0: any free port)")
    serve.add_argument("--api-key", help="require this bearer key (default $KVMESH_API_KEY; needed off loopback)")
    serve.add_argument("--peer", action="append", help="host:port of a peer to ask (repeat)")
    serve.add_argument("--no-mesh", action="store_true", help="only memory and the local store")
    serve.add_argument("--no-store", action="store_true", help="only memory and the mesh; keep nothing on disk")
    fetch_option(serve)
    store_option(serve)
    serve.add_argument("--memory-bytes", type=positive_int, help="bytes of live caches in memory (default 2 GiB)")
    serve.add_argument(
        "--min-store-tokens",
        type=positive_int,
        help="caches of at least this many tokens also go to the store (default 512)",
    )
    serve.add_argument("--max-tokens", type=positive_int, help="default max_tokens of a request (default 512)")
    serve.add_argument("--idle-timeout", type=float, help="seconds a peer's transfer may stall (default 10)")
    serve.add_argument(
        "--compress",
        action="store_true",
        default=None,
        help="keep caches in the store compressed with the measured default (8-bit; see README)",
    )

    service = command("service", cmd_service, "write a launchd (macOS) or systemd (Linux) service for the daemon")
    service.add_argument("--platform", choices=["macos", "linux"], help="default: this machine's")
    service.add_argument("--output", help="where to write it (default: the per-user location)")
    service.add_argument("--print", action="store_true", help="print it instead of writing it")

    demo = command("demo", cmd_demo, "run the whole mesh locally on a built-in tiny model")
    demo.add_argument("--steps", type=int, default=24, help="tokens to generate")
    return parser


def main(argv: list[str] | None = None) -> int:
    from kvmesh.allocator import tune_allocator

    args = build_parser().parse_args(argv)
    tune_allocator()
    try:
        return args.func(args)
    except KvmeshError as e:
        print(f"kvmesh: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kvmesh: interrupted", file=sys.stderr)
        return 130
    except (OSError, sqlite3.Error) as e:  # the machine said no (a full disk, permissions, a broken file)
        print(f"kvmesh: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        if os.environ.get("KVMESH_DEBUG"):
            raise
        print(f"kvmesh: error: unexpected {type(e).__name__}: {e} (KVMESH_DEBUG=1 shows where)", file=sys.stderr)
        return 1
