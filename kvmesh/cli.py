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
