"""The commands that run a model or move a cache: `prefill`, `fetch`, `publish`, `generate`."""

import json
import sys
from typing import TYPE_CHECKING, Any

from kvmesh.cli.common import (
    Args,
    Commands,
    Stages,
    bounded,
    command,
    data_dir,
    max_kl_option,
    mesh_credentials,
    open_store,
    positive_int,
    progress_bar,
    prompt_options,
    prompt_texts,
    store_option,
    stored,
    within_context,
)
from kvmesh.errors import KvmeshError
from kvmesh.reuse.choice import FETCH_HELP, FETCH_MODES

if TYPE_CHECKING:
    from kvmesh.reuse.records import CachedPrefix, Generation


def prefill(args: Args) -> int:
    import time

    from kvmesh.caches.prefill import prefill
    from kvmesh.caches.presses import press_named
    from kvmesh.caches.sparse import SparseKVCache, SparseQuantizedKVCache
    from kvmesh.codec.encode import EncodeOptions, encode_cache
    from kvmesh.codec.manifest import compression_name, transform_coded
    from kvmesh.model.loaded import load_model
    from kvmesh.model.names import remember_name
    from kvmesh.model.prompt import prompt_tokens

    texts = prompt_texts(args)
    config = {
        k: v for k, v in {"ratio": args.ratio, "budget": args.budget, "kv_bits": args.kv_bits}.items() if v is not None
    }
    if args.compress and (args.method or config):
        raise KvmeshError("--compress chooses the codec itself: give it alone, or --method with its options")
    press = press_named(args.method, config)
    store = open_store(args)
    loaded = load_model(args.model)
    fp = loaded.fingerprint
    remember_name(data_dir(args), fp, args.model)
    tokens = prompt_tokens(loaded.tokenizer, *texts, chat=args.chat)
    within_context(args.model, len(tokens))
    # Known before the work: a store whose disk cannot take the cache (counted uncompressed).
    itemsize = 4 if fp.dtype == "float32" else 2
    if problem := store.lacks_space(2 * fp.num_layers * fp.num_kv_heads * fp.head_dim * itemsize * len(tokens)):
        raise KvmeshError(f"not prefilling: {problem}")
    bar, update = progress_bar("prefill", "tokens")
    start = time.perf_counter()
    with bar:
        cached = prefill(loaded.model, tokens, press, progress=update)
    elapsed = time.perf_counter() - start
    cache, loss, encode_s = cached.cache, cached.tail_kl, 0.0
    if args.compress:
        cache, loss, encode_s = compressed(args, store, loaded, cached.cache, tokens)
    manifest = store.add(*encode_cache(cache, fp, tokens, press, options=EncodeOptions(codec=args.codec), tail_kl=loss))
    result = {
        "cache_id": manifest.cache_id,
        "tokens": len(tokens),
        "prefill_s": round(elapsed, 3),
        "encode_s": round(encode_s, 3),
        "dense_bytes": cached.dense_nbytes,
        "bytes": manifest.encoding.raw_bytes,
        "stored_bytes": manifest.encoding.encoded_bytes,
        "compression": compression_name(manifest),
        "tail_kl": loss,
    }
    if press.lossy and not any(isinstance(c, (SparseKVCache, SparseQuantizedKVCache)) for c in cached.cache):
        print(
            f"note: {press.method} changed nothing: it compresses full-attention layers only, and this model "
            "has none outside sliding windows, recurrent state or CacheLists (`kvmesh cache show` lists them)",
            file=sys.stderr,
        )
    if args.compress and not transform_coded(manifest):
        print(
            "note: --compress changed nothing: the transform codec codes full-attention layers only, and this "
            "model has none outside sliding windows, recurrent state or CacheLists",
            file=sys.stderr,
        )
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        measured = "" if loss is None else f"; measured loss {loss:.4f} nats/token on its tail"
        print(
            f"stored {manifest.cache_id}: {len(tokens)} tokens prefilled in {elapsed:.2f} s, "
            f"{cached.dense_nbytes:,} -> {manifest.encoding.raw_bytes:,} bytes ({result['compression']}), "
            f"{manifest.encoding.encoded_bytes:,} on disk{measured}"
        )
    return 0


