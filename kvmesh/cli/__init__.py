"""The `kvmesh` command line: a dispatcher over one module per group of commands.

Each module (`mesh`, `model`, `cache`, `daemon`, `run`, `serve`, `demo`) keeps its commands' flags
beside their handlers and adds them with `add_commands`. Handlers import what they need when they
run, so `kvmesh --version`, `status` and `peers` never load MLX or a model.
"""

import argparse
import os
import sqlite3
import sys

from kvmesh.cli import cache, daemon, demo, mesh, model, run, serve
from kvmesh.cli.common import check_data_dir, data_dir, data_dir_option
from kvmesh.errors import KvmeshError
from kvmesh.versions import __version__

COMMAND_MODULES = (mesh, model, cache, daemon, run, serve, demo)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvmesh",
        description="Share LLM KV caches between Apple-silicon Macs on one network.",
    )
    parser.add_argument("--version", action="version", version=f"kvmesh {__version__}")
    data_dir_option(parser)
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    for module in COMMAND_MODULES:
        module.add_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    from kvmesh.allocator import tune_allocator
    from kvmesh.compat.mlx_lm import tolerate_mlx_lm_descriptor_limit

    args = build_parser().parse_args(argv)
    tune_allocator()
    tolerate_mlx_lm_descriptor_limit()  # before any handler imports mlx-lm
    try:
        check_data_dir(data_dir(args))
        return args.func(args)
    except KvmeshError as e:
        print(f"kvmesh: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kvmesh: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`kvmesh cache list | head`): nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit flush is quiet
        return 141
    except (OSError, sqlite3.Error) as e:  # the machine said no (a full disk, permissions, a broken file)
        print(f"kvmesh: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        if os.environ.get("KVMESH_DEBUG"):
            raise
        print(f"kvmesh: error: unexpected {type(e).__name__}: {e} (KVMESH_DEBUG=1 shows where)", file=sys.stderr)
        return 1
