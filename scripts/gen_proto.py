#!/usr/bin/env python3
"""Regenerate the protobuf and gRPC stubs in kvmesh/v1/ from proto/kvmesh/v1/*.proto.

Run after editing a .proto file and commit the result; tests/unit/net/test_proto_stubs.py fails when the
committed stubs differ from what this script generates.
"""

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"


def generate(out_dir: Path) -> list[Path]:
    """Generate the stubs under `out_dir` (which mirrors the repo root) and return their paths."""
    sources = sorted(PROTO_DIR.glob("kvmesh/v1/*.proto"))
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(s.relative_to(PROTO_DIR)) for s in sources),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed; see the messages above")
    return sorted(p for p in (out_dir / "kvmesh" / "v1").iterdir() if p.name != "__init__.py")


if __name__ == "__main__":
    for path in generate(ROOT):
        print(path.relative_to(ROOT))
    sys.exit(0)
