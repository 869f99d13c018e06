"""`kvmesh cache`: the local store's caches: list, show, check, delete, and files in and out.

Files of other tools come in and go out here: mlx-lm prompt-cache files and wp30-cache-2 files.
Neither records the prompt's tokens, so both take the model and prompt the cache was made from.
"""

import json
import sys
from collections.abc import Callable
from typing import Any

from kvmesh.cli.common import (
    Args,
    Commands,
    data_dir,
    message_dict,
    open_store,
    print_table,
    prompt_options,
    prompt_texts,
    read_text,
    store_option,
    stored,
)
from kvmesh.cli.common import command as make_command
from kvmesh.errors import KvmeshError


def listing(args: Args) -> int:
    from datetime import datetime

    from kvmesh.codec.manifest import compression_name

    store = open_store(args)
    entries = store.entries()
    manifests = {e.cache_id: store.manifest(e.cache_id) for e in entries}
    model_name = known_names(args)
    if args.json:
        described = [
            {
                **vars(e),
                "prefix_sha256": e.prefix_sha256.hex(),
                "model": model_name(manifests[e.cache_id].model),
                "compression": compression_name(manifests[e.cache_id]),
            }
            for e in entries
        ]
        print(json.dumps(described, indent=2))
        return 0
    if not entries:
        print("the store is empty")
        return 0
    header = ("CACHE ID", "MODEL", "TOKENS", "COMPRESSION", "SERVES", "BYTES", "LAST USED")
    rows: list[tuple[str, ...]] = [
        (
            e.cache_id,
            model_name(manifests[e.cache_id].model),
            f"{e.num_tokens:,}",
            compression_name(manifests[e.cache_id]),
            # Which prompts it serves: any that shares a block-aligned prefix with it, or only its own.
            "any prefix" if e.cuttable else "exact",
            f"{e.file_bytes:,}",
            datetime.fromtimestamp(e.last_used_ms / 1000).strftime("%Y-%m-%d %H:%M"),
        )
        for e in entries
    ]
    print_table(header, rows, right=frozenset({2, 5}))
    return 0


def known_names(args: Args) -> Callable[[Any], str]:
    """A manifest's model for people: the name this Mac loaded it by (kvmesh.model.names: a
    directory's name, a repo id), else its repo id or type (codec.manifest.model_name); with its
    short id."""
    from kvmesh.codec.manifest import model_name
    from kvmesh.model.names import model_names

    names = model_names(data_dir(args))

    def name(model: Any) -> str:
        known = names.get(model.model_id)
        return f"{known} ({model.model_id[:8]})" if known else model_name(model)

    return name


def show(args: Args) -> int:
    from google.protobuf.json_format import MessageToDict

    from kvmesh.codec.manifest import (
        CODEC_NAMES,
        compression_name,
        layer_report,
        loss_text,
        served_prefixes,
        served_text,
        storage_text,
    )

    store, cache_id = stored(args)
    manifest = store.manifest(cache_id)
    layers, served = layer_report(manifest), served_prefixes(manifest)
    if args.json:
        print(json.dumps({**message_dict(manifest), "layers": layers, "serves": served}, indent=2))
        return 0
    config = MessageToDict(manifest.compression.config, preserving_proto_field_name=True)
    encoding = manifest.encoding
    print(f"cache {manifest.cache_id}: {manifest.prefix.num_tokens} tokens of model {manifest.model.model_id}")
    print(f"  compression  {compression_name(manifest)} {json.dumps(config) if config else ''}".rstrip())
    for artifact in manifest.artifacts:
        print(f"  needs        {artifact.kind} {artifact.sha256} ({artifact.nbytes:,} bytes)")
    print(
        f"  encoding     {CODEC_NAMES[encoding.codec]}, {encoding.raw_bytes:,} bytes -> "
        f"{encoding.encoded_bytes:,} in {encoding.chunk_count} chunks"
    )
    if manifest.HasField("quality"):
        print(f"  quality      {manifest.quality.metric} {loss_text(manifest.quality)}")
    print(f"  serves       {served_text(served)}")
    print(f"  stored       {storage_text(manifest)}")
    for row in layers:
        if "arrays" in row:
            held = "arrays " + " ".join("x".join(map(str, shape)) for shape in row["arrays"])
        else:
            held = f"{row['kept']:>7} of {row['of']} positions"
        window = f", window {row['window']} keep {row['keep']}" if "window" in row else ""
        print(f"  layer {row['layer']:>3}  {row['kind']:<22} {held}{window}  {row['codec']}  {row['bytes']:,} bytes")
    return 0


