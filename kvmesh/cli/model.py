"""`kvmesh model`: build offline test models, show a model's fingerprint, fit its codec basis."""

import json
from typing import Any

from kvmesh.cli.common import (
    Args,
    Commands,
    command,
    data_dir,
    group,
    open_store,
    positive_int,
    progress_bar,
    read_text,
)


def make_test(args: Args) -> int:
    from kvmesh.model.testmodels import make_test_model

    path = make_test_model(args.dir, preset=args.preset, seed=args.seed, dtype=args.dtype)
    print(f"built preset {args.preset!r} in {path}")
    return 0


def info(args: Args) -> int:
    from kvmesh.model.fingerprint import fingerprint
    from kvmesh.model.loaded import local_model_dir

    fp = fingerprint(local_model_dir(args.path), repo_id=args.repo_id, revision=args.revision)
    if args.json:
        print(json.dumps(fp.to_dict(), indent=2))
    else:
        width = max(len(k) for k in fp.to_dict())
        for key, value in fp.to_dict().items():
            print(f"{key:<{width}}  {value}")
    return 0


def calibrate(args: Args) -> int:
    from kvmesh.compression import model_basis
    from kvmesh.model.loaded import load_model
    from kvmesh.model.names import remember_name

    texts = {path: read_text(path) for path in args.text} if args.text else None
    store = open_store(args)
    loaded = load_model(args.model)
    remember_name(data_dir(args), loaded.fingerprint, args.model)
    bar, update = progress_bar("calibration: a prefill per text, then each layer's sensitivity", "steps")
    with bar:
        basis, calibrated = model_basis(
            store.root, loaded, texts=texts, tokens_per_text=args.tokens, refit=True, progress=update
        )
    assert calibrated is not None
    result = {
        "model_id": loaded.fingerprint.model_id,
        "basis": basis.digest,
        "bytes": basis.nbytes,
        "layers": len(basis),
        "texts": len(calibrated.basis.info["texts"]),
        "tokens": calibrated.tokens,
        "prefill_s": round(calibrated.prefill_s, 2),
        "fit_s": round(calibrated.fit_s, 2),
        "sensitivity_s": round(calibrated.sensitivity_s, 2),
        # Whether its PCA weighed the features as attention does (kvmesh.codec.attention_metric).
        "weighted": basis.weighted,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        weighed = " in the attention's weights" if basis.weighted else ""
        print(
            f"basis {basis.digest[:12]} for model {result['model_id']}: {basis.nbytes / 1e6:.2f} MB, "
            f"{len(basis)} layers, fitted on {calibrated.tokens:,} tokens of {result['texts']} texts "
            f"(prefills {calibrated.prefill_s:.1f} s, fit {calibrated.fit_s:.2f} s{weighed}, "
            f"each layer's step from its sensitivity {calibrated.sensitivity_s:.1f} s); `--compress` codes "
            "this model's caches with it, and peers fetch it once with the first such cache"
        )
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
    from kvmesh.cli.common import store_option
    from kvmesh.codec.levels import CALIBRATION_TOKENS

    sub = command(
        model,
        "calibrate",
        calibrate,
        "fit the transform codec's basis for a model (what `--compress` codes its caches with)",
        description="Prefills a few texts and fits, per full-attention layer, the principal axes of the "
        "model's keys (RoPE removed) and values. Without --text: Python's own help topics. Done on first "
        "use of --compress anyway; run it to choose the texts, or again to replace the basis (caches "
        "coded with the old one still decode: peers keep every basis by its sha256).",
    )
    sub.add_argument("model", help="model directory (or a name `kvmesh model make-test` built)")
    sub.add_argument("--text", action="append", metavar="FILE", help="a calibration text (repeat for several)")
    sub.add_argument(
        "--tokens",
        type=positive_int,
        default=CALIBRATION_TOKENS,
        help=f"tokens of each text used (default {CALIBRATION_TOKENS})",
    )
    sub.add_argument("--json", action="store_true", help="print JSON")
    store_option(sub)
    sub = command(model, "info", info, "print the fingerprint of a model")
    sub.add_argument(
        "path",
        help="model directory (config.json, *.safetensors, tokenizer), or a Hugging Face repo id already downloaded",
    )
    sub.add_argument("--json", action="store_true", help="print JSON")
    sub.add_argument("--repo-id", default="", help="Hugging Face repo id, if known")
    sub.add_argument("--revision", default="", help="Hugging Face revision, if known")
