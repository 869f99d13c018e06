#!/usr/bin/env python3
"""A peer that sends whatever artefact it holds, as a real process: the real service, but its
Artifact call reads the file as it is (no digest or sanity check, as a liar or an older version
serves it), and with --announce its manifests claim artefacts of that many bytes, which it then
streams as zeros, so a receiver that asks gets every byte announced.

    python tests/support/artifact_peer.py --store DIR --calls FILE [--announce BYTES]

Each Artifact call appends `<sha256> <bytes sent>` to FILE once it ends. It prints `listening on
127.0.0.1:PORT` once it serves (plaintext, on loopback) and serves until killed. Used by
tests/unit/codec/test_poisoned_basis.py and for the figures of issue 32.
"""

import argparse
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc

from kvmesh.errors import Rejection
from kvmesh.net.server import ARTIFACT_PIECE_BYTES, KvMeshService, add_service
from kvmesh.store import CacheStore
from kvmesh.store.artifacts import artifact_store
from kvmesh.v1 import service_pb2 as spb


class ArtifactPeer(KvMeshService):
    """The real service, serving artefacts unchecked (or `announce` zeros)."""

    def __init__(self, store: CacheStore, calls: Path, announce: int):
        super().__init__(store, "artifactpeer0000")
        self.calls, self.announce = calls, announce

    def _open_cache(self, opened: spb.FetchOpen, context: grpc.ServicerContext):
        found = super()._open_cache(opened, context)
        if isinstance(found, Rejection) or not self.announce:
            return found
        manifest, records = found
        for artifact in manifest.artifacts:
            artifact.nbytes = self.announce
        return manifest, records

    def Artifact(self, request: spb.ArtifactRequest, context) -> Iterator[bytes]:
        sent = 0
        try:
            for piece in self._pieces(request.sha256):
                sent += len(piece)
                yield spb.ArtifactData(data=piece).SerializeToString()
        finally:
            with self.calls.open("a") as f:
                f.write(f"{request.sha256} {sent}\n")

    def _pieces(self, sha256: str) -> Iterator[bytes]:
        if self.announce:
            zeros = bytes(ARTIFACT_PIECE_BYTES)
            for at in range(0, self.announce, ARTIFACT_PIECE_BYTES):
                yield zeros[: min(ARTIFACT_PIECE_BYTES, self.announce - at)]
            return
        data = artifact_store(self.store.root).path(sha256).read_bytes()
        for at in range(0, len(data), ARTIFACT_PIECE_BYTES):
            yield data[at : at + ARTIFACT_PIECE_BYTES]


def start(store: Path, calls: Path, *args: object) -> tuple[subprocess.Popen, str]:
    """This script in a new process serving `store` with ARGS (its flags); (process, address) once
    it listens. The caller kills it."""
    from support.processes import start_listening  # (here: this file also runs as a script, without support)

    command = [sys.executable, __file__, "--store", str(store), "--calls", str(calls), *map(str, args)]
    return start_listening(command, "the artefact peer")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True)
    parser.add_argument("--calls", required=True, type=Path)
    parser.add_argument("--announce", type=int, default=0)
    args = parser.parse_args()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    add_service(ArtifactPeer(CacheStore(args.store), args.calls, args.announce), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"listening on 127.0.0.1:{port}", flush=True)
    threading.Event().wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
