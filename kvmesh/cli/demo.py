"""`kvmesh demo`: the whole mesh on one machine, on a built-in tiny model."""

from kvmesh.cli.common import Args, Commands, command, positive_int


def demo(args: Args) -> int:
    from kvmesh.demo import run_demo

    return run_demo(steps=args.steps)


def add_commands(commands: Commands) -> None:
    sub = command(commands, "demo", demo, "run the whole mesh locally on a built-in tiny model")
    sub.add_argument("--steps", type=positive_int, default=24, help="tokens to generate (default 24)")
