"""Model fingerprints: what exactly a model is, so caches are only ever used with the model that made them.

A KV cache is only meaningful for the exact weights, tokenizer and chat template that produced it.
The fingerprint hashes each of them separately (so a refusal can say *which* one differs) and
derives a short stable `model_id` from the hashes alone: the same files give the same id in any
directory, on any machine. Weight files are hashed once per (path, size, mtime) and remembered in a
small SQLite table, because re-reading gigabytes of weights on every start would take minutes.
"""

import hashlib
import json
import re
import sqlite3
import struct
from collections import Counter
from dataclasses import asdict, dataclass, fields
from importlib.metadata import version
from pathlib import Path
from typing import cast

from kvmesh.errors import ModelDirError
from kvmesh.v1 import model_pb2

from .. import paths

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
)
# A tokenizer needs at least one of these; the rest only configure it.
TOKENIZER_CORE = ("tokenizer.json", "tokenizer.model", "vocab.json")
SAFETENSORS_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32"}
HF_CACHE_PATH = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<rev>[0-9a-f]{7,64})")


@dataclass(frozen=True)
class ModelFingerprint:
    """What exactly a model is: its content hashes (hex), the geometry its KV cache has, where it came
    from. Two fingerprints with equal hashes describe models whose caches are interchangeable."""

    model_id: str
    model_type: str
    config_sha256: str
    weights_sha256: str
    tokenizer_sha256: str
    chat_template_sha256: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    rope_theta: float
    rope_scaling_json: str
    sliding_window: int
    repo_id: str
    revision: str
    mlx_version: str
    mlx_lm_version: str

    def to_dict(self) -> dict:
        return asdict(self)

    def to_proto(self) -> model_pb2.ModelFingerprint:
        """As sent on the wire: hashes as raw bytes, the dtype as an enum."""
        values: dict = asdict(self)
        for name in HASH_FIELDS:
            values[name] = bytes.fromhex(values[name])
        values["dtype"] = dtype_to_proto(self.dtype)
        return model_pb2.ModelFingerprint(**values)

    @classmethod
    def from_proto(cls, msg: model_pb2.ModelFingerprint) -> "ModelFingerprint":
        values = {f.name: getattr(msg, f.name) for f in fields(cls)}
        for name in HASH_FIELDS:
            values[name] = values[name].hex()
        values["dtype"] = dtype_name(msg.dtype)
        return cls(**values)


HASH_FIELDS = ("config_sha256", "weights_sha256", "tokenizer_sha256", "chat_template_sha256")


def dtype_to_proto(name: str) -> model_pb2.DType:
    """`float16` -> DTYPE_FLOAT16; an unknown name is DTYPE_UNSPECIFIED, which receivers refuse."""
    value = model_pb2.DType.Value(f"DTYPE_{name.upper()}") if name in DTYPE_NAMES else model_pb2.DTYPE_UNSPECIFIED
    return cast(model_pb2.DType, value)


# (a dict: the enum's own Name() and values() build lists on each call, and a manifest's check asks
# for every tensor's dtype)
_DTYPE_NAME = {
    value: name.removeprefix("DTYPE_").lower()
    for name, value in model_pb2.DType.items()
    if value != model_pb2.DTYPE_UNSPECIFIED
}


def dtype_name(value: int) -> str:
    """DTYPE_FLOAT16 -> `float16`; a value this version does not know gives `unknown(N)`."""
    return _DTYPE_NAME.get(value) or f"unknown({value})"


DTYPE_NAMES = ("float16", "bfloat16", "float32", "uint32", "uint8")


def canonical_json(obj) -> bytes:
    """JSON that hashes the same whatever the key order or whitespace of the file it came from."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise ModelDirError(path, f"cannot read: {e.strerror or e}") from e


def read_json(path: Path) -> dict:
    try:
        data = json.loads(read_bytes(path))
    except ValueError as e:
        raise ModelDirError(path, f"is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelDirError(path, "must hold a JSON object")
    return data


class FileHashCache:
    """sha256 of files, remembered by (absolute path, size, mtime) like `make` remembers builds."""

    def __init__(self, db_path: Path | str | None = None):
        self.db_path = Path(db_path) if db_path else paths.hash_cache_file()
        self.db_path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as db:
            db.execute(
                "CREATE TABLE IF NOT EXISTS file_hashes ("
                " path TEXT PRIMARY KEY, size INTEGER, mtime_ns INTEGER, sha256 TEXT)"
            )

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.db_path, timeout=30)

    def sha256(self, path: Path) -> str:
        try:
            path = path.resolve(strict=True)
            st = path.stat()
        except OSError as e:
            raise ModelDirError(path, f"cannot read: {e.strerror or e}") from e
        key = str(path)
        with self._connect() as db:
            row = db.execute(
                "SELECT sha256 FROM file_hashes WHERE path = ? AND size = ? AND mtime_ns = ?",
                (key, st.st_size, st.st_mtime_ns),
            ).fetchone()
        if row:
            return row[0]
        digest = hash_file(path)
        with self._connect() as db:
            db.execute(
                "INSERT OR REPLACE INTO file_hashes VALUES (?, ?, ?, ?)",
                (key, st.st_size, st.st_mtime_ns, digest),
            )
        return digest


def hash_file(path: Path, block: int = 8 << 20) -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(block):
                h.update(chunk)
    except OSError as e:
        raise ModelDirError(path, f"cannot read: {e.strerror or e}") from e
    return h.hexdigest()


def safetensors_float_dtype(path: Path) -> str:
    """The most common floating dtype in a safetensors header (scales of quantized weights count)."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError) as e:
        raise ModelDirError(path, f"is not a readable safetensors file: {e}") from e
    counts = Counter(
        SAFETENSORS_DTYPES[t["dtype"]]
        for name, t in header.items()
        if name != "__metadata__" and t.get("dtype") in SAFETENSORS_DTYPES
    )
    if not counts:
        raise ModelDirError(path, "holds no float16, bfloat16 or float32 tensor")
    return counts.most_common(1)[0][0]


