"""Chunks back into sparse MLX caches, written straight into preallocated buffers.

The decoder writes each chunk into per-tensor MLX buffers through their zero-copy numpy views, so
decoding needs about one copy of the cache in memory, never the whole encoded payload.
"""

from collections.abc import Iterable, Iterator

import mlx.core as mx
import numpy as np

from kvmesh.caches.sparse import SparseKVCache, SparseQuantizedKVCache
from kvmesh.codec.arrays import DTYPES, UINT_OF_SIZE, uint_view
from kvmesh.codec.chunks import ChunkChecker
from kvmesh.codec.manifest import ITEMSIZE, tensor_dtype
from kvmesh.v1 import cache_pb2 as pb

SparseLayer = SparseKVCache | SparseQuantizedKVCache


class CacheDecoder:
    """Rebuilds sparse caches from checked chunks, written straight into preallocated buffers."""

    def __init__(self, manifest: pb.CacheManifest):
        self.manifest = manifest
        self.checker = ChunkChecker(manifest)
        self.buffers: list[mx.array] = []
        for spec in self.checker.specs:
            n, heads, width = spec.shape
            self.buffers.append(mx.zeros((1, heads, n, width), UINT_OF_SIZE[ITEMSIZE[tensor_dtype(spec)]]))
        mx.eval(self.buffers)
        self.views = [uint_view(b)[0] for b in self.buffers]

    def feed(self, chunk: pb.Chunk) -> None:
        self._write(chunk, self.checker.check(chunk))

    def feed_all(self, chunks: Iterable[pb.Chunk], threads: int = 1) -> None:
        for _ in self.feed_iter(chunks, threads):
            pass

    def feed_iter(self, chunks: Iterable[pb.Chunk], threads: int = 1) -> Iterator[pb.Chunk]:
        """Feed chunks (decompressed on `threads` threads), yielding each once it is written."""
        for chunk, raw in self.checker.check_all(chunks, threads):
            self._write(chunk, raw)
            yield chunk

    def _write(self, chunk: pb.Chunk, raw: bytes | np.ndarray) -> None:
        slot = self.checker.plan[chunk.index]
        view = self.views[slot.tensor]
        rows = np.frombuffer(raw, dtype=view.dtype).reshape(-1, view.shape[0], view.shape[2])
        r0 = slot.byte_offset // slot.row_bytes
        view[:, r0 : r0 + rows.shape[0], :] = rows.transpose(1, 0, 2)

    def finish(self, trailer_digest: bytes | None = None) -> list[SparseLayer]:
        """Check the payload is complete and intact, then hand over the caches."""
        self.checker.finish(trailer_digest)
        caches: list[SparseLayer] = []
        tensors = iter(zip(self.checker.specs, self.buffers, strict=True))
        for layer in self.manifest.layers:
            arrays = [buf.view(DTYPES[tensor_dtype(spec)]) for spec, buf in (next(tensors) for _ in layer.tensors)]
            if layer.kind == pb.CACHE_KIND_SPARSE_QUANTIZED_KV:
                caches.append(
                    SparseQuantizedKVCache.from_arrays(
                        tuple(arrays[:3]), tuple(arrays[3:]), layer.offset, layer.group_size, layer.bits
                    )
                )
            else:
                caches.append(SparseKVCache.from_arrays(arrays[0], arrays[1], layer.offset))
        self.buffers, self.views = [], []
        return caches


def decode_chunks(
    manifest: pb.CacheManifest, chunks: Iterable[pb.Chunk], trailer_digest: bytes | None = None, threads: int = 1
) -> list[SparseLayer]:
    """The sparse caches a manifest and its chunks describe, every chunk and the digest verified.

    With a store: `decode_chunks(store.manifest(cache_id), store.chunks(cache_id))`.
    """
    decoder = CacheDecoder(manifest)
    decoder.feed_all(chunks, threads)
    return decoder.finish(trailer_digest)
