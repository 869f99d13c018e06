"""`kvmesh model`: build offline test models, show a model's fingerprint."""

import json
from typing import Any

from kvmesh.cli.common import Args, Commands, command, group


def make_test(args: Args) -> int:
    from kvmesh.model.testmodels import make_test_model

    path = make_test_model(args.dir, preset=args.preset, seed=args.seed, dtype=args.dtype)
    print(f"built preset {args.preset!r} in {path}")
    return 0


def info(args: Args) -> int:
    from kvmesh.model.fingerprint import fingerprint

    fp = fingerprint(args.path, repo_id=args.repo_id, revision=args.revision)
    if args.json:
        print(json.dumps(fp.to_dict(), indent=2))
    else:
        width = max(len(k) for k in fp.to_dict())
        for key, value in fp.to_dict().items():
            print(f"{key:<{width}}  {value}")
    return 0


def add_commands(commands: Commands) -> None:
    from kvmesh.model.presets import PRESETS, REAL_PRESETS

    model = group(
        commands,
        "model",
        "build test models and show model fingerprints",
        "A fingerprint is what the mesh matches caches to: weights, tokenizer, chat template and geometry.",
    )
    presets: dict[str, Any] = {**PRESETS, **REAL_PRESETS}
    sub = command(
        model,
        "make-test",
        make_test,
        "build an offline model: random weights, or a real one from an installed package",
        description="Presets: " + "; ".join(f"{k}: {p.description}" for k, p in presets.items()),
    )
    sub.add_argument("dir", help="directory to create (must not exist, or be empty)")
    sub.add_argument("--preset", default="tiny", choices=sorted(presets), help="the model to build (default tiny)")
    sub.add_argument("--seed", type=int, default=0, help="weight initialisation seed (random presets; default 0)")
    sub.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16"],
        default="float32",
        help="real presets: the dtype of the weights, dequantized from the shipped 4-bit file (default "
        "float32: fastest on a CPU; float16 or bfloat16 on a Mac's GPU)",
    )
    sub = command(model, "info", info, "print the fingerprint of a local model directory")
    sub.add_argument("path", help="model directory (config.json, *.safetensors, tokenizer)")
    sub.add_argument("--json", action="store_true", help="print JSON")
    sub.add_argument("--repo-id", default="", help="Hugging Face repo id, if known")
    sub.add_argument("--revision", default="", help="Hugging Face revision, if known")