def compressed(args: Args, store: Any, loaded: Any, cache: list, tokens: list[int]) -> tuple[list, float | None, float]:
    """The cache transform coded at the --compress level with the model's basis (fitted now, once, if
    this Mac has none), its measured loss, and the seconds coding took."""
    import time

    from kvmesh.codec.calibration import NothingToCode
    from kvmesh.codec.coded import codable
    from kvmesh.compression import compress, model_basis

    if not any(codable(layer) for layer in cache):
        return cache, None, 0.0  # nothing the codec takes: stored as it is (the note says so)

    def announce() -> None:
        print(
            "calibrating the transform codec for this model (once; `kvmesh model calibrate` chooses the texts)",
            file=sys.stderr,
        )

    bar, update = progress_bar("calibration", "texts")
    try:
        with bar:
            basis, _ = model_basis(store.root, loaded, progress=update, on_fit=announce)
    except NothingToCode:
        return cache, None, 0.0
    start = time.perf_counter()
    done = compress(loaded.model, cache, tokens, args.compress, basis)
    return done.cache, done.tail_kl, time.perf_counter() - start


def compress_option(parser: Any, what: str) -> None:
    """`--compress [LEVEL]`: one of the measured levels (kvmesh.codec.levels), `default` when alone;
    `what` says what it does."""
    from kvmesh.codec.levels import LEVELS

    levels = "; ".join(
        f"{name}: {lv.measured()[0]:.1f}x smaller than fp16 at KL {lv.measured()[1]:.4f} (bar {lv.max_kl})"
        for name, lv in LEVELS.items()
    )
    parser.add_argument(
        "--compress",
        nargs="?",
        const="default",
        choices=list(LEVELS),
        metavar="LEVEL",
        help=f"{what} (default when given alone: default; {levels}; see README)",
    )


def prefill_arguments(parser: Any) -> None:
    from kvmesh.caches.defaults import QUANT_BITS

    prompt_options(parser)
    store_option(parser)
    parser.add_argument(
        "--method",
        help="compression method: full (the default; quantize when only --kv-bits is given), quantize, "
        "streaming_llm, snapkv, knorm, kvzip",
    )
    compress_option(parser, "transform code the cache at a measured level")
    parser.add_argument("--ratio", type=float, help="fraction of tokens to evict")
    parser.add_argument("--budget", type=int, help="tokens to keep per layer")
    parser.add_argument(
        "--kv-bits", type=int, choices=QUANT_BITS, help="quantize what is kept to this many bits per value"
    )
    parser.add_argument(
        "--codec",
        default="zstd",
        choices=["zstd", "none"],
        help="wire and disk encoding (default zstd; a --compress cache goes without: its layers are entropy coded)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON")


def fetch(args: Args) -> int:
    from kvmesh.codec.compat import ReceiverProfile
    from kvmesh.model.loaded import model_fingerprint
    from kvmesh.model.names import remember_name
    from kvmesh.net.client import PeerClient
    from kvmesh.reuse.fetch import fetch_cache
    from kvmesh.v1.service_pb2 import CodeRequest

    store = open_store(args)
    if not args.tokens and not args.compress and (held := held_entry(store, args.cache_id)):
        print(f"{held.cache_id} is already in the local store ({held.num_tokens} tokens): nothing fetched")
        return 0
    fp = model_fingerprint(args.model)
    remember_name(data_dir(args), fp, args.model)
    profile = ReceiverProfile(fp, max_kl=args.max_kl)
    bar, update = progress_bar("fetch", "bytes")
    with bar, PeerClient(args.peer, credentials=mesh_credentials(args)) as client:
        code = CodeRequest(level=args.compress) if args.compress else None  # (no link rate: code it regardless)
        fetched = fetch_cache(
            client, args.cache_id, profile, num_tokens=args.tokens, store=store, progress=update, code=code
        )
    coded = f", coded there at level {args.compress}" if args.compress else ""
    print(
        f"fetched {fetched.manifest.cache_id} from {args.peer}{coded}: {fetched.manifest.prefix.num_tokens} tokens, "
        f"{fetched.wire_bytes:,} bytes in {fetched.seconds:.2f} s"
    )
    return 0


def held_entry(store: Any, cache_id: str) -> Any:
    """The store's entry of that id, or None (the start of an id is the peer's to resolve: a cache
    here that starts so may be another one)."""
    from kvmesh.errors import NotFoundError

    try:
        return store.entry(cache_id)
    except NotFoundError:
        return None


def fetch_arguments(parser: Any) -> None:
    parser.add_argument("cache_id", help="the cache's id on the peer, or enough of its start to name one there")
    parser.add_argument("--peer", required=True, help="host:port of the peer")
    parser.add_argument("--model", required=True, help="the local model the cache must fit")
    parser.add_argument("--tokens", type=int, default=0, help="only a block-aligned prefix of this many tokens")
    compress_option(
        parser,
        "ask the peer to transform code a full cache at this level before it sends it (it must hold the "
        "model's basis, and keeps the coded copy)",
    )
    max_kl_option(parser)
    store_option(parser)


