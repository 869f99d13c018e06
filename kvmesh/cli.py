"""The `kvmesh` command line."""

import argparse
import json
import sys
from collections.abc import Callable

from . import __version__
from .errors import KvmeshError


def cmd_model_make_test(args) -> int:
    from .testmodels import make_test_model

    path = make_test_model(args.dir, preset=args.preset, seed=args.seed)
    print(f"built preset {args.preset!r} in {path}")
    return 0


def cmd_model_info(args) -> int:
    from .fingerprint import fingerprint

    fp = fingerprint(args.path, repo_id=args.repo_id, revision=args.revision)
    if args.json:
        print(json.dumps(fp.to_dict(), indent=2))
    else:
        width = max(len(k) for k in fp.to_dict())
        for key, value in fp.to_dict().items():
            print(f"{key:<{width}}  {value}")
    return 0


def read_text(path: str) -> str:
    try:
        return open(path, encoding="utf-8").read()
    except OSError as e:
        raise KvmeshError(f"{path}: cannot read: {e.strerror or e}") from e


def open_store(args):
    from .store import CacheStore

    return CacheStore(args.store)


def cmd_cache_list(args) -> int:
    entries = open_store(args).entries()
    if args.json:
        print(json.dumps([vars(e) for e in entries], indent=2))
        return 0
    if not entries:
        print("the store is empty")
    for e in entries:
        kind = "dense" if e.evicts_nothing else "sparse"
        print(f"{e.cache_id}  model {e.model_id}  {e.num_tokens:>7} tokens  {e.method:<13} {kind:<6} "
              f"{e.file_bytes:>14,} bytes")
    return 0


def cmd_cache_export(args) -> int:
    path = open_store(args).export(args.cache_id, args.file)
    print(f"exported {args.cache_id} to {path}")
    return 0


def cmd_cache_import(args) -> int:
    manifest = open_store(args).import_file(args.file)
    print(f"imported {manifest.cache_id} ({manifest.prefix.num_tokens} tokens)")
    return 0


def cmd_cache_import_mlx(args) -> int:
    from mlx_lm.utils import load_tokenizer

    from .fingerprint import fingerprint
    from .mlx_files import cache_prompt_tokens, import_prompt_cache

    text = args.prompt if args.prompt is not None else read_text(args.prompt_file)
    tokens = cache_prompt_tokens(load_tokenizer(args.model), text)
    manifest = import_prompt_cache(open_store(args), args.file, fingerprint(args.model), tokens)
    print(f"imported {manifest.cache_id} ({manifest.prefix.num_tokens} tokens)")
    return 0


def cmd_cache_export_mlx(args) -> int:
    from .mlx_files import export_prompt_cache

    path = export_prompt_cache(open_store(args), args.cache_id, args.file, args.model)
    print(f"exported {args.cache_id} to {path} for mlx_lm.generate --prompt-cache-file")
    return 0


def cmd_serve(args) -> int:
    import signal
    import threading

    from .node import node_id
    from .server import start_server

    store = open_store(args)
    me = node_id(store.root)
    running = start_server(store, me, args.listen, max_transfers=args.max_transfers)
    host = args.listen.rsplit(":", 1)[0]
    print(f"kvmesh: node {me} serving {store.root} on {host}:{running.port}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    running.stop(grace=5.0)
    print("kvmesh: stopped", flush=True)
    return 0


def cmd_demo(args) -> int:
    from .demo import run_demo

    return run_demo(steps=args.steps)


def build_parser() -> argparse.ArgumentParser:
    from .testmodels import PRESETS

    parser = argparse.ArgumentParser(
        prog="kvmesh",
        description="Share LLM KV caches between Apple-silicon Macs on one network.",
    )
    parser.add_argument("--version", action="version", version=f"kvmesh {__version__}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    model = commands.add_parser("model", help="build test models and show model fingerprints")
    model_commands = model.add_subparsers(title="model commands", metavar="COMMAND", required=True)

    make = model_commands.add_parser(
        "make-test",
        help="build an offline model with random weights (for tests, demos, benchmarks)",
        description="Presets: " + "; ".join(f"{k}: {p.description}" for k, p in PRESETS.items()),
    )
    make.add_argument("dir", help="directory to create (must not exist, or be empty)")
    make.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    make.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    make.set_defaults(func=cmd_model_make_test)

    info = model_commands.add_parser(
        "info", help="print the fingerprint of a local model directory"
    )
    info.add_argument("path", help="model directory (config.json, *.safetensors, tokenizer)")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.add_argument("--repo-id", default="", help="Hugging Face repo id, if known")
    info.add_argument("--revision", default="", help="Hugging Face revision, if known")
    info.set_defaults(func=cmd_model_info)

    cache = commands.add_parser("cache", help="list, export and import caches in the local store")
    cache.add_argument("--store", default=None, help="store directory (default: the platform data dir, "
                       "or $KVMESH_DATA_DIR/store)")
    cache_commands = cache.add_subparsers(title="cache commands", metavar="COMMAND", required=True)
    listing = cache_commands.add_parser("list", help="list stored caches")
    listing.add_argument("--json", action="store_true", help="print JSON")
    listing.set_defaults(func=cmd_cache_list)
    export = cache_commands.add_parser("export", help="write a stored cache to one file")
    export.add_argument("cache_id")
    export.add_argument("file")
    export.set_defaults(func=cmd_cache_export)
    imported = cache_commands.add_parser("import", help="import a file written by `cache export`")
    imported.add_argument("file")
    imported.set_defaults(func=cmd_cache_import)
    import_mlx = cache_commands.add_parser(
        "import-mlx", help="import an mlx-lm prompt-cache file (from `mlx_lm.cache_prompt`)",
        description="mlx-lm files do not record their prompt: give the same prompt and model.",
    )
    import_mlx.add_argument("file")
    import_mlx.add_argument("--model", required=True, help="the model directory the cache was made with")
    source = import_mlx.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the prompt given to mlx_lm.cache_prompt")
    source.add_argument("--prompt-file", help="a file holding that prompt")
    import_mlx.set_defaults(func=cmd_cache_import_mlx)
    export_mlx = cache_commands.add_parser("export-mlx", help="write a stored cache as an mlx-lm prompt-cache file")
    export_mlx.add_argument("cache_id")
    export_mlx.add_argument("file")
    export_mlx.add_argument("--model", required=True, help="model path or hub id recorded for mlx_lm.generate")
    export_mlx.set_defaults(func=cmd_cache_export_mlx)

    serve = commands.add_parser("serve", help="serve the local store to peers over gRPC (no discovery)")
    serve.add_argument("--store", default=None, help="store directory (default: the platform data dir)")
    serve.add_argument("--listen", default="127.0.0.1:0", help="address:port to listen on (port 0: any free)")
    serve.add_argument("--max-transfers", type=int, default=4, help="transfers served at once; others wait")
    serve.set_defaults(func=cmd_serve)

    demo = commands.add_parser("demo", help="run the kvmesh demo on a built-in tiny model")
    demo.add_argument("--steps", type=int, default=24, help="tokens to generate in each check")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except KvmeshError as e:
        print(f"kvmesh: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kvmesh: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