def export(args: Args) -> int:
    store, cache_id = stored(args)
    path = store.export(cache_id, args.file)
    print(f"exported {cache_id} to {path}")
    return 0


def delete(args: Args) -> int:
    store, cache_id = stored(args)
    store.delete(cache_id)
    print(f"deleted {cache_id}")
    return 0


def verify(args: Args) -> int:
    """Check every chunk; damaged entries go to quarantine. Exit status 1 when any was damaged."""
    from kvmesh.errors import IntegrityError

    store = open_store(args)
    if args.all == bool(args.cache_id):
        raise KvmeshError("give a cache id, or --all")
    ids = [e.cache_id for e in store.entries()] if args.all else [store.resolve(args.cache_id)]
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


def import_file(args: Args) -> int:
    manifest = open_store(args).import_file(args.file)
    print(f"imported {manifest.cache_id} ({manifest.prefix.num_tokens} tokens)")
    return 0


def import_mlx(args: Args) -> int:
    from kvmesh.errors import PromptMismatch
    from kvmesh.files.mlx_prompt_cache import import_prompt_cache
    from kvmesh.model.loaded import load_tokenizer
    from kvmesh.model.names import remember_name
    from kvmesh.model.prompt import cache_prompt_tokens

    text = args.prompt if args.prompt is not None else read_text(args.prompt_file)
    tokenizer, fp = load_tokenizer(args.model)
    remember_name(data_dir(args), fp, args.model)

    def tokens(plain: bool) -> list[int]:
        return tokenizer.encode(text) if plain else cache_prompt_tokens(tokenizer, text)

    try:
        manifest = import_prompt_cache(open_store(args), args.file, fp, tokens(args.plain))
    except PromptMismatch as e:
        # A file `kvmesh cache export-mlx` wrote from a prefill without --chat holds the plain tokens.
        if tokenizer.has_chat_template and len(tokens(not args.plain)) == e.held:
            raise KvmeshError(f"{e}; {'drop' if args.plain else 'add'} --plain: that prompt gives {e.held}") from None
        raise
    print(f"imported {manifest.cache_id} ({manifest.prefix.num_tokens} tokens)")
    return 0


def export_mlx(args: Args) -> int:
    from kvmesh.files.mlx_prompt_cache import export_prompt_cache

    store, cache_id = stored(args)
    path = export_prompt_cache(store, cache_id, args.file, args.model)
    print(f"exported {cache_id} to {path} for mlx_lm.generate --prompt-cache-file")
    return 0


def wp30_tokens(args: Args) -> tuple[list[int], Any]:
    """The prompt's tokens and the model's fingerprint, for a wp30 file (no weights are loaded)."""
    from kvmesh.model.loaded import load_tokenizer
    from kvmesh.model.names import remember_name
    from kvmesh.model.prompt import prompt_tokens

    texts = prompt_texts(args)
    tokenizer, fp = load_tokenizer(args.model)
    remember_name(data_dir(args), fp, args.model)
    return prompt_tokens(tokenizer, *texts, chat=args.chat), fp


def import_wp30(args: Args) -> int:
    from kvmesh.files.wp30 import import_wp30

    tokens, fp = wp30_tokens(args)
    imported = import_wp30(open_store(args), args.path, fp, tokens)
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