def publish(args: Args) -> int:
    from kvmesh.net.client import PeerClient

    store, cache_id = stored(args)
    with PeerClient(args.peer, credentials=mesh_credentials(args)) as client:
        published = client.offer(store, cache_id)
    if not published.sent:
        print(f"{client.address} holds {cache_id} already: nothing sent")
        return 0
    manifest = store.manifest(cache_id)
    print(
        f"published {cache_id} to {client.address} ({manifest.prefix.num_tokens} tokens, "
        f"{manifest.encoding.encoded_bytes:,} bytes); stored there as {published.cache_id}"
    )
    return 0


def publish_arguments(parser: Any) -> None:
    parser.add_argument("cache_id", help="the cache's id in the local store (`kvmesh cache list`), or its start")
    parser.add_argument("peer", help="host:port of the peer to give it to")
    store_option(parser)


def mesh_peers(args: Args) -> list[str]:
    """--peer addresses, else the live peers of the local daemon, if one runs."""
    from kvmesh.daemon.control import live_peer_addresses

    if args.peer:
        return list(args.peer)
    if args.no_mesh:
        return []
    return live_peer_addresses(data_dir(args))


def generate(args: Args) -> int:
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    from kvmesh.model.loaded import load_model
    from kvmesh.model.names import remember_name
    from kvmesh.model.prompt import prompt_tokens
    from kvmesh.reuse.calibration import ensure_calibrated
    from kvmesh.reuse.generate import generate
    from kvmesh.reuse.rates import Rates

    texts = prompt_texts(args)
    loaded = load_model(args.model)
    remember_name(data_dir(args), loaded.fingerprint, args.model)
    tokenizer = loaded.tokenizer
    tokens = prompt_tokens(tokenizer, *texts, chat=args.chat)
    within_context(args.model, len(tokens), args.max_tokens)
    if args.seed is not None:
        mx.random.seed(args.seed)
    peers = mesh_peers(args)
    rates = None if args.fetch == "always" else Rates(data_dir(args))
    if rates is not None and peers:
        ensure_calibrated(loaded.model, loaded.fingerprint, rates, announce=announce_calibration)
    with Stages() as stages:
        result = generate(
            loaded.model,
            loaded.fingerprint,
            tokens,
            open_store(args),
            peers=peers,
            max_tokens=args.max_tokens,
            progress=stages.stage("fetch", "bytes"),
            prefill_progress=stages.stage("prefill", "tokens"),
            credentials=mesh_credentials(args),
            sampler=make_sampler(temp=args.temp, top_p=args.top_p),
            stop_tokens=set(tokenizer.eos_token_ids),
            max_kl=args.max_kl,
            rates=rates,
        )
    text = tokenizer.decode(result.tokens)
    saving = result.estimated_saving_s
    if args.json:
        print(
            json.dumps(
                {
                    "text": text,
                    "tokens": result.tokens,
                    "prompt_tokens": result.prompt_tokens,
                    **result.prefix.report(),
                    "prefill_s": round(result.prefill_s, 4),
                    "generate_s": round(result.generate_s, 4),
                    "estimated_saving_s": None if saving is None else round(saving, 3),
                },
                indent=2,
            )
        )
        return 0
    print(text)
    print(file=sys.stderr)
    for line in summary_lines(result):
        print(line, file=sys.stderr)
    if args.explain:
        for line in link_lines(args):
            print(f"link: {line}", file=sys.stderr)
        for choice in choice_lines(result.prefix):
            print(f"choice: {choice}", file=sys.stderr)
    return 0


def announce_calibration() -> None:
    print(
        "measuring this Mac's prefill rate for this model, once (two prefills, of 128 and 512 tokens), and how "
        "fast it decodes the model's caches, to choose between fetching a peer's cache and prefilling it here",
        file=sys.stderr,
    )