def chat_template(model_dir: Path, tok_config: dict) -> str | None:
    """The chat template from wherever transformers would read it, as text."""
    if (model_dir / "chat_template.jinja").is_file():
        return read_bytes(model_dir / "chat_template.jinja").decode()
    if (model_dir / "chat_template.json").is_file():
        template = read_json(model_dir / "chat_template.json").get("chat_template")
    else:
        template = tok_config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    return canonical_json(template).decode()


def tokenizer_hash(model_dir: Path) -> tuple[str, dict]:
    """Hash of the tokenizer files, and tokenizer_config.json (without its template, hashed apart)."""
    if not any((model_dir / name).is_file() for name in TOKENIZER_CORE):
        raise ModelDirError(model_dir, f"no tokenizer: expected one of {', '.join(TOKENIZER_CORE)}")
    tok_config = {}
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = model_dir / name
        if not path.exists() and not path.is_symlink():
            continue
        if name == "tokenizer_config.json":
            tok_config = read_json(path)
            data = canonical_json({k: v for k, v in tok_config.items() if k != "chat_template"})
        else:
            data = read_bytes(path)
        h.update(f"{name}\0{sha256_bytes(data)}\n".encode())
    return h.hexdigest(), tok_config


def text_config_value(config: dict, key: str, default=None):
    """Multimodal configs nest the language model's settings under text_config."""
    if key in config:
        return config[key]
    return config.get("text_config", {}).get(key, default)


def fingerprint(
    model_dir: Path | str,
    hash_cache: FileHashCache | None = None,
    repo_id: str = "",
    revision: str = "",
) -> ModelFingerprint:
    """Fingerprint the model in `model_dir`; raises ModelDirError naming what is missing or unreadable."""
    model_dir = Path(model_dir)
    if not model_dir.exists():
        raise ModelDirError(model_dir, "no such directory")
    if not model_dir.is_dir():
        raise ModelDirError(model_dir, "is not a directory")
    config_path = model_dir / "config.json"
    if not config_path.exists():
        raise ModelDirError(model_dir, "not a model directory: config.json is missing")
    config = read_json(config_path)

    weight_files = sorted(model_dir.glob("*.safetensors"))
    if not weight_files:
        raise ModelDirError(model_dir, "no weight files: expected *.safetensors")
    hash_cache = hash_cache or FileHashCache()
    weights = "".join(f"{p.name}\0{hash_cache.sha256(p)}\n" for p in weight_files)

    tok_hash, tok_config = tokenizer_hash(model_dir)
    template = chat_template(model_dir, tok_config)
    template_hash = sha256_bytes(template.encode()) if template is not None else ""

    def required(key: str) -> int:
        value = text_config_value(config, key)
        if value is None:
            raise ModelDirError(config_path, f"lacks {key!r}")
        return int(value)

    layers, heads = required("num_hidden_layers"), required("num_attention_heads")
    kv_heads = int(text_config_value(config, "num_key_value_heads") or heads)
    head_dim = text_config_value(config, "head_dim") or required("hidden_size") // heads
    rope_scaling = text_config_value(config, "rope_scaling")

    config_hash = sha256_bytes(canonical_json(config))
    weights_hash = sha256_bytes(weights.encode())
    model_id = sha256_bytes(f"{config_hash}:{weights_hash}:{tok_hash}:{template_hash}".encode())[:16]

    if m := HF_CACHE_PATH.search(model_dir.resolve().as_posix()):
        # A hub snapshot: its folder names the repo and the exact revision (the commit hash).
        repo_id, revision = repo_id or f"{m['org']}/{m['name']}", revision or m["rev"]

    return ModelFingerprint(
        model_id=model_id,
        model_type=str(config.get("model_type", "")),
        config_sha256=config_hash,
        weights_sha256=weights_hash,
        tokenizer_sha256=tok_hash,
        chat_template_sha256=template_hash,
        num_layers=layers,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(head_dim),
        dtype=safetensors_float_dtype(weight_files[0]),
        rope_theta=float(text_config_value(config, "rope_theta") or 0.0),
        rope_scaling_json=canonical_json(rope_scaling).decode() if rope_scaling else "",
        sliding_window=int(text_config_value(config, "sliding_window") or 0),
        repo_id=repo_id,
        revision=revision,
        mlx_version=version("mlx"),
        mlx_lm_version=version("mlx-lm"),
    )
