"""The receiver's one pass over a cache's chunks: each checked, decoded into MLX caches and kept in
the local store as it comes.

A fetch (kvmesh.reuse.fetch) runs it on chunks from the wire, and the decode-time calibration
(kvmesh.reuse.calibration) times it on chunks made here, so that what is timed is what a fetch does.
"""

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvmesh.codec.arrays import Layer
from kvmesh.codec.basis import Basis
from kvmesh.codec.chunks import Chunk
from kvmesh.codec.decode import CacheDecoder
from kvmesh.errors import StoreError
from kvmesh.store import CacheStore
from kvmesh.v1 import cache_pb2 as pb

log = logging.getLogger(__name__)


@dataclass
class Received:
    """The caches, and the manifest as the store keeps it (as it came when it was not kept)."""

    manifest: pb.CacheManifest
    cache: list[Layer]
    kept: bool


def receive(
    manifest: pb.CacheManifest, chunks: Iterable[Chunk], bases: Mapping[str, Basis], store: CacheStore | None
) -> Received:
    """The caches `manifest` and its `chunks` describe, kept in `store` in the same pass (None: kept
    nowhere). A store that fails costs only the keeping (a warning): the cache is decoded all the
    same. A damaged chunk or digest, or a layer that does not decode, raises IntegrityError before
    the store's entry is indexed, so nothing is kept."""
    decoder = CacheDecoder(manifest, bases)
    # The store writes and syncs the entry while the last layers decode; it indexes it once they have.
    decoded = decoder.feed_iter(chunks, settle=False)
    kept = store is not None
    try:
        if store is not None:
            try:
                manifest = store.add(manifest, decoded, before_commit=decoder.settle)
            except StoreError as e:
                log.warning("the fetched cache is used but not kept: %s", e)
                kept = False
        for _ in decoded:  # (what store.add left: all of it when nothing keeps it)
            pass
        return Received(manifest, decoder.finish(), kept)
    except BaseException:
        decoder.stop()  # (layers still decoding when the store failed otherwise: not left running)
        raise