def summary_lines(result: "Generation") -> list[str]:
    """What generate says of its prompt's prefix, from the one record of it (CachedPrefix): where it
    came from, the prefill of the rest, the time saved (by the prefill rate the choices weighed with,
    when they did) and what was skipped."""
    source, saving = result.prefix, result.estimated_saving_s
    if source.tokens:
        where = (
            f"prefix: {source.tokens} of {result.prompt_tokens} tokens from {source.where} "
            f"({source.wire_bytes:,} bytes on the wire, {source.seconds:.2f} s)"
        )
    elif source.fetch_or_prefill:
        where = (
            "prefix: a peer's cache was weighed but not used (--explain says why); "
            f"all {result.prompt_tokens} tokens prefilled here"
        )
    else:
        where = f"prefix: none cached; all {result.prompt_tokens} tokens prefilled here"
    lines = [
        where,
        f"prefill of the remaining {result.prompt_tokens - source.tokens} tokens: {result.prefill_s:.2f} s; "
        f"{len(result.tokens)} tokens generated in {result.generate_s:.2f} s",
    ]
    if saving is not None and source.expected_prefill_s is not None:
        lines.append(
            f"estimated time saved: {saving:.2f} s (prefilling the {source.tokens} cached tokens here takes about "
            f"{source.expected_prefill_s:.2f} s at this Mac's measured rate; getting them took {source.seconds:.2f} s)"
        )
    elif saving is not None:
        lines.append(
            f"estimated time saved against prefilling the cached tokens here at this run's rate: {saving:.2f} s"
        )
    return lines + [f"skipped: {reason}" for reason in source.skipped]


def choice_lines(source: "CachedPrefix") -> list[str]:
    """Each choice between a peer's cache and a prefill here, or why there was none to make."""
    if source.fetch_or_prefill:
        return [str(decision) for decision in source.fetch_or_prefill]
    if source.where.startswith("peer "):
        return [f"--fetch always: the cache at {source.where[5:]} was fetched without weighing a prefill here"]
    if source.tokens:
        return [f"no peer had a longer cached prefix than the {source.where}'s: nothing to choose"]
    return ["no peer offered a cached prefix of this prompt: nothing to choose"]


def link_lines(args: Args) -> list[str]:
    """Each peer asked and the link it is reached over, with what the local daemon measured of its
    links (for --explain)."""
    from kvmesh.daemon.control import control_status, describe_links
    from kvmesh.errors import DaemonNotRunning

    if args.peer:
        return [
            f"{p}: given by --peer, so dialled as given (the daemon measures only its own peers' links)"
            for p in args.peer
        ]
    if args.no_mesh:
        return []
    try:
        live = [p for p in control_status(data_dir(args)).peers if p.healthy and p.addresses]
    except DaemonNotRunning:
        return ["no daemon runs for this data directory: no peers were asked"]
    return [f"{p.node_id} ({p.host_name or '-'}): {describe_links(p)}" for p in live] or [
        "the daemon sees no live peer"
    ]


def generate_arguments(parser: Any) -> None:
    prompt_options(parser)
    store_option(parser)
    parser.add_argument("--max-tokens", type=positive_int, default=64, help="tokens to generate (default 64)")
    parser.add_argument(
        "--temp", type=bounded(0.0, None), default=0.0, help="sampling temperature, 0 or more (default 0: greedy)"
    )
    parser.add_argument(
        "--top-p",
        type=bounded(0.0, 1.0, low_open=True),
        default=1.0,
        help="nucleus sampling threshold, in (0, 1] (default 1)",
    )
    parser.add_argument("--seed", type=int, help="random seed, for repeatable sampling")
    parser.add_argument("--peer", action="append", help="host:port of a peer to ask (repeat)")
    parser.add_argument("--no-mesh", action="store_true", help="only the local store")
    parser.add_argument("--fetch", choices=FETCH_MODES, default="auto", help=FETCH_HELP + " (default auto)")
    parser.add_argument(
        "--explain", action="store_true", help="say, for each peer's cache, why it was fetched or prefilled instead"
    )
    max_kl_option(parser)
    parser.add_argument("--json", action="store_true", help="print JSON")


def add_commands(commands: Commands) -> None:
    prefill_arguments(
        command(commands, "prefill", prefill, "prefill a prompt with a local model and store its (compressed) cache")
    )
    fetch_arguments(command(commands, "fetch", fetch, "fetch a cache from a peer into the local store"))
    publish_arguments(
        command(
            commands,
            "publish",
            publish,
            "give a cache of the local store to a peer",
            description="The peer sees the manifest first and may refuse it (its policy: --read-only, "
            "--publisher, --max-publish-bytes, the models it shares) before any layer byte is sent.",
        )
    )
    generate_arguments(
        command(
            commands,
            "generate",
            generate,
            "generate, reusing the longest cached prefix on the mesh",
            description="The local store is asked first, then peers (--peer, or the local daemon's); a peer's "
            "cache is fetched when that is expected to beat prefilling it here (--fetch, --explain). Only the "
            "tokens after the cached prefix are prefilled.",
        )
    )