def export_wp30(args: Args) -> int:
    from kvmesh.files.wp30 import export_wp30

    tokens, fp = wp30_tokens(args)
    store, cache_id = stored(args)
    path = export_wp30(store, cache_id, args.path, tokens, fp, args.compression)
    print(f"exported {cache_id} to {path} (wp30-cache-2, compression {args.compression})")
    return 0


def add_commands(commands: Commands) -> None:
    parent = commands.add_parser(
        "cache",
        help="list, check, delete, export and import caches in the local store",
        description="The local store's caches, and files of other tools (mlx-lm, wp30) in and out of it.",
    )
    store_option(parent)
    cache = parent.add_subparsers(title="cache commands", metavar="COMMAND", required=True)

    def command(*args: Any, **kwargs: Any) -> Any:  # each takes --store after its name too
        sub = make_command(*args, **kwargs)
        store_option(sub, after_command=True)
        return sub

    cache_id_help = "the cache's id as `kvmesh cache list` prints it, or enough of its start to name one"

    sub = command(cache, "list", listing, "list stored caches")
    sub.add_argument("--json", action="store_true", help="print JSON")

    sub = command(cache, "show", show, "what a stored cache holds, layer by layer")
    sub.add_argument("cache_id", help=cache_id_help)
    sub.add_argument("--json", action="store_true", help="print the manifest and layer report as JSON")

    sub = command(cache, "export", export, "write a stored cache to one file")
    sub.add_argument("cache_id", help=cache_id_help)
    sub.add_argument("file", help="the file to write (`kvmesh cache import` reads it)")

    sub = command(cache, "delete", delete, "remove a cache from the store")
    sub.add_argument("cache_id", help=cache_id_help)

    sub = command(cache, "verify", verify, "check every chunk of a cache (or --all); damaged ones are quarantined")
    sub.add_argument("cache_id", nargs="?", help=cache_id_help)
    sub.add_argument("--all", action="store_true", help="every cache in the store")

    sub = command(cache, "import", import_file, "import a file written by `cache export`")
    sub.add_argument("file", help="the file `kvmesh cache export` wrote")

    sub = command(
        cache,
        "import-mlx",
        import_mlx,
        "import an mlx-lm prompt-cache file (from mlx_lm.cache_prompt)",
        description="mlx-lm files do not record their prompt: give the same prompt and model.",
    )
    sub.add_argument("file", help="the .safetensors file mlx_lm.cache_prompt wrote")
    sub.add_argument("--model", required=True, help="the model directory the cache was made with")
    source = sub.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the prompt given to mlx_lm.cache_prompt")
    source.add_argument("--prompt-file", help="a file holding that prompt")
    sub.add_argument(
        "--plain",
        action="store_true",
        help="the prompt's tokens without the chat template: a file `kvmesh cache export-mlx` wrote from a "
        "prefill without --chat (mlx_lm.cache_prompt applies the template when the model has one)",
    )

    sub = command(cache, "export-mlx", export_mlx, "write a stored cache as an mlx-lm prompt-cache file")
    sub.add_argument("cache_id", help=cache_id_help)
    sub.add_argument("file", help="the .safetensors file to write")
    sub.add_argument("--model", required=True, help="model path or hub id recorded for mlx_lm.generate")

    sub = command(
        cache,
        "import-wp30",
        import_wp30,
        "import a wp30-cache-2 file (plain, gzip or zstd)",
        description="wp30 files hold only a hash of their prompt: give the model and the same prompt "
        "(--file and/or --prompt, --chat as when it was made). Schema, geometry, prompt and every layer "
        "are checked before anything is stored.",
    )
    sub.add_argument("path", help="the wp30 file")
    prompt_options(sub)

    sub = command(
        cache,
        "export-wp30",
        export_wp30,
        "write a stored cache as a wp30-cache-2 file",
        description="The file records a hash of the prompt's tokens: give the model and the prompt the cache holds.",
    )
    sub.add_argument("cache_id", help=cache_id_help)
    sub.add_argument("path", help="the file to write")
    prompt_options(sub)
    sub.add_argument(
        "--compression", choices=["none", "gzip", "zstd"], default="none", help="compress the whole file (default none)"
    )
