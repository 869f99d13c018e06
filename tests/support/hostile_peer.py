#!/usr/bin/env python3
"""A misbehaving mesh member, as a real process: a peer service that answers lookups with bogus
candidates, stalls before it answers a fetch, or trickles the chunks of a real cache.

    python tests/support/hostile_peer.py --store DIR [--bogus N] [--stall SECONDS] [--trickle SECONDS]

It prints `listening on 127.0.0.1:PORT` once it serves (plaintext, on loopback: the receivers in
the tests are local) and serves until killed. Used by tests/scenario/test_misbehaving_member.py and the soak.
"""

import argparse
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvmesh.codec.prefix import BLOCK_SIZE
from kvmesh.errors import Rejection
from kvmesh.net.server import KvMeshService, add_service
from kvmesh.net.transport import SERVICE_NAME
from kvmesh.store import CacheStore
from kvmesh.v1 import service_pb2 as spb

BOGUS_PREFIX = "b0605"


class Hostile(KvMeshService):
    """The real service, with lies: `bogus` invented candidates (and one claiming a billion matched
    tokens) in every lookup answer, a `stall` before a fetch of an invented cache is refused, and
    `trickle` seconds between the chunk frames of a real one."""

    def __init__(self, store: CacheStore, *, bogus: int, stall: float, trickle: float):
        super().__init__(store, "hostilehostile00")
        self.bogus, self.stall, self.trickle = bogus, stall, trickle

    def Lookup(self, request, context):
        response = super().Lookup(request, context)
        claimed = len(request.block_hashes) * BLOCK_SIZE
        for i in range(self.bogus):
            response.candidates.add(
                cache_id=f"{BOGUS_PREFIX}{i:027x}",
                num_tokens=claimed,
                matched_tokens=claimed,
                cuttable=True,
                method="full",
                raw_bytes=1000,
                stored_bytes=1000,
            )
        if self.bogus:
            response.candidates.add(
                cache_id=f"{BOGUS_PREFIX}{'f' * 27}",
                num_tokens=10**9,
                matched_tokens=10**9,
                cuttable=True,
                method="full",
                stored_bytes=1000,
            )
        return response

    def _open_cache(self, opened: spb.FetchOpen, context: grpc.ServicerContext):
        if opened.cache_id.startswith(BOGUS_PREFIX):
            time.sleep(self.stall)  # the fault itself: a peer that takes its time, then has nothing
            context.abort(grpc.StatusCode.NOT_FOUND, "no such cache after all")
        found = super()._open_cache(opened, context)
        if isinstance(found, Rejection) or not self.trickle:
            return found
        manifest, records = found
        return manifest, self._trickled(records)

    def _trickled(self, records: Iterator[bytes]) -> Iterator[bytes]:
        for record in records:
            time.sleep(self.trickle)  # the fault itself: one frame every `trickle` seconds
            yield record


def start(store, *args) -> tuple[subprocess.Popen, str]:
    """This script in a new process serving `store` with ARGS (its flags); (process, address) once
    it listens. The caller kills it."""
    from support.processes import start_listening  # (here: this file also runs as a script, without support)

    return start_listening([sys.executable, __file__, "--store", str(store), *map(str, args)], "the hostile peer")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True)
    parser.add_argument("--bogus", type=int, default=0)
    parser.add_argument("--stall", type=float, default=0.0)
    parser.add_argument("--trickle", type=float, default=0.0)
    args = parser.parse_args()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
    add_service(Hostile(CacheStore(args.store), bogus=args.bogus, stall=args.stall, trickle=args.trickle), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"listening on 127.0.0.1:{port}", flush=True)
    threading.Event().wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
